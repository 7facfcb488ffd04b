"""``gateway.processes`` > 1 (``voicegw.group``): gateway processes sharing the port and one
vLLM engine core through vLLM's multi-client front end. A real ``voicegw serve`` subprocess on the
tiny checkpoint, real clients over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.lifeline import descendants
from tests.groupdiag import log_tail, no_end_report, spy_group
from tests.reliability.kill9 import free_port, health, kill9_and_check, restart_after_kill9
from tests.reliability.mps_stub import logged_pids, mps_env, mps_root
from tests.transcript import Transcript, fast_client, quiet_client

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.environ.get("VOICEGW_TEST_ENGINE", "vllm") != "vllm", reason="vLLM engine tests")


async def _start(model_dir: Path, port: int, log: Path, cores: int = 1, mps: bool = False) -> asyncio.subprocess.Process:
    """``voicegw serve`` with two gateway processes on ``cores`` engine cores, returned once both
    gateway processes answer ``/healthz``; ``mps``: ``gateway.cuda_mps`` with the MPS stand-in on
    PATH and the MPS directories under ``log``'s directory."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(mps_env(log.parent) if mps else {})}
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    args = [
        "-m", "voicegw.cli", "serve", "--gateway.port", str(port), "--gateway.processes", "2",
        "--gateway.engine_cores", str(cores),
        "--gateway.shutdown_grace_s", "5", "--engine.backend", "vllm", "--engine.device", "cpu",
        "--engine.model_dir", str(model_dir), "--engine.max_num_seqs", "16", "--engine.max_model_len", "512",
        "--engine.enforce_eager", "true", "--engine.kv_cache_gib", "0.05", "--engine.default_speaker", "2222",
        *(["--gateway.cuda_mps", "true"] if mps else []),
    ]
    out = log.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *args, cwd=ROOT, env=env,
        stdout=out, stderr=out, start_new_session=True,
    )
    pids: set[int] = set()
    try:
        for _ in range(3000):  # 5 min: engine core, two gateways, the decoder (2 CPU cores, beside the session's engine)
            if proc.returncode is not None:
                raise AssertionError(f"serve exited {proc.returncode}:\n{log_tail(log)}")
            if _text(log).count("gateway listening on") >= 2:
                h = await asyncio.to_thread(health, port)
                if h is not None:
                    pids.add(int(h["pid"]))
                    if len(pids) >= 2:
                        return proc
            await asyncio.sleep(0.1)
        kids = [_cmdline(p)[:60] for p in _children(proc.pid)]
        stacks = await asyncio.to_thread(spy_group, proc.pid)
        raise AssertionError(f"the group did not come up in 300 s (children {kids}):\n{log_tail(log)}\n{stacks}")
    except BaseException:
        _kill_group(proc.pid)  # a failed start leaves nothing running for the tests after it
        if proc.returncode is None:
            await proc.wait()
        raise


async def _speak(port: int, text: str) -> Transcript:
    t = Transcript()
    c = fast_client(f"ws://127.0.0.1:{port}/ws", t)
    await c.connect()
    await c.send_text(text)
    await c.end()
    done = await t.wait_for("utterance.done", within_s=90)
    assert done["status"] == "ok", done
    await c.close()
    return t


async def _mid_answer(port: int, n: int, first_voice: int) -> list[tuple[Any, Transcript]]:
    """``n`` sessions (real-time paced, no playback reports) each receiving a long answer."""
    talking = []
    for i in range(n):
        t = Transcript()
        c = quiet_client(f"ws://127.0.0.1:{port}/ws", t, voice=first_voice + i)
        await c.connect()
        await c.send_text(f"Session {i} tells a long story. " * 6)
        await c.end()
        talking.append((c, t))
    for _, t in talking:
        await t.wait_audio(within_s=90)
    return talking


async def _fate(t: Transcript) -> tuple[str, int | None]:
    """("ok", None) for an answer that finished, else (error code, close code)."""
    with contextlib.suppress(Exception):
        await t.wait_for("utterance.done", within_s=120)
    if t.errors():
        code = None
        with contextlib.suppress(Exception):
            code = (await t.wait_closed(within_s=5))[0]
        return str(t.errors()[0]["code"]), code
    done = t.of_type("utterance.done")
    if not done:  # neither an answer nor an error: what it did get, for the failure message
        return f"no end: {t.types()[-6:]}, {t.samples} samples, close {t.close}", None
    return str(done[0]["status"]), None


async def _allhealthy(port: int, processes: int, within_s: float) -> bool:
    """Whether ``/healthz`` answered healthy from ``processes`` distinct gateway processes within
    ``within_s`` (the kernel spreads the connections)."""
    pids: set[int] = set()
    deadline = time.monotonic() + within_s
    while len(pids) < processes and time.monotonic() < deadline:
        h = await asyncio.to_thread(health, port)
        if h is not None and h.get("healthy"):
            pids.add(int(h["pid"]))
        await asyncio.sleep(0.2)
    return len(pids) >= processes


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _text(path: Path) -> str:
    return path.read_text()


def _gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "zombie" in status.read_text()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _listening_ipc_paths(pids: list[int]) -> list[str]:
    """Paths the processes' Unix sockets are bound to (vLLM's client endpoints: the listening
    sockets and the connections accepted on them)."""
    import psutil

    return sorted({str(c.laddr) for pid in pids for c in psutil.Process(pid).net_connections(kind="unix") if c.laddr})


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


async def test_gateway_processes_share_one_engine_core_and_the_port(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two gateway processes on one engine core and one decoder, under ``gateway.cuda_mps`` (the
    MPS stand-in): both serve the port; the decoder killed mid-answer is replaced; ``kill -9`` of
    the launcher leaves no process, MPS daemon included, and a restart on the port is healthy and
    stops gracefully."""
    port = free_port()
    proc = await _start(tiny_model_dir, port, tmp_path / "serve.log", mps=True)
    second: subprocess.Popen[bytes] | None = None
    try:
        # the kernel spreads connections over both processes; /healthz names the one answering
        pids = {int(h["pid"]) for h in await asyncio.gather(*(asyncio.to_thread(health, port) for _ in range(24))) if h}
        assert len(pids) == 2
        texts = [f"Session {i} says a short sentence. And then another one." for i in range(6)]
        transcripts = await asyncio.gather(*(_speak(port, t) for t in texts))
        for t in transcripts:
            assert t.samples > 0
            assert not t.errors()
        started = _text(tmp_path / "serve.log")
        assert "2 gateway processes on 1 engine core(s)" in started
        assert "1 decoder process(es)" in started  # the group's one decoder process
        # the launcher's children: two gateway processes, one engine core, one decoder process
        kids = [_cmdline(p) for p in _children(proc.pid)]
        assert sum("voicegw-gateway-" in k for k in kids) == 2, kids
        assert sum("engine.decoder.worker" in k for k in kids) == 1, kids
        assert any("EngineCore" in k for k in kids), kids
        # the engine core's endpoints in the gateway processes (vLLM's IPC listeners) keep their
        # files while the group runs: an engine core connecting late must find them
        paths = _listening_ipc_paths([p for p in _children(proc.pid) if "voicegw-gateway-" in _cmdline(p)])
        assert len(paths) == 4, paths  # input and output endpoint per gateway process
        assert all(map(_exists, paths)), paths
        # the decoder process dies mid-answer: the sessions on it fail (engine_unavailable, 1011),
        # the launcher starts a new one, both gateway processes attach (healthy again), new sessions speak
        decoder = next(p for p in _children(proc.pid) if "engine.decoder.worker" in _cmdline(p))
        talking = await _mid_answer(port, 4, first_voice=300)
        t_kill = time.monotonic()
        os.kill(decoder, signal.SIGKILL)
        fates = await asyncio.gather(*(_fate(t) for _, t in talking))
        if any(f not in (("ok", None), ("engine_unavailable", 1011)) for f in fates):
            # an answer with no end: where every process of the group is (py-spy), for the cause
            sids = [(c.session or {}).get("session_id") for c, _ in talking]
            raise AssertionError(await asyncio.to_thread(no_end_report, fates, sids, tmp_path / "serve.log", proc.pid))
        assert ("engine_unavailable", 1011) in fates, fates  # answers were still being decoded
        healthy = await _allhealthy(port, 2, within_s=180)
        thealthy = time.monotonic() - t_kill
        assert healthy, _text(tmp_path / "serve.log")[-3000:]
        assert "decoder process 0 replaced" in _text(tmp_path / "serve.log")
        assert proc.returncode is None
        new = [p for p in _children(proc.pid) if "engine.decoder.worker" in _cmdline(p)]
        assert len(new) == 1 and new[0] != decoder, new
        for t in await asyncio.gather(*(_speak(port, f"After the decoder crash session {i} speaks.") for i in range(4))):
            assert t.samples > 0 and not t.errors()
        print(f"[group decoder heal] healthy {thealthy:.1f} s after the kill", flush=True)
        for c, _ in talking:
            with contextlib.suppress(Exception):
                await c.close()
        # kill -9 of the launcher: every process of the group (the gateway processes, which would
        # keep the port, the engine core, its worker, the decoder, the resource tracker, the MPS
        # keeper, daemon and server) is gone within 2 s, and a new group on the same port comes up
        # healthy (issue 33)
        first_mps = mps_root(tmp_path)
        mps_pids = {p for pair in logged_pids(first_mps / "log") for p in pair}
        assert mps_pids and mps_pids <= set(descendants(proc.pid)), mps_pids
        files = await asyncio.to_thread(kill9_and_check, proc.pid, 9)
        await proc.wait()
        assert first_mps.exists()  # left by the dead run; the next run under MPS removes it
        second = await asyncio.to_thread(restart_after_kill9, tiny_model_dir, port, 2, tmp_path, proc.pid, files,
                                         ("--gateway.cuda_mps", "true"), mps_env(tmp_path))
        assert not first_mps.exists()
        second_mps = mps_root(tmp_path)
        paths = _listening_ipc_paths([p for p in _children(second.pid) if "voicegw-gateway-" in _cmdline(p)])
        assert len(paths) == 4 and all(map(_exists, paths)), paths
        # graceful stop: SIGTERM to the launcher drains both gateways, then the engine core stops
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 60) == 0
        assert _text(tmp_path / "serve2.log").count("gateway stopped") == 2
        assert not any(map(_exists, paths)), paths  # removed when the group ends
        assert not second_mps.exists()  # its MPS daemon quit, its directories removed
    finally:
        _kill_group(proc.pid)  # whatever is left of the group (none when it stopped cleanly)
        if proc.returncode is None:
            await proc.wait()
        if second is not None:
            _kill_group(second.pid)
            second.wait()


async def test_the_group_heals_when_one_of_its_engine_cores_dies(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Two engine cores (``gateway.engine_cores`` 2), one gateway process each, one decoder process.
    SIGKILL of one engine core mid-answer: the sessions on it get ``engine_unavailable`` and close
    1011, the others finish; the launcher starts a new engine core, its gateway process reconnects
    (``/healthz`` 503 meanwhile, then 200 from both processes) and new sessions speak."""
    port = free_port()
    log = tmp_path / "serve.log"
    proc = await _start(tiny_model_dir, port, log, cores=2, mps=True)
    try:
        kids = _children(proc.pid)
        gateways = [p for p in kids if "voicegw-gateway-" in _cmdline(p)]
        decoders = [p for p in kids if "engine.decoder.worker" in _cmdline(p)]
        cores = [p for p in kids if "EngineCore" in _cmdline(p)]
        assert len(gateways) == 2 and len(decoders) == 1 and len(cores) == 2, [_cmdline(p) for p in kids]
        assert "2 gateway processes on 2 engine core(s)" in _text(log)
        # gateway.cuda_mps: every process of the group points at this run's MPS daemon, started first
        root = mps_root(tmp_path)
        pipe = str(root / "pipe")
        assert all(_environ(p).get("CUDA_MPS_PIPE_DIRECTORY") == pipe for p in gateways + decoders + cores)
        daemon = logged_pids(root / "log")[-1][0]
        os.kill(daemon, signal.SIGKILL)  # started again within the supervisor's poll
        await _until(lambda: "CUDA MPS daemon 0 replaced" in _text(log), within_s=20, what=lambda: _text(log)[-2000:])
        assert logged_pids(root / "log")[-1][0] != daemon and (root / "pipe" / "control").exists()
        # sessions mid-answer on both gateway processes (the kernel spreads the connections)
        talking = await _mid_answer(port, 6, first_voice=100)
        t_kill = time.monotonic()
        os.kill(cores[1], signal.SIGKILL)

        fates = await asyncio.gather(*(_fate(t) for _, t in talking))
        if any(f not in (("ok", None), ("engine_unavailable", 1011)) for f in fates):
            # an answer with no end: where every process of the group is (py-spy), for the cause
            sids = [(c.session or {}).get("session_id") for c, _ in talking]
            raise AssertionError(await asyncio.to_thread(no_end_report, fates, sids, log, proc.pid))
        assert ("engine_unavailable", 1011) in fates or all(f == ("ok", None) for f in fates), fates
        # healthy again: both gateway processes answer 200, the launcher still runs
        healthy = await _allhealthy(port, 2, within_s=240)
        thealthy = time.monotonic() - t_kill
        assert healthy, _text(log)[-3000:]
        assert proc.returncode is None
        assert "engine core 1 replaced" in _text(log)
        new_core = [p for p in _children(proc.pid) if "EngineCore" in _cmdline(p) and p not in cores]
        assert new_core and _environ(new_core[0]).get("CUDA_MPS_PIPE_DIRECTORY") == pipe
        t_new = time.monotonic()
        for t in await asyncio.gather(*(_speak(port, f"After the crash session {i} speaks.") for i in range(4))):
            assert t.samples > 0 and not t.errors()
        print(f"[group heal] fates {fates}; healthy {thealthy:.1f} s after the kill; "
              f"4 new sessions in {time.monotonic() - t_new:.1f} s", flush=True)
        for c, _ in talking:
            with contextlib.suppress(Exception):
                await c.close()
    finally:
        _kill_group(proc.pid)  # whatever is left of the group
        if proc.returncode is None:
            await proc.wait()


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(kv.decode(errors="replace").partition("=")[::2] for kv in f.read().split(b"\0") if kv)


async def _until(cond: Any, within_s: float, what: Any) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, what()
        await asyncio.sleep(0.1)


def test_engine_core_restarts_are_bounded() -> None:
    """The launcher replaces a dead engine core at most 3 times in 10 minutes, then stops the group."""
    from voicegw.group import RestartBudget

    b = RestartBudget(limit=3, window_s=600.0)
    assert [b.allow(t) for t in (0.0, 10.0, 20.0)] == [True, True, True]
    assert not b.allow(30.0)
    assert b.allow(611.0)  # the first one left the window


def test_a_dead_engine_core_is_told_to_its_gateway_processes_even_when_the_group_stops() -> None:
    """The launcher tells a dead engine core's gateway processes first (their streams on it fail
    at once with ``engine_unavailable``), then replaces it; past the restart budget the group
    stops, and they were told all the same (not left to the drain's 1012)."""
    from types import SimpleNamespace

    from voicegw.config import Config
    from voicegw.group import RestartBudget, _Signals, _supervise

    class Gone:
        def is_alive(self) -> bool:
            return False

    dead_core: Any = SimpleNamespace(manager=SimpleNamespace(processes=[Gone()]))
    told: list[int] = []
    healed: list[int] = []
    code = _supervise([], [dead_core], _Signals(), Config(), [], told.append, healed.append, lambda _: None,
                      budget=RestartBudget(limit=0))
    assert code == 1 and told == [0] and healed == []


def test_automatic_settings_resolve_per_platform(tiny_model_dir: Path) -> None:
    """``gateway.processes`` 0 and the ``GPU_DEFAULTS`` resolve once in ``voicegw serve``: on a CUDA
    vLLM engine 4 processes and the GPU column for every key not set; elsewhere one process and the
    field defaults. This host has no CUDA: ``on_cuda_vllm`` says so for every backend."""
    from voicegw.config import GPU_DEFAULTS, Config, ConfigError, EngineConfig, GatewayConfig, load_config
    from voicegw.runtime import AUTO_GPU_PROCESSES, on_cuda_vllm, resolve_platform

    def cfg(gw: dict[str, Any], eng: dict[str, Any]) -> Config:
        return Config(gateway=GatewayConfig(**gw), engine=EngineConfig(**eng))

    for eng in ({"backend": "vllm", "model_dir": str(tiny_model_dir), "device": "cpu"}, {"backend": "espeak"},
                {"backend": "vllm", "model_dir": str(tiny_model_dir)}):
        assert not on_cuda_vllm(cfg({}, eng))
    cpu = resolve_platform(cfg({}, {}), cuda=False)
    assert cpu.gateway.processes == 1 and cpu.engine == EngineConfig()
    assert resolve_platform(cfg({"processes": 3}, {}), cuda=False).gateway.processes == 3
    gpu = resolve_platform(cfg({}, {}), cuda=True)
    assert gpu.gateway.processes == AUTO_GPU_PROCESSES
    for key, value in GPU_DEFAULTS.items():
        section, _, name = key.partition(".")
        assert getattr(getattr(gpu, section), name) == value, key
    single = resolve_platform(cfg({"port": 0}, {}), cuda=True).gateway
    assert (single.processes, single.engine_cores) == (1, 1)
    # an explicit odd process count keeps one engine core; an even one is split over two
    odd = resolve_platform(load_config(overrides={"gateway.processes": "3"}), cuda=True).gateway
    assert (odd.engine_cores, odd.processes) == (1, 3)
    even = resolve_platform(load_config(overrides={"gateway.processes": "6"}), cuda=True).gateway
    assert (even.processes, even.engine_cores) == (6, 2)
    # a key given in TOML, environment or CLI is never replaced, even when it equals the CPU default
    mine = load_config(env={"VOICEGW_ENGINE_MAX_NUM_SEQS": "64"}, overrides={"engine.enforce_eager": "true"})
    assert mine.explicit == {"engine.max_num_seqs", "engine.enforce_eager"}
    kept = resolve_platform(mine, cuda=True)
    assert kept.engine.max_num_seqs == 64 and kept.engine.enforce_eager is True
    assert kept.engine.decoder_max_batch == GPU_DEFAULTS["engine.decoder_max_batch"]
    # a decoder on the CPU keeps float32, not compiled (float16 has no fast CPU kernels)
    cpu_decoder = resolve_platform(load_config(overrides={"engine.decoder_device": "cpu"}), cuda=True).engine
    assert (cpu_decoder.decoder_dtype, cpu_decoder.decoder_compile) == ("float32", False)
    assert cpu_decoder.decoder_max_batch == GPU_DEFAULTS["engine.decoder_max_batch"]
    with pytest.raises(ConfigError):
        GatewayConfig(processes=2, port=0)
    with pytest.raises(ConfigError):
        GatewayConfig(processes=-1)


def test_a_failed_group_start_leaves_no_shared_memory_files(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The launcher creates the frame table and the decoder's samples file before vLLM's launcher
    runs; when the start fails after that (here: vLLM's launcher raises) it exits 2 with one line
    and removes both files."""
    import voicegw.group as group
    from engine.shm import shm_dir
    from voicegw.config import load_config

    def before() -> set[str]:
        return {p.name for p in shm_dir().glob(f"voicegw-*-{os.getpid()}-*")}

    during: list[set[str]] = []

    def refuse(*a: Any, **k: Any) -> Any:
        during.append(before())
        raise RuntimeError("no engine core today")

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the launcher sets vLLM's variables
    monkeypatch.setattr(group, "launch_core", refuse)
    cfg = load_config(env={}, overrides={
        "gateway.processes": 2, "gateway.port": free_port(), "engine.backend": "vllm",
        "engine.model_dir": str(tiny_model_dir), "engine.device": "cpu", "engine.max_num_seqs": 8,
        "engine.max_model_len": 256, "engine.kv_cache_gib": 0.05})
    old = before()
    assert group.serve_group(cfg, str(tiny_model_dir)) == 2
    assert "no engine core today" in caplog.text
    assert len(during[0] - old) == 2  # the frame table and the samples file existed then
    assert before() == old


async def test_a_silent_engine_core_stops_its_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared engine core's client whose first question gets no reply within the deadline gives
    up with an unrecoverable error (the gateway process exits; the launcher stops the group)."""
    import typing

    import engine.vllm.engine as ve
    from engine.api import EngineError, EngineErrorKind

    monkeypatch.setattr(ve, "_FIRST_CONTACT_S", 0.05)

    class Core:
        async def get_supported_tasks(self) -> tuple[str, ...]:
            await asyncio.sleep(3600)  # this reply never comes
            return ("generate",)

    class Answering:
        async def get_supported_tasks(self) -> tuple[str, ...]:
            return ("generate",)

    engine = typing.cast(ve.VllmCodeEngine, object())  # _first_contact uses only the client it is given
    await ve.VllmCodeEngine._first_contact(engine, Answering())
    with pytest.raises(EngineError) as err:
        await ve.VllmCodeEngine._first_contact(engine, Core())
    assert err.value.kind is EngineErrorKind.UNRECOVERABLE
