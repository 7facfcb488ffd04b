"""ChatTTS on stock vLLM == upstream chattts, frame for frame (greedy, same weights).

One session-scoped vLLM engine (tests/engine/conftest.py) serves every test here; the oracle is
upstream ``chattts`` (``Chat._infer_code``: the ``use_decoder=False`` code path with
``skip_refine_text=True`` and no text normalization) run by ``ReferenceCodeEngine``.

Run: ``pytest tests/engine/test_vllm_parity.py`` (CPU, tiny checkpoint, a few minutes).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch

from engine.api import CodeFrames, EngineError, EngineErrorKind, SamplingParams, SpeechRequest

pytestmark = pytest.mark.vllm

TEXTS = [
    "hello world, this is a test.",
    "good morning, the weather today is okay.",
    "你好，世界。",
    "thanks for the voice stream",
]
SPEAKERS: list[Any] = [3, 11, 7, ""]
#: Long enough that the prompt fills one 128-token KV block (prefix caching works per block).
LONG_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its now find "
    "long down day did get come made may part hello world thank thanks yes okay good morning please sorry. "
    "the speech voice audio test stream was good, and the people said thank you. "
    "then we could look at the water for a long time, and write down what they made."
)


def greedy(frames: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, min_new_tokens=frames, max_new_tokens=frames)


async def collect(engine: Any, request: SpeechRequest, delay_s: float = 0.0, **kw: Any) -> tuple[np.ndarray, str]:
    if delay_s:
        await asyncio.sleep(delay_s)
    frames: list[CodeFrames] = []
    async for fr in engine.generate(request, **kw):
        frames.append(fr)
    assert frames and frames[-1].finished
    assert all(not f.finished for f in frames[:-1])
    codes = np.concatenate([f.codes for f in frames]) if frames else np.zeros((0, 4), np.int64)
    assert codes.ndim == 2 and codes.shape[1] == 4
    return codes, str(frames[-1].finish_reason)


_oracle_cache: dict[tuple[Any, ...], np.ndarray] = {}


async def oracle(reference_engine: Any, text: str, speaker: Any, params: SamplingParams) -> np.ndarray:
    key = (text, speaker, params)
    if key not in _oracle_cache:
        req = SpeechRequest(f"ref-{len(_oracle_cache)}", text, speaker=speaker, params=params)
        _oracle_cache[key] = (await collect(reference_engine, req))[0]
    return _oracle_cache[key]


def assert_same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: {got.shape} frames vs upstream {want.shape}"
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, f"{what}: first differing frames {bad[:5].tolist()}: {got[bad[0]]} vs {want[bad[0]]}"


# --------------------------------------------------------------------------- sampling core


def test_sampling_pipeline_matches_upstream_processors() -> None:
    """engine/vllm/sampling.py == upstream's temperature -> penalty -> top-p -> top-k -> EOS."""
    from ChatTTS.model.processors import gen_logits

    from engine.vllm.sampling import RowParams, process_logits

    g = torch.Generator().manual_seed(0)
    rows, books, n = 5, 4, 626
    logits = torch.randn(rows, books, n, generator=g) * 3
    hist = torch.randint(0, 625, (rows, books, 16), generator=g)
    hist[0, :, 10:] = -1  # a request with only 10 frames so far
    temps = [0.3, 0.7, 1.0, 0.3, 0.5]
    top_ps = [0.7, 0.9, 0.5, 0.7, 1.0]
    top_ks = [20, 5, 50, 1, 20]
    pens = [1.05, 1.2, 1.0, 1.05, 1.3]
    block = [True, False, False, True, False]
    params = RowParams(
        temperature=torch.tensor(temps),
        top_p=torch.tensor(top_ps),
        top_k=torch.tensor(top_ks),
        penalty=torch.tensor(pens),
        block_eos=torch.tensor(block),
        greedy=torch.zeros(rows, dtype=torch.bool),
    )
    mine = process_logits(logits, hist, params, eos_code=625)
    for r in range(rows):
        warpers, procs = gen_logits(num_code=625, top_P=top_ps[r], top_K=top_ks[r], repetition_penalty=pens[r])
        x = logits[r].clone() / temps[r]
        h = hist[r] if r else hist[r, :, :10]
        for p in (*procs, *warpers):
            x = p(h, x)
        if block[r]:
            x[:, 625] = -torch.inf
        assert torch.equal(torch.isinf(mine[r]), torch.isinf(x)), f"row {r}: kept sets differ"
        finite = torch.isfinite(x)
        torch.testing.assert_close(mine[r][finite], x[finite], rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- parity


async def test_a_single_requests_match_upstream(vllm_engine: Any, reference_engine: Any) -> None:
    # The checkpoint must be sensitive to the speaker, or this test would prove little.
    a = await oracle(reference_engine, TEXTS[0], 3, greedy(40))
    b = await oracle(reference_engine, TEXTS[0], 11, greedy(40))
    assert (a != b).any(axis=1).sum() > 10, "test checkpoint is not speaker-sensitive"
    cases: list[tuple[str, str | int | None]] = [(TEXTS[0], 3), (TEXTS[0], 11), (TEXTS[1], ""), (TEXTS[2], 7), (TEXTS[3], None)]
    for i, (text, spk) in enumerate(cases):
        want = await oracle(reference_engine, text, spk if spk is not None else "2222", greedy(40))
        got, reason = await collect(vllm_engine, SpeechRequest(f"a{i}", text, speaker=spk, params=greedy(40)))
        assert reason == "length"
        assert_same(got, want, f"text {i} speaker {spk!r}")


async def test_a_eos_stop_matches_upstream(vllm_engine: Any, reference_engine: Any) -> None:
    """Without forced length, both stop at the same frame (any codebook sampling EOS)."""
    params = SamplingParams(temperature=0.0, min_new_tokens=1, max_new_tokens=300)
    for i, spk in enumerate((3, 11, 7)):
        want = await oracle(reference_engine, TEXTS[1], spk, params)
        got, reason = await collect(vllm_engine, SpeechRequest(f"eos{i}", TEXTS[1], speaker=spk, params=params))
        assert_same(got, want, f"speaker {spk}")
        assert reason == ("eos" if len(got) < 300 else "length")


async def test_b_eight_staggered_requests_match_upstream(vllm_engine: Any, reference_engine: Any) -> None:
    reqs = [
        SpeechRequest(f"b{i}", TEXTS[i % 4], speaker=SPEAKERS[(i // 2) % 4], params=greedy(40 + 3 * i))
        for i in range(8)
    ]
    want = [await oracle(reference_engine, r.text, r.speaker, r.params) for r in reqs]
    got = await asyncio.gather(*[collect(vllm_engine, r, delay_s=0.12 * i) for i, r in enumerate(reqs)])
    for i, ((codes, _), w) in enumerate(zip(got, want, strict=True)):
        assert_same(codes, w, f"staggered request {i}")


async def test_c_preemption_and_recompute_match_upstream(vllm_engine: Any, reference_engine: Any) -> None:
    before = await vllm_engine.worker_stats()
    reqs = [
        SpeechRequest(f"c{i}", TEXTS[i % 4], speaker=SPEAKERS[(i // 2) % 4], params=greedy(150))
        for i in range(8)
    ]
    want = [await oracle(reference_engine, r.text, r.speaker, r.params) for r in reqs]
    got = await asyncio.gather(*[collect(vllm_engine, r, delay_s=0.03 * i) for i, r in enumerate(reqs)])
    after = await vllm_engine.worker_stats()
    assert after["recomputed_frames"] > before["recomputed_frames"], f"no preemption happened: {after}"
    for i, ((codes, _), w) in enumerate(zip(got, want, strict=True)):
        assert_same(codes, w, f"preempted request {i}")


async def test_d_prefix_cache_same_text_different_speakers(vllm_engine: Any, reference_engine: Any) -> None:
    prompt_len = len(vllm_engine._prompts.code_prompt_ids(LONG_TEXT, True))
    assert 130 <= prompt_len <= 300, prompt_len
    params = greedy(30)
    w3 = await oracle(reference_engine, LONG_TEXT, 3, params)
    w11 = await oracle(reference_engine, LONG_TEXT, 11, params)
    assert (w3 != w11).any(), "speakers give identical codes: the test would prove nothing"
    g1, _ = await collect(vllm_engine, SpeechRequest("d1", LONG_TEXT, speaker=3, params=params))
    g2, _ = await collect(vllm_engine, SpeechRequest("d2", LONG_TEXT, speaker=3, params=params))
    g3, _ = await collect(vllm_engine, SpeechRequest("d3", LONG_TEXT, speaker=11, params=params))
    assert_same(g1, w3, "speaker 3, cold")
    assert_same(g2, w3, "speaker 3, prefix-cache hit")
    assert_same(g3, w11, "speaker 11 after speaker 3 (same tokens)")
    assert (vllm_engine.request_stats("d2")["num_cached_tokens"] or 0) >= 128, "second request did not hit the cache"
    assert not vllm_engine.request_stats("d3")["num_cached_tokens"], "another speaker reused speaker 3's KV"
    # Negative control: without the per-speaker salt, speaker 11 reuses speaker 3's KV: wrong codes.
    g4, _ = await collect(vllm_engine, SpeechRequest("d4", LONG_TEXT, speaker=3, params=params), cache_salt=False)
    g5, _ = await collect(vllm_engine, SpeechRequest("d5", LONG_TEXT, speaker=11, params=params), cache_salt=False)
    assert_same(g4, w3, "speaker 3 unsalted, cold")
    assert (vllm_engine.request_stats("d5")["num_cached_tokens"] or 0) >= 128
    with pytest.raises(AssertionError):
        assert_same(g5, w11, "speaker 11 on speaker 3's cached prefix")


async def test_negative_control_side_codes_off_fails(vllm_engine: Any, reference_engine: Any) -> None:
    """Without codebooks 1..3 in the input embedding the comparison must fail."""
    want = await oracle(reference_engine, TEXTS[0], 3, greedy(40))
    got, _ = await collect(vllm_engine, SpeechRequest("neg", TEXTS[0], speaker=3, params=greedy(40)), side_codes=False)
    with pytest.raises(AssertionError):
        assert_same(got, want, "side codes off")


# --------------------------------------------------------------------------- sampling runs


async def test_seeded_sampling_is_reproducible(vllm_engine: Any) -> None:
    p = SamplingParams(temperature=0.3, seed=1234, min_new_tokens=60, max_new_tokens=60)
    alone, _ = await collect(vllm_engine, SpeechRequest("s1", TEXTS[0], speaker=3, params=p))
    noise = [
        SpeechRequest(f"s-noise{i}", TEXTS[i % 4], speaker=i, params=SamplingParams(min_new_tokens=50, max_new_tokens=50))
        for i in range(3)
    ]
    results = await asyncio.gather(
        collect(vllm_engine, SpeechRequest("s2", TEXTS[0], speaker=3, params=p), delay_s=0.1),
        *[collect(vllm_engine, r) for r in noise],
    )
    busy = results[0][0]
    other, _ = await collect(
        vllm_engine, SpeechRequest("s3", TEXTS[0], speaker=3, params=SamplingParams(temperature=0.3, seed=99, max_new_tokens=60, min_new_tokens=60))
    )
    greedy_codes = await collect(vllm_engine, SpeechRequest("s4", TEXTS[0], speaker=3, params=greedy(60)))
    assert_same(busy, alone, "same seed, alone vs in a busy batch")
    assert (other != alone).any(), "a different seed gave the same codes"
    assert (greedy_codes[0] != alone).any(), "sampling at temperature 0.3 equals greedy"
    assert int(alone.max()) < 625


# --------------------------------------------------------------------------- abort, crash


async def test_abort_frees_the_request(vllm_engine: Any) -> None:
    req = SpeechRequest("abort-me", TEXTS[1], speaker=3, params=SamplingParams(min_new_tokens=400, max_new_tokens=400))
    frames = 0
    reason = None
    t_abort = None
    async for fr in vllm_engine.generate(req):
        frames += len(fr.codes)
        if t_abort is None and frames >= 5:
            t_abort = time.monotonic()
            await vllm_engine.abort("abort-me")
        if fr.finished:
            reason = fr.finish_reason
    assert reason == "abort"
    assert t_abort is not None and time.monotonic() - t_abort < 2.0
    assert frames < 400
    assert vllm_engine.health().running_requests == 0
    # The engine keeps serving, and the aborted request is out of the worker's batch.
    n = 0
    async for fr in vllm_engine.generate(SpeechRequest("after-abort", TEXTS[0], speaker=3, params=greedy(30))):
        if n == 0 and len(fr.codes):
            assert (await vllm_engine.worker_stats())["batch_size"] == 1
        n += len(fr.codes)
    assert n == 30


async def test_engine_crash_is_unrecoverable_then_restart(vllm_engine: Any, reference_engine: Any) -> None:
    """Kill the engine-core process: every caller gets EngineError(UNRECOVERABLE), no hang, also
    when the engine is shut down before vLLM's output handler has read the failure (a watchdog's
    restart racing it: the handler is cancelled); health() says so; restart() brings the engine
    back (runs last: it restarts the session engine)."""
    import psutil

    # long requests, and the kill as soon as all three stream (a fast host finishes 400 steps in
    # well under a second)
    reqs = [SpeechRequest(f"crash{i}", TEXTS[i], speaker=3, params=SamplingParams(min_new_tokens=2000, max_new_tokens=2000)) for i in range(3)]
    started = [asyncio.Event() for _ in reqs]

    async def run(r: SpeechRequest, ev: asyncio.Event) -> BaseException | None:
        try:
            async for _ in vllm_engine.generate(r):
                ev.set()
        except EngineError as exc:
            return exc
        return None

    tasks = [asyncio.create_task(run(r, ev)) for r, ev in zip(reqs, started, strict=True)]
    try:
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), timeout=30)
        # direct children: this engine's core (a gateway process a fixture runs has its own)
        mine = psutil.Process(os.getpid()).children(recursive=False)
        cores = [p for p in mine if "EngineCor" in p.name() or "EngineCore" in " ".join(p.cmdline())]
        assert cores, [p.name() for p in mine]
        for p in cores:
            os.kill(p.pid, signal.SIGKILL)
        await vllm_engine._shutdown()  # what restart() does first: before the handler reads the failure
        errors = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        assert all(isinstance(e, EngineError) and e.kind == EngineErrorKind.UNRECOVERABLE for e in errors), errors
        health = vllm_engine.health()
        assert not health.healthy
        with pytest.raises(EngineError) as info:
            async for _ in vllm_engine.generate(SpeechRequest("dead", TEXTS[0], params=greedy(2))):
                pass
        assert info.value.kind == EngineErrorKind.UNRECOVERABLE
    finally:  # the session's engine serves later tests: bring it back whatever happened here
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if not vllm_engine.health().healthy:
            # two callers at once (a watchdog beside an operator) restart it once: a second
            # restart would shut down the first one's engine later, under live traffic (CI)
            await asyncio.gather(vllm_engine.restart(), vllm_engine.restart())
            cores_now = [p for p in psutil.Process(os.getpid()).children(recursive=False)
                         if "EngineCore" in " ".join(p.cmdline()) or "EngineCor" in p.name()]
            assert len(cores_now) == 1, cores_now
        # a request of the killed engine can outlive it in a reference cycle until the cyclic
        # GC finalizes its generator: collect it here, not in the middle of a later test
        for _ in range(100):
            if vllm_engine.health().running_requests == 0:
                break
            gc.collect()
            await asyncio.sleep(0.1)
    assert vllm_engine.health().healthy
    got, _ = await collect(vllm_engine, SpeechRequest("reborn", TEXTS[0], speaker=3, params=greedy(40)))
    assert_same(got, await oracle(reference_engine, TEXTS[0], 3, greedy(40)), "after restart")
