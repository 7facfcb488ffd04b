"""Several gateway processes on one or more vLLM engine cores on one device (``gateway.processes``
> 1, ``gateway.engine_cores``).

One asyncio process carries sessions, flow control, WebSocket I/O and vLLM's output handling under
one GIL; at a few hundred sessions it is the limit (bench/RESULTS.md). This module scales the
front end out with vLLM's own multi-client front end (what ``vllm serve --api-server-count N``
uses), not a broker of ours:

```
 voicegw serve (this process: launcher + supervisor, no sessions)
   ├── vLLM engine core 0            <- launch_core_engines(), M client endpoints (ZMQ)
   │     ├── gateway process 0: asyncio, sessions, AsyncLLM(client_index=0)
   │     └── ... gateway process M-1      (SO_REUSEPORT: the kernel spreads connections)
   ├── ... engine core K-1 with gateway processes (K-1)M .. KM-1
   ├── the decoder process (one socket per gateway process, of every core)
   └── on a CUDA GPU: this run's MPS daemon (``voicegw.mps``, ``gateway.cuda_mps``), started
       before the others: the cores' and decoders' kernels share the GPU instead of taking turns
```

* **Engine cores**: launched here (``engine.vllm.launch.launch_core``: vLLM's
  ``launch_core_engines``), one after the other, each for its M = N/K clients; each gateway process
  connects an ``AsyncLLM`` to its core (``client_addresses``/``client_index``/``client_count``).
  Per core: one batch, one KV cache, one scheduler. A core steps one batch at a time from one
  Python thread; K cores give the device K threads' host time (``gateway.engine_cores``).
* **Frame table** (:mod:`engine.vllm.channel`): created here before the engine core starts; each
  gateway process hands out its own disjoint slot range. Request ids carry the client index.
* **Load**: every gateway process writes the requests it holds into its core's shared array; each
  one's ``health().running_requests`` (admission control's engine load) is its core's sum.
* **Port**: every gateway process binds ``gateway.host:port`` with ``SO_REUSEPORT``. A client's
  retry/resume is stateless on the server (the client resends from a segment boundary), so a
  reconnect may land on any process.
* **Decoder**: one decoder process for the whole group, started here once the engine cores are up,
  one socket and one range of sample rows per gateway process
  (``engine.vllm.launch.shared_decoder_plan``): one batch gathering the rows of every session, and
  one CUDA context fewer than one decoder per engine core, which lost on the GPU (bench/RESULTS.md).
* **Failure, healed**: when an engine core dies, this process tells its gateway processes (vLLM's
  client of an engine core it did not start cannot see it: ``{"event": "dead"}`` on each one's
  control pipe, ``SharedClient.control``; their sessions get ``engine_unavailable`` and 1011,
  ``/healthz`` turns 503), starts a new engine core for the same clients and sends them its client
  config (``{"event": "core"}``); each gateway process reconnects and warms up (``/healthz`` 200
  again). At most 3 such restarts in 10 minutes (``RestartBudget``), then the group stops (exit 1);
  the dead core's gateway processes are told all the same, so that its sessions get
  ``engine_unavailable`` at once rather than 1012 at the end of the drain.
  A dead decoder process is replaced the same way: its gateway processes' streams fail
  (``engine_unavailable``, 1011), the launcher starts a new decoder process and sends each gateway
  process its share (``{"event": "decoder"}``), and each one attaches (``ChatTTSSpeech``'s watchdog).
  A dead MPS daemon is started again on the same directories (processes that start later need it).
  Engine cores, decoders and the MPS daemon share the restart budget.
* **Failure, not healed**: when a gateway process dies, this process stops the others (1012 to
  clients: reconnect and resume) and exits 1, for the service manager to start the group again.
* **Death of this process** (``kill -9`` included): every process of the group (engine core and
  its workers, gateway processes, the decoder, the MPS daemon and its server) dies with it within a
  second (``engine.lifeline``);
  the next start removes the shared-memory files left behind (``engine.shm.remove_stale``).
* **Shutdown**: SIGINT/SIGTERM go to every gateway process (graceful drain, ``shutdown_grace_s``;
  a second signal skips the grace), then the engine cores and decoders stop, then the MPS daemon quits.

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
from collections.abc import Callable, Iterator
from typing import Any

from engine.vllm.channel import FrameTable
from engine.vllm.engine import SharedClient, VllmCodeEngine
from engine.vllm.launch import (
    CoreLaunch,
    core_config,
    engine_dead,
    launch_core,
    shared_decoder_plan,
    slots_per_client,
)
from voicegw.config import Config
from voicegw.mps import Mps

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

        setproctitle.setproctitle(multiprocessing.current_process().name)  # voicegw-gateway-<i>
    except ImportError:
        pass
    try:
        speech = build_speech_engine(cfg.engine, shared=shared)
    except Exception as exc:  # noqa: BLE001 - one clear line, exit 2
        log.error("%s: cannot build the engine: %s", multiprocessing.current_process().name, exc)
        sys.exit(2)
    sys.exit(run_gateway(cfg, speech))


def serve_group(cfg: Config, model_dir: str, cuda_mps: Mps | None = None) -> int:
    """``voicegw serve`` with ``gateway.processes`` > 1 (see the module docstring); ``cuda_mps``:
    the run's MPS daemon (``voicegw.mps``), started again if it dies. Returns the exit code: 0
    after a signal, 1 when a process of the group died, 2 when it could not start."""
    n = cfg.gateway.processes
    if n % cfg.gateway.engine_cores:
        log.error("cannot start %d gateway processes: gateway.processes must be a multiple of "
                  "gateway.engine_cores (%d)", n, cfg.gateway.engine_cores)
        return 2
    t0 = time.monotonic()
    proto = VllmCodeEngine(model_dir, cfg.engine, warmup=False)
    per = slots_per_client(cfg.engine.max_num_seqs, n)
    table = FrameTable(per * n, min(cfg.engine.max_model_len, proto.info.max_positions))
    made: list[str] = []  # /dev/shm files to remove when the group ends
    try:
        return _run_group(cfg, model_dir, proto, table, per, t0, made, cuda_mps)
    except Exception as exc:  # noqa: BLE001 - startup failure (a bad engine argument...): one clear line
        log.error("cannot start %d gateway processes: %s", n, exc)
        return 2
    finally:
        for path in made:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        table.close()


def _run_group(cfg: Config, model_dir: str, proto: VllmCodeEngine, table: FrameTable, per: int,
               t0: float, made: list[str], cuda_mps: Mps | None) -> int:
    """The group's start and supervision (``serve_group``); each decoder samples file's path goes
    into ``made`` as soon as it exists, so that the caller removes it whatever happens. One decoder
    process serves every gateway process (``decoders`` holds it, for ``_supervise``)."""
    n = cfg.gateway.processes
    cores = cfg.gateway.engine_cores
    m = n // cores  # gateway processes per engine core
    ctx = multiprocessing.get_context("spawn")
    from engine.decoder.client import spawn_worker

    # the decoder's settings, each gateway process's share, the worker's ends, the samples file
    settings, shares, theirs, path = shared_decoder_plan(cfg.engine, model_dir, proto.device, n, cores)
    made.append(path)

    procs: list[Any] = []  # the gateway processes spawn() started (also when launch_core fails after it)
    controls: list[Any] = []  # per gateway process: where a replacement engine core's client config goes

    def spawner(core: int) -> Any:
        loads = ctx.RawArray("q", m)  # the requests each of this core's clients holds

        def spawn(configs: list[dict[str, Any]]) -> list[Any]:
            for j, c in enumerate(configs):
                i = core * m + j  # the process's place in the group: its frame-table slots
                theirs_end, ours_end = ctx.Pipe(duplex=False)
                shared = SharedClient(c, j, m, table.spec.to_env(), i * per, (i + 1) * per, loads, shares[i],
                                      control=theirs_end)
                p = ctx.Process(target=_gateway_process, args=(cfg, shared), name=f"voicegw-gateway-{i}")
                with _lifeline_env():  # started from this thread: PR_SET_PDEATHSIG is safe there
                    p.start()
                theirs_end.close()
                procs.append(p)
                controls.append(ours_end)
            return procs

        return spawn

    def core_dead(core: int) -> None:
        """Tell dead ``core``'s gateway processes (vLLM's client cannot see it by itself): their
        streams on it fail at once, whether a new engine core follows or the group stops."""
        for j in range(m):
            controls[core * m + j].send({"event": "dead"})

    def heal(core: int) -> None:
        """A new engine core for dead ``core`` (its gateway processes were told, ``core_dead``):
        they get the new client configs (listening sockets included: multiprocessing passes them)
        and reconnect by themselves."""
        launched[core].stop()

        def send(configs: list[dict[str, Any]]) -> list[Any]:
            for j, c in enumerate(configs):
                controls[core * m + j].send({"event": "core", "client_config": c})
            return procs[core * m:(core + 1) * m]

        launched[core] = launch_core(core_config(proto, table, m, 1 / cores), m, send)

    def heal_decoder(d: int) -> None:
        """A new decoder process for the dead one (``d``: 0): the gateway processes get their
        shares (sockets included: multiprocessing passes them) and attach by themselves."""
        settings, shares, theirs, path = shared_decoder_plan(cfg.engine, model_dir, proto.device, n, cores)
        made.append(path)
        try:
            for control, share in zip(controls, shares, strict=True):
                control.send({"event": "decoder", "share": share})
            decoders[d] = spawn_worker(settings, theirs, path, settings.slots)
        finally:
            for t in theirs:
                t.close()
            for sh in shares:
                sh.sock.close()  # the gateway processes hold their own copies

    stop = _Signals()
    launched: list[CoreLaunch] = []
    decoders: list[Any] = []
    try:
        with stop.installed():
            try:
                t_launch = time.monotonic()
                for core in range(cores):  # one after the other: each sizes its KV cache beside the ones up
                    launched.append(launch_core(core_config(proto, table, m, 1 / cores), m, spawner(core)))
                t_core = time.monotonic()
                # after the engine cores are up: vLLM sized their KV caches without the decoder's GPU
                # memory in the way (the gateway processes wait for the decoder's ready message)
                decoders.append(spawn_worker(settings, theirs, path, settings.slots))
            except Exception as exc:  # noqa: BLE001 - startup failure: one clear line
                log.error("cannot start the shared engine core: %s", exc)
                _stop_all(procs, cfg, force=True)
                return 2
            finally:
                for t in theirs:
                    t.close()
                for sh in shares:
                    sh.sock.close()  # the gateway processes hold their own copies
            log.info("%d gateway processes on %d engine core(s) (pids %s), %d decoder process(es) (pids %s); "
                     "start phases: config %.1f s, engine cores and their clients' handshake %.1f s, decoder "
                     "spawn %.1f s (the gateway processes log their own readiness)",
                     n, cores, [p.pid for p in procs], len(decoders), [d.pid for d in decoders],
                     t_launch - t0, t_core - t_launch, time.monotonic() - t_core)
            code = _supervise(procs, launched, stop, cfg, decoders, core_dead, heal, heal_decoder, cuda_mps=cuda_mps)
    finally:
        for c in launched:
            c.stop()
        for decoder in decoders:
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


class RestartBudget:
    """At most ``limit`` engine-core restarts within any ``window_s`` seconds."""

    def __init__(self, limit: int = 3, window_s: float = 600.0) -> None:
        self.limit = limit
        self.window_s = window_s
        self.times: list[float] = []

    def allow(self, now: float) -> bool:
        """Whether one more restart at ``now`` stays within the budget (it is counted if so)."""
        self.times = [t for t in self.times if now - t < self.window_s]
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


def _supervise(procs: list[Any], launched: list[CoreLaunch], stop: _Signals, cfg: Config, decoders: list[Any],
               core_dead: Callable[[int], None], heal: Callable[[int], None],
               heal_decoder: Callable[[int], None], budget: RestartBudget | None = None,
               cuda_mps: Mps | None = None) -> int:
    """Forward signals; tell a dead engine core's gateway processes (``core_dead``) and replace it
    (``heal``); replace a dead decoder process (``heal_decoder``) or MPS daemon (``cuda_mps``);
    all within ``budget``. Stop the group when a gateway process dies, or when one of those dies
    once too often."""
    budget = budget or RestartBudget()
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
        elif any(not p.is_alive() for p in procs):
            dead = [p.name for p in procs if not p.is_alive()]
            log.error("the group lost %s; stopping the others", ", ".join(dead))
            _stop_all(procs, cfg, force=False)
            return 1
        else:
            lost = [("engine core", k, heal) for k, core in enumerate(launched) if engine_dead(core.manager)]
            for _, k, _ in lost:
                core_dead(k)
            lost += [("decoder process", k, heal_decoder) for k, d in enumerate(decoders) if d.poll() is not None]
            if cuda_mps is not None and cuda_mps.poll() is not None:  # processes that start from now on need it
                lost.append(("CUDA MPS daemon", 0, lambda _: cuda_mps.restart()))
            for what, k, replace in lost:
                if not budget.allow(time.monotonic()):
                    log.error("%s %d died: more than %d restarts in %.0f s; stopping the group",
                              what, k, budget.limit, budget.window_s)
                    _stop_all(procs, cfg, force=False)
                    return 1
                log.warning("%s %d died: starting a new one (its gateway processes reconnect)", what, k)
                t0 = time.monotonic()
                try:
                    replace(k)
                except Exception as exc:  # noqa: BLE001 - one that cannot start: the group stops
                    log.error("cannot start a new %s %d: %s; stopping the group", what, k, exc)
                    _stop_all(procs, cfg, force=False)
                    return 1
                log.warning("%s %d replaced in %.1f s", what, k, time.monotonic() - t0)
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
