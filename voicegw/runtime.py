"""``voicegw serve``: the platform's automatic settings resolved once, then one gateway process
with its engine (``engine.build.build_speech_engine``) or a group of them (``voicegw.group``)."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from voicegw.config import Config, on_cuda

if TYPE_CHECKING:
    from voicegw.mps import Mps

log = logging.getLogger("voicegw")

#: A port in use at start is asked again for this long: the processes of a run killed just before
#: (``kill -9``, then a restart) release it within a second of its death (``engine.lifeline``).
PORT_WAIT_S = 2.0
IN_USE = "address already in use"


def serve(cfg: Config) -> int:
    """``voicegw serve``: build the engine, run the gateway until SIGINT/SIGTERM."""
    from gateway.app import configure_logging, run_gateway

    configure_logging(cfg.gateway)
    _take_over()
    problem = _port_problem(cfg.gateway.host, cfg.gateway.port)
    deadline = time.monotonic() + PORT_WAIT_S
    while problem == IN_USE and time.monotonic() < deadline:
        # a run killed just now: its processes follow it within a second (engine.lifeline)
        time.sleep(0.1)
        problem = _port_problem(cfg.gateway.host, cfg.gateway.port)
    if problem:  # before the engine's start (tens of seconds), not after
        log.error("cannot listen on %s:%d: %s", cfg.gateway.host, cfg.gateway.port, problem)
        return 2
    cuda = on_cuda_vllm(cfg)
    cfg = resolve_platform(cfg, cuda)
    if cuda:
        e = cfg.engine
        log.info("ChatTTS on vLLM on CUDA: %d gateway processes on %d engine core(s), cuda_mps=%s, enforce_eager=%s, "
                 "max_num_seqs=%d, max_num_batched_tokens=%d, decoder_max_batch=%d (the GPU defaults, for keys not set)",
                 cfg.gateway.processes, cfg.gateway.engine_cores, cfg.gateway.cuda_mps, e.enforce_eager, e.max_num_seqs,
                 e.max_num_batched_tokens, e.decoder_max_batch)
    cuda_mps = None
    if cfg.gateway.cuda_mps:  # before any process that could use CUDA starts
        from voicegw import mps

        try:
            cuda_mps = mps.start(required="gateway.cuda_mps" in cfg.explicit)
        except mps.MpsError as exc:
            log.error("cannot start CUDA MPS: %s", exc)
            return 2
    try:
        if cfg.gateway.processes > 1:
            return _serve_group(cfg, cuda_mps)
        from engine.build import build_speech_engine

        try:
            speech = build_speech_engine(cfg.engine)
        except Exception as exc:  # noqa: BLE001 - startup failure: one clear line, exit 2
            log.error("cannot start the engine: %s", exc)
            return 2
        return run_gateway(cfg, speech)
    finally:
        if cuda_mps is not None:
            cuda_mps.stop()


#: ``gateway.processes`` 0 on a CUDA vLLM engine: one asyncio process's GIL is the limit there
#: long before the GPU is, so the front end is spread over this many (bench/RESULTS.md).
AUTO_GPU_PROCESSES = 4


def on_cuda_vllm(cfg: Config) -> bool:
    """Whether ``voicegw serve`` runs ChatTTS on vLLM on a CUDA GPU: the backend allows vLLM, a
    model directory is found (no download asked for), the device is not forced to CPU, and vLLM's
    platform is CUDA."""
    e = cfg.engine
    if e.backend not in ("auto", "vllm") or e.device == "cpu" or e.download:
        return False
    from engine.model_dir import ModelNotFound, resolve_model_dir

    try:
        resolve_model_dir(e.model_dir, allow_download=False)
    except ModelNotFound:
        return False
    try:
        # vLLM's platform probe (NVML), not torch.cuda: CUDA initialised in this process would break
        # the engine core that vLLM forks from it ("Cannot re-initialize CUDA in forked subprocess")
        from engine.vllm._env import prepare

        prepare()
        from vllm.platforms import current_platform

        return bool(current_platform.is_cuda())
    except Exception:  # noqa: BLE001 - no CUDA vLLM here
        return False


def resolve_platform(cfg: Config, cuda: bool) -> Config:
    """The automatic settings resolved once, for this platform: ``GPU_DEFAULTS`` for every key not
    set explicitly when ``cuda``; ``gateway.processes`` 0 -> ``AUTO_GPU_PROCESSES`` there (with a
    fixed port), else 1; rounded up to a multiple of ``gateway.engine_cores``."""
    if cuda:
        cfg = on_cuda(cfg)
    cores = cfg.gateway.engine_cores
    n = cfg.gateway.processes or -(-(AUTO_GPU_PROCESSES if cuda and cfg.gateway.port != 0 else 1) // cores) * cores
    return dataclasses.replace(cfg, gateway=dataclasses.replace(cfg.gateway, processes=n))


def _serve_group(cfg: Config, cuda_mps: Mps | None) -> int:
    """``gateway.processes`` > 1: the launcher/supervisor of ``voicegw.group`` (which restarts
    ``cuda_mps``, this run's MPS daemon, if it dies)."""
    from engine._compat import ensure_torch_companions
    from engine.model_dir import resolve_model_dir

    ensure_torch_companions()
    try:
        if cfg.engine.backend not in ("auto", "vllm"):
            raise ValueError(f"gateway.processes > 1 needs engine.backend vllm, not {cfg.engine.backend!r}")
        model_dir = resolve_model_dir(cfg.engine.model_dir, allow_download=cfg.engine.download)
        from engine.vllm._env import prepare

        prepare()
        from voicegw.group import serve_group
    except Exception as exc:  # noqa: BLE001 - startup failure: one clear line, exit 2
        log.error("cannot start %d gateway processes: %s", cfg.gateway.processes, exc)
        return 2
    return serve_group(cfg, str(model_dir), cuda_mps)


def _take_over() -> None:
    """Before anything starts: every process started from here on dies with this one
    (``engine.lifeline``: a ``kill -9`` of ``voicegw serve`` leaves no engine core, worker, decoder
    or gateway process behind), and the shared-memory files of a run that died are removed
    (``engine.shm.remove_stale``: owner pid in the name, dead owners only)."""
    from engine.lifeline import mark_root
    from engine.shm import remove_stale

    mark_root()
    for path in remove_stale():
        log.info("removed %s, left by a run that died", path)


def _port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (None: it can, as of now)."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"cannot resolve {host!r}: {exc.strerror or exc}"
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                return IN_USE if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    return None
