"""The code channel (frame table) and the device-side request state and sampler.

Pure parts first (packing, slots, the batch-row map, the counter-based sampler: torch on CPU),
then the real vLLM engine on the tiny checkpoint: under concurrency and preemption, the codes
each request receives through the frame table are exactly the frames the worker sampled and
fed back into the model (its device history), and greedy requests still match upstream.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from engine.vllm.channel import FrameTable, pack, unpack

# --------------------------------------------------------------------------- packing, slots


def test_pack_unpack_round_trip() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 626, size=(50, 4))
    gen, back = unpack(pack(12345, codes))
    assert (gen == 12345).all()
    assert (back == codes).all()
    assert (pack((1 << 23) - 1, codes) > 0).all(), "packed values must stay positive int64"


async def test_slots_are_reused_last_and_waiters_get_freed_slots() -> None:
    table = FrameTable(slots=3, frames=8)
    try:
        got = [await table.acquire() for _ in range(3)]
        assert [s for s, _ in got] == [0, 1, 2]
        assert len({g for _, g in got}) == 3, "every acquisition gets a fresh generation"
        waiter = asyncio.create_task(table.acquire())
        await asyncio.sleep(0.01)
        assert not waiter.done(), "a full table makes the caller wait"
        table.release(1)
        slot, _ = await asyncio.wait_for(waiter, 1.0)
        assert slot == 1
        table.release(0)
        table.release(2)
        table.release(1)
        # FIFO: the slot freed longest ago comes first (an aborted request's slot comes last)
        assert [(await table.acquire())[0] for _ in range(3)] == [0, 2, 1]
    finally:
        table.close()


async def test_cancelled_waiter_passes_its_wakeup_on() -> None:
    table = FrameTable(slots=1, frames=4)
    try:
        s, _ = await table.acquire()
        first = asyncio.create_task(table.acquire())
        second = asyncio.create_task(table.acquire())
        await asyncio.sleep(0.01)
        first.cancel()
        table.release(s)
        slot, _ = await asyncio.wait_for(second, 1.0)
        assert slot == s
    finally:
        table.close()


async def test_read_checks_generation_and_codebook0() -> None:
    table = FrameTable(slots=2, frames=8)
    try:
        slot, gen = await table.acquire()
        codes = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
        assert table.read(slot, gen, 0, codes[:, 0]) is None, "an unwritten entry is never taken"
        table.table[slot, 0:2] = pack(gen, codes)
        got = table.read(slot, gen, 0, codes[:, 0])
        assert got is not None and (got == codes).all()
        assert table.read(slot, gen + 1, 0, codes[:, 0]) is None, "another generation's entry"
        assert table.read(slot, gen, 0, codes[:, 0] + 1) is None, "codebook 0 differs from the token"
    finally:
        table.close()


# --------------------------------------------------------------------------- device state


@dataclass
class _SP:
    extra_args: dict[str, Any]


@dataclass
class _Update:
    batch_size: int
    removed: list[int] = field(default_factory=list)
    added: list[tuple[int, Any, list[int], list[int]]] = field(default_factory=list)
    moved: list[tuple[int, int, Any]] = field(default_factory=list)


class _Swap:
    name = "SWAP"


def _params(slot: int, gen: int, *, prefix: list[list[int]] | None = None) -> _SP:
    from engine.vllm.state import EXTRA_KEY, RequestParams, encode_vector

    rp = RequestParams(
        key=f"r{slot}-{gen}", slot=slot, gen=gen, temperature=0.3, top_p=0.7, top_k=20, penalty=1.05,
        window=16, min_new=2, max_new=40, greedy=False, seed=gen, speaker=encode_vector([0.5] * 8), prefix=prefix,
    )
    return _SP({EXTRA_KEY: rp.to_extra()})


def _state() -> Any:
    from engine.vllm.state import DeviceState

    return DeviceState(device=torch.device("cpu"), max_rows=8, hidden=8, num_vq=4, spec=None, default_frames=64)


def test_batch_rows_follow_adds_removes_and_swaps() -> None:
    st = _state()
    a, b = _params(3, 1), _params(5, 2)
    st.update(_Update(2, added=[(0, a, [1] * 10, []), (1, b, [1] * 12, [])]))
    assert st.row_slot.tolist()[:3] == [3, 5, st.scratch]
    assert int(st.prompt_len[3]) == 10 and int(st.prompt_len[5]) == 12
    assert float(st.speaker[5, 0]) == 0.5 and bool(st.has_spk[5])
    st.update(_Update(2, moved=[(0, 1, _Swap())]))
    assert st.row_slot.tolist()[:2] == [5, 3]
    # preempted: leaves the batch; its state stays at its slot
    st.n_frames[3] = 7
    st.update(_Update(1, removed=[1]))
    assert st.row_slot.tolist()[:2] == [5, st.scratch]
    st.update(_Update(2, added=[(1, a, [1] * 10, [])]))
    assert int(st.n_frames[3]) == 7, "a re-added request keeps its frames"
    assert st.host_stats["readded"] == 1


def test_new_request_in_a_slot_evicts_a_straggler_and_resets_state() -> None:
    st = _state()
    old, new = _params(4, 1), _params(4, 2)
    st.update(_Update(1, added=[(0, old, [1] * 10, [])]))
    st.n_frames[4] = 9
    st.update(_Update(2, added=[(1, new, [1] * 6, [])]))
    assert st.row_slot.tolist()[:2] == [st.scratch, 4], "the aborted request's row now writes to scratch"
    assert st.host_stats["evicted"] == 1
    assert int(st.n_frames[4]) == 0 and int(st.prompt_len[4]) == 6 and int(st.gen[4]) == 2


def test_resumed_request_starts_with_its_prefix() -> None:
    st = _state()
    prefix = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    st.update(_Update(1, added=[(0, _params(2, 7, prefix=prefix), [1] * 13, [])]))
    assert int(st.n_frames[2]) == 3 and int(st.prompt_len[2]) == 10
    assert st.codes[2, :3].tolist() == prefix


# --------------------------------------------------------------------------- sampler


def test_gumbel_sampler_draws_from_the_softmax() -> None:
    from engine.vllm.sampling import code_keys, draw

    n, rows = 6, 4000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    x = logits.expand(rows, 1, n).clone()
    seeds = torch.arange(rows, dtype=torch.int64) * 7919 + 11
    got = draw(x, torch.zeros(rows, dtype=torch.bool), seeds, torch.zeros(rows, dtype=torch.int64), code_keys(1, n, x.device))
    freq = torch.bincount(got.view(-1), minlength=n).double() / rows
    want = torch.softmax(logits.double(), 0)
    assert freq[-1] == 0, "a masked code is never drawn"
    # 4000 draws: a binomial's standard deviation is below 0.008 here; allow 4 of them
    assert torch.allclose(freq, want, atol=0.032), (freq, want)


def test_seeded_draws_depend_on_seed_and_step_only() -> None:
    from engine.vllm.sampling import code_keys, draw

    torch.manual_seed(0)
    x = torch.randn(5, 4, 626)
    seeds = torch.tensor([1, 2, 3, 4, 5])
    steps = torch.tensor([0, 9, 3, 3, 100])
    g = torch.zeros(5, dtype=torch.bool)
    keys = code_keys(4, 626, x.device)
    full = draw(x, g, seeds, steps, keys)
    alone = draw(x[2:3], g[:1], seeds[2:3], steps[2:3], keys)
    assert torch.equal(full[2:3], alone), "a row's draw must not depend on its batch"
    other = draw(x, g, seeds + 1000, steps, keys)
    assert not torch.equal(full, other)
    greedy = draw(x, torch.ones(5, dtype=torch.bool), seeds, steps, keys)
    assert torch.equal(greedy, x.argmax(-1))


# --------------------------------------------------------------------------- real engine




@pytest.mark.vllm
async def test_channel_delivers_the_frames_the_worker_sampled_under_preemption(
    vllm_engine: Any, reference_engine: Any
) -> None:
    """Eight concurrent requests (sampled and greedy, several speakers) on a KV cache small
    enough to preempt: each one's delivered codes equal the frames its slot holds in the
    worker (the history the model embedded and penalised), greedy ones equal upstream."""
    from engine.api import SamplingParams, SpeechRequest
    from tests.engine.test_vllm_parity import TEXTS, assert_same, collect, oracle

    before = await vllm_engine.worker_stats()
    reqs = []
    for i in range(8):
        params = (
            SamplingParams(temperature=0.0, min_new_tokens=150, max_new_tokens=150)
            if i % 2
            else SamplingParams(temperature=0.3, seed=None if i % 4 else 40 + i, min_new_tokens=150, max_new_tokens=150)
        )
        reqs.append(SpeechRequest(f"chan{i}", TEXTS[i % 4], speaker=[3, 11, 7, None][i % 4], params=params))
    got = await asyncio.gather(*[collect(vllm_engine, r, delay_s=0.03 * i) for i, r in enumerate(reqs)])
    after = await vllm_engine.worker_stats()
    assert after["recomputed_frames"] > before["recomputed_frames"], f"no preemption happened: {after}"
    for r, (codes, _) in zip(reqs, got, strict=True):
        stats = vllm_engine.request_stats(r.request_id)
        worker = await vllm_engine.slot_frames(stats["slot"], len(codes))
        assert_same(codes, worker, f"{r.request_id}: delivered vs the worker's history")
        if r.params.temperature == 0.0:
            want = await oracle(reference_engine, r.text, r.speaker if r.speaker is not None else "2222", r.params)
            assert_same(codes, want, f"{r.request_id}: greedy vs upstream")
