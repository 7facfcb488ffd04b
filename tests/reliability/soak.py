"""Bounded soak: many utterances through the real gateway (a child process, ``gwproc``), sampling
the gateway's RSS and open file descriptors; reports growth and fails beyond stated bounds.

    python -m tests.reliability.soak                       # 10 minutes, eSpeak engine
    python -m tests.reliability.soak --minutes 2 --engine fake
    python -m tests.reliability.soak --long                # 4 hours (or --long --minutes N)
    python -m tests.reliability.soak --engine vllm --model-dir DIR   (under the heavy lock)

Traffic: ``--clients`` concurrent client loops, each opening sessions one after the other and
mixing behaviours per utterance: text streamed in token-sized pieces then ``text.end`` (most),
barge-in (``cancel`` after the first audio), abrupt disconnect mid-stream, a malformed message in
the middle of an utterance, a session left idle. Clients report playback as played-at-once, so
the engine (not real time) paces the audio.

Checks (exit status 1 when one fails; the same checks back ``test_soak.py``):

* no accepted utterance lost: each one that was not cancelled or abandoned by its own client ends
  with ``utterance.done`` status ``ok``; no ``error`` other than the one provoked on purpose;
* after the run, once idle: no session, no running engine request (``/healthz``);
* fds: final <= baseline + ``--fd-bound`` (default 4);
* RSS: final <= baseline + ``--rss-bound-mb`` (default 32 MiB). Baseline and final are taken
  with the gateway idle (no session): the baseline after a warm-up of the same traffic (the first
  10% of the run, at least 20 s, at most 5 minutes), the final after the run. The RSS slope over
  the measured part is reported (MiB/hour) and, for runs of 30 minutes or more, bounded by
  ``--slope-bound-mb-per-h`` (default 16).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tests.reliability.gwproc import GatewayProcess

SENTENCES = [
    "Sure, here is the plan for today.",
    "First, we load the data and check it.",
    "Then we train the model for a while, and look at the curves.",
    "Numbers like 3.14 and 1,000 stay whole.",
    "Does it work? It should.",
    "Finally, we write the report and go home.",
    "它也会说中文，对吧。",
]


@dataclass
class Stats:
    sessions: int = 0
    utterances_ok: int = 0
    utterances_cancelled: int = 0
    utterances_abandoned: int = 0
    provoked_errors: int = 0
    audio_s: float = 0.0
    lost: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


@dataclass
class Sample:
    t_s: float
    rss_bytes: int
    fds: int
    sessions: int
    running_requests: int


@dataclass
class Report:
    engine: str
    minutes: float
    clients: int
    stats: Stats
    samples: list[Sample]
    baseline_rss_bytes: int
    final_rss_bytes: int
    baseline_fds: int
    final_fds: int
    rss_growth_bytes: int
    rss_slope_mb_per_h: float
    final_health: dict[str, Any]
    bounds: dict[str, float]
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        s = self.stats
        mb = 2**20
        return (
            f"soak {self.engine} {self.minutes:.1f} min, {self.clients} clients: {s.sessions} sessions, "
            f"{s.utterances_ok} utterances ok ({s.audio_s:.0f} s audio), {s.utterances_cancelled} cancelled, "
            f"{s.utterances_abandoned} abandoned by disconnect, {s.provoked_errors} provoked errors; "
            f"lost {len(s.lost)}, unexpected {len(s.unexpected)}\n"
            f"RSS {self.baseline_rss_bytes / mb:.1f} -> {self.final_rss_bytes / mb:.1f} MiB "
            f"(growth {self.rss_growth_bytes / mb:+.1f} MiB, bound {self.bounds['rss_bound_mb']:.0f}; "
            f"slope {self.rss_slope_mb_per_h:+.1f} MiB/h); fds {self.baseline_fds} -> {self.final_fds} "
            f"(bound +{self.bounds['fd_bound']:.0f}); after: {self.final_health}\n"
            + ("OK" if self.ok else "FAILED: " + "; ".join(self.failures))
        )


# ---- client behaviours ------------------------------------------------------------------------


async def _client_loop(url: str, rng: random.Random, until: float, stats: Stats) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    while time.monotonic() < until:
        try:
            async with connect(url, subprotocols=["voicegw.v1"], compression=None,  # type: ignore[list-item]
                               open_timeout=10, close_timeout=2, max_size=None) as ws:
                stats.sessions += 1
                await _session(ws, rng, until, stats)
        except (ConnectionClosed, OSError, TimeoutError) as exc:
            stats.unexpected.append(f"connection: {exc!r}")
            await asyncio.sleep(0.5)


async def _session(ws: Any, rng: random.Random, until: float, stats: Stats) -> None:
    rate = rng.choice([8000, 16000, 24000, 48000])
    fmt = rng.choice(["pcm16", "pcm16", "mulaw"])
    await ws.send(orjson.dumps({"type": "session.start", "sample_rate": rate, "format": fmt,
                                "voice": rng.randrange(10_000)}).decode())
    started = orjson.loads(await asyncio.wait_for(ws.recv(), 30))
    if started.get("type") != "session.started":
        stats.unexpected.append(f"start: {started}")
        return
    bps = 1 if fmt == "mulaw" else 2
    trace: collections.deque[str] = collections.deque(maxlen=60)
    trace.append(f"start {rate} {fmt}")
    played = 0  # cumulative over the session (the protocol's played_samples is never reset)
    for _ in range(rng.randint(1, 4)):
        if time.monotonic() >= until:
            break
        behaviour = rng.choices(["complete", "cancel", "disconnect", "malformed", "idle"],
                                weights=[70, 12, 8, 6, 4])[0]
        text = " ".join(rng.sample(SENTENCES, rng.randint(1, 3)))

        async def recv_until(pred: Any, within_s: float = 120.0) -> dict[str, Any]:
            nonlocal played
            async with asyncio.timeout(within_s):
                while True:
                    m = await ws.recv()
                    if isinstance(m, bytes):
                        trace.append(f"audio {m[:16].hex()} {len(m) - 16}")
                        played += (len(m) - 16) // bps
                        stats.audio_s += (len(m) - 16) / bps / rate
                        await ws.send(orjson.dumps({"type": "playback", "played_samples": played}).decode())
                        if pred(None):
                            return {}
                        continue
                    obj = orjson.loads(m)
                    trace.append(m if isinstance(m, str) else m.decode())
                    if obj["type"] == "error" and not pred(obj):
                        stats.unexpected.append(f"error: {obj}")
                    if pred(obj):
                        return obj  # type: ignore[no-any-return]

        trace.append(f"behaviour {behaviour}")
        if behaviour == "idle":
            await asyncio.sleep(rng.uniform(0.1, 1.0))
            continue
        pieces = _tokens(text, rng)
        for i, p in enumerate(pieces):
            await ws.send(orjson.dumps({"type": "text.delta", "text": p}).decode())
            if behaviour == "malformed" and i == len(pieces) // 2:
                await ws.send(orjson.dumps({"type": "text.delta", "text": 42, "id": "bad"}).decode())
        if behaviour == "malformed":
            err = await recv_until(lambda o: o is not None and o.get("type") == "error")
            if err.get("code") != "invalid_field":
                stats.unexpected.append(f"malformed: {err}")
            stats.provoked_errors += 1
        if behaviour in ("cancel", "disconnect"):
            await recv_until(lambda o: o is None)  # first audio
            if behaviour == "disconnect":
                ws.transport.abort()
                stats.utterances_abandoned += 1
                return
            await ws.send(orjson.dumps({"type": "cancel", "played_samples": played}).decode())
            await recv_until(lambda o: o is not None and o.get("type") == "cancelled")
            stats.utterances_cancelled += 1
            continue
        await ws.send(orjson.dumps({"type": "text.end"}).decode())
        try:
            done = await recv_until(lambda o: o is not None and o.get("type") == "utterance.done")
        except TimeoutError:
            stats.lost.append(f"no utterance.done for {text!r}; trace: " + " | ".join(trace))
            return
        if done.get("status") == "ok" and done.get("samples", 0) > 0:
            trace.append("done")
            stats.utterances_ok += 1
        else:
            stats.lost.append(f"utterance failed: {done}")
    await ws.close()


def _tokens(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


# ---- the run ----------------------------------------------------------------------------------


def _slope_mb_per_h(samples: list[Sample]) -> float:
    if len(samples) < 3:
        return 0.0
    xs = [s.t_s for s in samples]
    ys = [s.rss_bytes / 2**20 for s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den * 3600


async def run_soak(*, minutes: float = 10.0, engine: str = "espeak", clients: int = 6, model_dir: str | None = None,
                   rss_bound_mb: float = 32.0, fd_bound: int = 4, slope_bound_mb_per_h: float = 16.0,
                   sample_s: float = 5.0, seed: int = 0, log_path: Path | None = None) -> Report:
    settings = {"limits.max_messages_per_s": 2000, "limits.max_sessions": 256}
    gw = GatewayProcess(engine, settings=settings, model_dir=model_dir, start_timeout_s=300, log_path=log_path)
    await asyncio.to_thread(gw.start)
    try:
        duration_s = minutes * 60.0
        warmup_s = min(300.0, max(20.0, 0.1 * duration_s))
        warmup_s = min(warmup_s, 0.5 * duration_s)
        t0 = time.monotonic()
        until = t0 + duration_s
        stats = Stats()
        samples: list[Sample] = []
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                _, h = await asyncio.to_thread(gw.healthz)
                samples.append(Sample(time.monotonic() - t0, gw.rss(), gw.fds(), int(h.get("sessions", -1)),
                                      int(h.get("running_requests", -1))))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), sample_s)

        st = asyncio.create_task(sampler())
        rng = random.Random(seed)

        async def traffic(until: float) -> None:
            await asyncio.gather(*(_client_loop(gw.ws_url, random.Random(rng.random()), until, stats)
                                   for _ in range(clients)))

        async def idle() -> dict[str, Any]:
            """Every session gone, every engine request finished; then a moment for the loop."""
            h: dict[str, Any] = {}
            for _ in range(300):
                _, h = await asyncio.to_thread(gw.healthz)
                if h.get("sessions") == 0 and h.get("running_requests") == 0:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.0)
            return h

        # warm-up traffic, then the baseline at idle; the measured run; the final state at idle
        await traffic(t0 + warmup_s)
        await idle()
        base_rss, base_fds, t_base = gw.rss(), gw.fds(), time.monotonic() - t0
        await traffic(until)
        stop.set()
        await st
        health = await idle()
        final_rss, final_fds = gw.rss(), gw.fds()
        steady = [s for s in samples if s.t_s >= t_base]
        growth = final_rss - base_rss
        slope = _slope_mb_per_h(steady)
        failures = []
        if stats.lost:
            failures.append(f"{len(stats.lost)} utterances lost: {stats.lost[:3]}")
        if stats.unexpected:
            failures.append(f"{len(stats.unexpected)} unexpected events: {stats.unexpected[:3]}")
        if health.get("sessions") != 0 or health.get("running_requests") != 0:
            failures.append(f"not idle after the run: {health}")
        if final_fds > base_fds + fd_bound:
            failures.append(f"fds {base_fds} -> {final_fds} (bound +{fd_bound})")
        if growth > rss_bound_mb * 2**20:
            failures.append(f"RSS grew {growth / 2**20:.1f} MiB (bound {rss_bound_mb})")
        if minutes >= 30 and slope > slope_bound_mb_per_h:
            failures.append(f"RSS slope {slope:.1f} MiB/h (bound {slope_bound_mb_per_h})")
        if stats.utterances_ok == 0:
            failures.append("no utterance completed")
        if not gw.alive():
            failures.append("gateway process died")
        return Report(engine, minutes, clients, stats, samples, base_rss, final_rss, base_fds,
                      final_fds, growth, slope, health,
                      {"rss_bound_mb": rss_bound_mb, "fd_bound": fd_bound,
                       "slope_bound_mb_per_h": slope_bound_mb_per_h, "warmup_s": warmup_s}, failures)
    finally:
        await asyncio.to_thread(gw.stop)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=None, help="run length (default 10; 240 with --long)")
    p.add_argument("--long", action="store_true", help="hours-long run (default 4 h)")
    p.add_argument("--engine", default="espeak", choices=["fake", "espeak", "vllm"])
    p.add_argument("--model-dir", help="ChatTTS checkpoint for --engine vllm (default: a tiny random one)")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--rss-bound-mb", type=float, default=32.0)
    p.add_argument("--fd-bound", type=int, default=4)
    p.add_argument("--slope-bound-mb-per-h", type=float, default=16.0)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the full report (samples included) here")
    p.add_argument("--gateway-log", type=Path, help="append the gateway's stderr here")
    args = p.parse_args(argv)
    minutes = args.minutes if args.minutes is not None else (240.0 if args.long else 10.0)
    model_dir = args.model_dir
    if args.engine == "vllm" and not model_dir:
        import tempfile

        from engine._compat import ensure_torch_companions


        ensure_torch_companions()  # before anything imports transformers, vocos or chattts
        from engine.checkpoint import make_checkpoint

        model_dir = str(make_checkpoint(Path(tempfile.mkdtemp(prefix="soak-ckpt-")) / "tiny", "tiny", seed=0))
    report = asyncio.run(run_soak(
        minutes=minutes, engine=args.engine, clients=args.clients, model_dir=model_dir,
        rss_bound_mb=args.rss_bound_mb, fd_bound=args.fd_bound, slope_bound_mb_per_h=args.slope_bound_mb_per_h,
        sample_s=args.sample_s, seed=args.seed, log_path=args.gateway_log))
    print(report.summary())
    if args.json:
        args.json.write_bytes(orjson.dumps(asdict(report), option=orjson.OPT_INDENT_2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
