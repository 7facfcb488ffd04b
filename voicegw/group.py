"""Several gateway processes on one vLLM engine core and one decoder (``gateway.processes`` > 1).

One asyncio process carries sessions, flow control, WebSocket I/O and vLLM's output handling under
one GIL; at a few hundred sessions it is the limit (bench/RESULTS.md). This module scales the
front end out with vLLM's own multi-client front end (what ``vllm serve --api-server-count N``
uses), not a broker of ours:

```
 voicegw serve (this process: launcher + supervisor, no sessions)
   ├── vLLM engine-core process(es)   <- launch_core_engines(), N client endpoints (ZMQ)
   ├── gateway process 0: asyncio, sessions, AsyncLLM(client_index=0), its decoder process
   ├── ...                                       (SO_REUSEPORT: the kernel spreads connections)
   └── gateway process N-1
```

* **Engine core**: launched here (``engine.vllm.launch.launch_core``: vLLM's ``launch_core_engines``)
  for N clients; each gateway
  process connects an ``AsyncLLM`` to it (``client_addresses``/``client_index``/``client_count``).
  One batch, one KV cache, one scheduler for all sessions.
* **Frame table** (:mod:`engine.vllm.channel`): created here before the engine core starts; each
  gateway process hands out its own disjoint slot range. Request ids carry the client index.
* **Load**: every gateway process writes the requests it holds into a shared array; each one's
  ``health().running_requests`` (admission control's engine load) is the sum.
* **Port**: every gateway process binds ``gateway.host:port`` with ``SO_REUSEPORT``. A client's
  retry/resume is stateless on the server (the client resends from a segment boundary), so a
  reconnect may land on any process.
* **Decoder**: one decoder process for the group, started here once the engine core is up, one
  socket and one range of sample rows per gateway process (``engine.vllm.launch.shared_decoder_plan``):
  one batch for every session, one CUDA context beside the engine core's, rather than one decoder
  per gateway process with a quarter of the batch each (bench/RESULTS.md).
* **Failure**: vLLM's front end cannot restart an engine core it did not launch. When the engine
  core or any gateway process dies, this process stops the others (1012 to clients: reconnect and
  resume) and exits 1, for the service manager to start the group again.
* **Death of this process** (``kill -9`` included): every process of the group (engine core and
  its workers, gateway processes, the decoder) dies with it within a second (``engine.lifeline``);
  the next start removes the shared-memory files left behind (``engine.shm.remove_stale``).
* **Shutdown**: SIGINT/SIGTERM go to every gateway process (graceful drain, ``shutdown_grace_s``;
  a second signal skips the grace), then the engine core stops.

The building blocks of the launch (the engine core for N clients, the frame table's shares, the
decoder's plan) are ``engine.vllm.launch``'s; this module starts and supervises the processes.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

from engine.vllm.channel import FrameTable
from engine.vllm.engine import SharedClient, VllmCodeEngine
from engine.vllm.launch import core_config, engine_dead, launch_core, shared_decoder_plan, slots_per_client
from voicegw.config import Config

log = logging.getLogger("voicegw")

#: Supervisor poll period: children and engine-core processes alive?
_POLL_S = 0.5
#: After the gateways' grace period, how long they may take to close before being killed.
_EXIT_SLACK_S = 15.0


def _gateway_process(cfg: Config, shared: SharedClient) -> None:
    """One gateway process of the group (the target of a spawned process)."""
    from engine.lifeline import arm

    arm()  # normally done by the vLLM boot sitecustomize already: dies with the launcher
    from engine.build import build_speech_engine
    from gateway.app import configure_logging, run_gateway

    configure_logging(cfg.gateway)
    try:  # a name for ps/pgrep/py-spy (vLLM's own dependency; absent: the spawn command line)
        import setproctitle

        setproctitle.setproctitle(f"voicegw-gateway-{shared.index}")
    except ImportError:
        pass
    try:
        speech = build_speech_engine(cfg.engine, shared=shared)
    except Exception as exc:  # noqa: BLE001 - one clear line, exit 2
        log.error("gateway process %d: cannot build the engine: %s", shared.index, exc)
        sys.exit(2)
    sys.exit(run_gateway(cfg, speech))


def serve_group(cfg: Config, model_dir: str) -> int:
    """``voicegw serve`` with ``gateway.processes`` > 1 (see the module docstring). Returns the
    exit code: 0 after a signal, 1 when a process of the group died, 2 when it could not start."""
    n = cfg.gateway.processes
    t0 = time.monotonic()
    proto = VllmCodeEngine(model_dir, cfg.engine, warmup=False)
    per = slots_per_client(cfg.engine.max_num_seqs, n)
    table = FrameTable(per * n, min(cfg.engine.max_model_len, proto.info.max_positions))
    made: list[str] = []  # /dev/shm files to remove when the group ends
    try:
        return _run_group(cfg, model_dir, proto, table, per, t0, made)
    except Exception as exc:  # noqa: BLE001 - startup failure (a bad engine argument...): one clear line
        log.error("cannot start %d gateway processes: %s", n, exc)
        return 2
    finally:
        for path in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        table.close()


def _run_group(cfg: Config, model_dir: str, proto: VllmCodeEngine, table: FrameTable, per: int,
               t0: float, made: list[str]) -> int:
    """The group's start and supervision (``serve_group``); the decoder samples file's path goes
    into ``made`` as soon as it exists, so that the caller removes it whatever happens."""
    n = cfg.gateway.processes
    vllm_config = core_config(proto, table, n)
    ctx = multiprocessing.get_context("spawn")
    loads = ctx.RawArray("q", n)
    from engine.decoder.client import spawn_worker

    dec_settings, shares, theirs, dec_path = shared_decoder_plan(cfg.engine, model_dir, proto.device, n)
    made.append(dec_path)

    procs: list[Any] = []  # the gateway processes spawn() started (also when launch_core fails after it)

    def spawn(configs: list[dict[str, Any]]) -> list[Any]:
        for i, c in enumerate(configs):
            shared = SharedClient(c, i, n, table.spec.to_env(), i * per, (i + 1) * per, loads, shares[i])
            p = ctx.Process(target=_gateway_process, args=(cfg, shared), name=f"voicegw-gateway-{i}")
            with _lifeline_env():  # started from this thread: PR_SET_PDEATHSIG is safe there
                p.start()
            procs.append(p)
        return procs

    stop = _Signals()
    manager = coordinator = decoder = None
    try:
        with stop.installed():
            try:
                t_launch = time.monotonic()
                manager, coordinator, _ = launch_core(vllm_config, n, spawn)
                t_core = time.monotonic()
                # after the engine core is up: vLLM sized its KV cache without the decoder's GPU
                # memory in the way (the gateway processes wait for its ready message)
                decoder = spawn_worker(dec_settings, theirs, dec_path, dec_settings.slots)
            except Exception as exc:  # noqa: BLE001 - startup failure: one clear line
                log.error("cannot start the shared engine core: %s", exc)
                _stop_all(procs, cfg, force=True)
                return 2
            finally:
                for t in theirs:
                    t.close()
                for sh in shares:
                    sh.sock.close()  # the gateway processes hold their own copies
            log.info("%d gateway processes on one engine core (pids %s), one decoder process (pid %s); "
                     "start phases: config %.1f s, engine core and its clients' handshake %.1f s, decoder "
                     "spawn %.1f s (the gateway processes log their own readiness)",
                     n, [p.pid for p in procs], decoder.pid if decoder is not None else "-",
                     t_launch - t0, t_core - t_launch, time.monotonic() - t_core)
            code = _supervise(procs, manager, stop, cfg, decoder)
    finally:
        for obj in (manager, coordinator):
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.shutdown()
        if decoder is not None:
            try:
                decoder.wait(10)  # exits once every gateway closed its socket
            except Exception:  # noqa: BLE001
                decoder.kill()
                decoder.wait()
    return code


@contextlib.contextmanager
def _lifeline_env() -> Iterator[None]:
    """``engine.lifeline.child_env()`` in this process's environment while a child is spawned."""
    from engine.lifeline import ENV, child_env

    old = os.environ.get(ENV)
    os.environ.update(child_env())
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


class _Signals:
    """SIGINT/SIGTERM counted, not raised (the supervisor loop forwards them)."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        def on_signal(signum: int, frame: Any) -> None:
            self.count += 1

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def _supervise(procs: list[Any], manager: Any, stop: _Signals, cfg: Config, decoder: Any = None) -> int:
    forwarded = 0
    deadline: float | None = None
    while True:
        if stop.count > forwarded:
            forwarded = stop.count
            for p in procs:
                if p.is_alive() and p.pid:
                    os.kill(p.pid, signal.SIGTERM)  # the first: drain; the second: skip the grace
            if deadline is None:
                deadline = time.monotonic() + cfg.gateway.shutdown_grace_s + _EXIT_SLACK_S
        if stop.count:
            if all(not p.is_alive() for p in procs):
                return 0
            if deadline is not None and time.monotonic() > deadline:
                _stop_all(procs, cfg, force=True)
                return 0
        elif (engine_dead(manager) or any(not p.is_alive() for p in procs)
              or (decoder is not None and decoder.poll() is not None)):
            dead = [p.name for p in procs if not p.is_alive()]
            if decoder is not None and decoder.poll() is not None:
                dead.append("its decoder process")
            log.error("the group lost %s; stopping the others",
                      ", ".join(dead) if dead else "its engine core")
            _stop_all(procs, cfg, force=False)
            return 1
        time.sleep(_POLL_S)


def _stop_all(procs: list[Any], cfg: Config, *, force: bool) -> None:
    for p in procs:
        if p.is_alive() and p.pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + (0 if force else cfg.gateway.shutdown_grace_s) + _EXIT_SLACK_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
