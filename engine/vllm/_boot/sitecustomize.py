"""Loaded at start-up by Python processes that vLLM spawns from voicegw (see engine/vllm/_env.py).

Does nothing unless VOICEGW_VLLM_BOOT=1 is set in the environment. Then it arms
``engine.lifeline`` (the process dies with its parent, whatever killed the parent), makes vLLM
importable beside a CPU-only torch and registers the ChatTTS model, so spawned vLLM processes
work even where the ``vllm.general_plugins`` entry point is not installed (source checkouts).
"""

import os
import sys

# Only the processes vLLM runs need it: multiprocessing's resource tracker (started while the
# variable is set) would otherwise import torch and vLLM for nothing (~600 MB resident).
_SKIP = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")

if os.environ.get("VOICEGW_VLLM_BOOT") == "1" and not any(s in " ".join(getattr(sys, "orig_argv", ())) for s in _SKIP):
    try:  # first: no engine core, worker or gateway process outlives its parent (SIGKILL included)
        from engine.lifeline import arm

        arm()
    except Exception as exc:  # never break interpreter start-up
        print(f"voicegw: cannot arm the parent-death watchdog: {exc!r}", file=sys.stderr)
    try:
        from engine.vllm._env import prepare

        prepare()
        from engine.vllm.plugin import register

        register()
    except Exception as exc:  # never break interpreter start-up
        import sys

        print(f"voicegw: vLLM child preparation failed: {exc!r}", file=sys.stderr)
