"""Per-request ChatTTS state inside the vLLM worker: persistent device tensors, indexed by slot.

Every request carries a **slot** of the front end's frame table (:mod:`engine.vllm.channel`)
and a generation ``gen`` in ``SamplingParams.extra_args[EXTRA_KEY]``. The worker keeps all of
a request's state in device tensors at that slot, for the request's whole life (preemption and
recompute included: a request leaves the persistent batch, its slot keeps its frames):

* ``codes [slots+1, frames, 4]``: the frames sampled so far (the repetition penalty's history,
  and the codes 1..3 a recompute prefill embeds again);
* ``n_frames [slots+1]``: frames sampled; ``prompt_len``: text prompt length;
* sampling parameters (temperature, top-p, top-k, penalty, window, min_new, greedy), the seed
  of the row's counter-based RNG, the speaker vector and whether the request has one.

Which batch row holds which slot: :meth:`DeviceState.update` (called by the logits processor's
``update_state(BatchUpdate)``, i.e. only when the batch changes) keeps a host array in
persistent-batch order and uploads it; rows without a request point at the scratch slot (the
last), so every gather and scatter of a step is unconditional and shape-static.

Nothing here loops over batch rows per step, and nothing copies device data to the host.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.vllm.channel import ENV_KEY, TableSpec, device_view

#: Key of our entry in ``SamplingParams.extra_args``.
EXTRA_KEY = "voicegw_chattts"
_PARAMS_ATTR = "_voicegw_params"
#: Longest repetition-penalty window the device history holds (upstream uses 16).
MAX_WINDOW = 64


@dataclass
class RequestParams:
    """Request parameters carried in ``SamplingParams.extra_args[EXTRA_KEY]`` (plain JSON types)."""

    key: str
    slot: int
    """Row of the front end's frame table (and of the worker's device state)."""
    gen: int
    """Generation of the slot: written with every frame, checked by the front end."""
    temperature: float
    top_p: float
    top_k: int
    penalty: float
    window: int
    min_new: int
    max_new: int
    greedy: bool
    seed: int
    """Seed of the row's counter-based RNG (the front end draws one when the caller gave none)."""
    speaker: str | None
    """The speaker vector: float32 little-endian bytes, base64 (a 768-float list would cost
    more to serialise, send and parse than the rest of the request)."""
    side_codes: bool = True
    """Debug switch: False drops codebooks 1..3 from the input embedding (negative control)."""
    prefix: list[list[int]] | None = None
    """Resumed request: the ``[k][num_vq]`` frames generated before (their codebook-0 tokens
    end the prompt). The state starts with them as frames 0..k-1, so the model embeds them like
    a recompute after preemption and samples frame k at the end of the prefill."""

    def to_extra(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_extra(cls, d: dict[str, Any]) -> RequestParams:
        return cls(
            key=str(d["key"]),
            slot=int(d["slot"]),
            gen=int(d["gen"]),
            temperature=float(d["temperature"]),
            top_p=float(d["top_p"]),
            top_k=int(d["top_k"]),
            penalty=float(d["penalty"]),
            window=int(d["window"]),
            min_new=int(d["min_new"]),
            max_new=int(d["max_new"]),
            greedy=bool(d["greedy"]),
            seed=int(d["seed"]),
            speaker=None if d.get("speaker") is None else str(d["speaker"]),
            side_codes=bool(d.get("side_codes", True)),
            prefix=None if d.get("prefix") is None else [[int(c) for c in row] for row in d["prefix"]],
        )


def encode_vector(v: Any) -> str:
    """float32 vector -> base64 of its little-endian bytes (``RequestParams.speaker``)."""
    return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")


def decode_vector(s: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype="<f4")


def request_params(sampling_params: Any) -> RequestParams | None:
    """The request's parameters, parsed once and kept on its ``SamplingParams`` object."""
    rp = getattr(sampling_params, _PARAMS_ATTR, None)
    if rp is None:
        extra = (getattr(sampling_params, "extra_args", None) or {}).get(EXTRA_KEY)
        if extra is None:
            return None
        rp = RequestParams.from_extra(extra)
        setattr(sampling_params, _PARAMS_ATTR, rp)
    return rp


class DeviceState:
    """All ChatTTS request state of one worker (see the module docstring)."""

    def __init__(self, *, device: torch.device, max_rows: int, hidden: int, num_vq: int,
                 spec: TableSpec | None, default_frames: int) -> None:
        self.device = device
        self.num_vq = num_vq
        if spec is None:  # no front end (e.g. a bare model): a private table
            self._keep: Any = None
            slots, frames = 64, default_frames
            self.table = torch.zeros((slots + 1, frames), dtype=torch.int64, device=device)
        else:
            self._keep, self.table = device_view(spec, device)
            slots, frames = spec.slots, spec.frames
            self._check_table()
        self.slots, self.frames = slots, frames
        self.scratch = slots
        s = slots + 1
        self.codes = torch.zeros((s, frames, num_vq), dtype=torch.int64, device=device)

        def per_slot(dtype: torch.dtype, fill: float | bool) -> torch.Tensor:
            return torch.full((s,), fill, dtype=dtype, device=device)

        i64, f32, b = torch.int64, torch.float32, torch.bool
        self.n_frames, self.prompt_len, self.gen, self.seed = (per_slot(i64, 0) for _ in range(4))
        self.temperature, self.top_p, self.penalty = (per_slot(f32, 1.0) for _ in range(3))
        self.top_k, self.window, self.min_new = (per_slot(i64, 0) for _ in range(3))
        self.greedy, self.side_on, self.has_spk = per_slot(b, True), per_slot(b, True), per_slot(b, False)
        self.speaker = torch.zeros((s, hidden), dtype=torch.float32, device=device)
        #: Batch row -> slot (host copy and device copy); rows without a request: scratch.
        self.max_rows = max_rows
        self.row_slot_host = np.full(max_rows, self.scratch, dtype=np.int64)
        self.row_slot = torch.full((max_rows,), self.scratch, dtype=torch.int64, device=device)
        #: Per step (written by the model's forward, read by its compute_logits).
        self.row_samples = torch.zeros(max_rows, dtype=torch.bool, device=device)
        #: Host-side generation each slot was initialised for (a re-add after preemption keeps
        #: its device state; a new request in the slot initialises it).
        self.slot_gen_host = np.zeros(s, dtype=np.int64)
        self.batch_size = 0
        #: Rows of the device ``row_slot`` that may hold a slot (the rest are scratch): an update
        #: uploads only this prefix, not all ``max_rows``.
        self.rows_on_device = 0
        #: Device counters: sampled frames, recomputed code tokens, steps (read by worker_stats).
        self.counters = torch.zeros(3, dtype=torch.int64, device=device)
        self.host_stats = {"requests": 0, "resumed": 0, "readded": 0, "evicted": 0}

    def _check_table(self) -> None:
        """The device view writes into the shared pages (checked once, at start)."""
        if self.device.type == "cpu":
            return
        probe = torch.full((1,), 0x5EED, dtype=torch.int64, device=self.device)
        self.table[-1, :1].copy_(probe)
        torch.cuda.synchronize(self.device)
        host = self._keep[1]
        if int(host[-1, 0]) != 0x5EED:
            raise RuntimeError("frame table: device writes do not reach the shared memory")
        host[-1, 0] = 0

    # ------------------------------------------------------------------ batch changes

    def _upload(self, host: np.ndarray | list[Any], dtype: torch.dtype) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(host), dtype=dtype)
        if self.device.type != "cpu":
            t = t.pin_memory().to(self.device, non_blocking=True)
        return t

    def update(self, batch_update: Any) -> None:
        """Apply vLLM's ``BatchUpdate`` (removed, then added, then moved)."""
        if batch_update is None:
            return
        rows = self.row_slot_host
        scratch = self.scratch
        new: list[tuple[RequestParams, int]] = []
        for index in batch_update.removed:
            if index < self.max_rows:
                rows[index] = scratch
        for added in batch_update.added:
            index, params, prompt_ids = added[0], added[1], added[2]
            rp = request_params(params)
            if rp is None or prompt_ids is None or index >= self.max_rows:
                if index < self.max_rows:
                    rows[index] = scratch
                continue
            slot = rp.slot
            if not 0 <= slot < self.slots:
                raise ValueError(f"ChatTTS request {rp.key}: slot {slot} outside the frame table")
            # An aborted request's last in-flight step may still hold this slot: evict it.
            held = np.nonzero(rows == slot)[0]
            if held.size:
                rows[held] = scratch
                self.host_stats["evicted"] += int(held.size)
            rows[index] = slot
            if self.slot_gen_host[slot] == rp.gen:
                self.host_stats["readded"] += 1
            else:
                self.slot_gen_host[slot] = rp.gen
                new.append((rp, len(prompt_ids)))
        for a, b, direction in batch_update.moved:
            if max(a, b) >= self.max_rows:
                continue
            if getattr(direction, "name", "") == "SWAP":
                rows[a], rows[b] = rows[b], rows[a]
            else:
                rows[b] = rows[a]
                rows[a] = scratch
        self.batch_size = int(batch_update.batch_size)
        rows[self.batch_size :] = scratch
        if new:
            self._init_slots(new)
        # rows past both the old and the new batch are scratch on the device already
        n = min(self.max_rows, max(self.rows_on_device, self.batch_size))
        self.row_slot[:n].copy_(self._upload(rows[:n], torch.int64), non_blocking=True)
        self.rows_on_device = min(self.max_rows, self.batch_size)

    def _init_slots(self, new: list[tuple[RequestParams, int]]) -> None:
        """Device state of newly arrived requests (vectorised over the arrivals)."""
        slots = self._upload([rp.slot for rp, _ in new], torch.int64)
        ks = [len(rp.prefix or ()) for rp, _ in new]
        for (rp, n_prompt), k in zip(new, ks, strict=True):
            if k > rp.max_new or k > n_prompt:
                raise ValueError(f"prefix of {k} frames does not fit (max_new {rp.max_new})")
            self.host_stats["resumed" if k else "requests"] += 1

        # One upload for every scalar of every arrival (columns split on the device).
        fields = [
            (self.n_frames, ks),
            (self.prompt_len, [n - k for (_, n), k in zip(new, ks, strict=True)]),
            (self.gen, [rp.gen for rp, _ in new]),
            (self.seed, [rp.seed & 0x7FFF_FFFF_FFFF_FFFF for rp, _ in new]),
            (self.top_k, [rp.top_k for rp, _ in new]),
            (self.window, [min(rp.window, MAX_WINDOW) for rp, _ in new]),
            (self.min_new, [rp.min_new for rp, _ in new]),
            (self.greedy, [rp.greedy for rp, _ in new]),
            (self.side_on, [rp.side_codes for rp, _ in new]),
            (self.has_spk, [rp.speaker is not None for rp, _ in new]),
        ]
        ints = self._upload(np.array([v for _, v in fields], dtype=np.int64), torch.int64)
        for j, (t, _) in enumerate(fields):
            t.index_put_((slots,), ints[j].to(t.dtype))
        floats = self._upload(
            np.array([[rp.temperature, rp.top_p, rp.penalty] for rp, _ in new], dtype=np.float32).T, torch.float32
        )
        for j, t in enumerate((self.temperature, self.top_p, self.penalty)):
            t.index_put_((slots,), floats[j])
        hidden = self.speaker.shape[1]
        spk = np.zeros((len(new), hidden), dtype=np.float32)
        for j, (rp, _) in enumerate(new):
            if rp.speaker is not None:
                spk[j] = decode_vector(rp.speaker)
        self.speaker.index_put_((slots,), self._upload(spk, torch.float32))
        for (rp, _), k in zip(new, ks, strict=True):
            if k:  # resumed request: its earlier frames (rare: once per resume)
                self.codes[rp.slot, :k] = self._upload(rp.prefix or [], torch.int64).view(k, self.num_vq)

    def stats(self) -> dict[str, int]:
        c = self.counters.tolist()  # an RPC, not a step: a sync is fine here
        out = dict(self.host_stats)
        out.update(sampled_frames=int(c[0]), recomputed_frames=int(c[1]), steps=int(c[2]))
        out["batch_size"] = int((self.row_slot_host[: self.batch_size] != self.scratch).sum())
        return out


_STATE: DeviceState | None = None


def device_state(vllm_config: Any = None, device: torch.device | None = None) -> DeviceState:
    """This worker's :class:`DeviceState`, created on first use (logits processor or model)."""
    global _STATE
    if _STATE is None:
        if vllm_config is None or device is None:
            raise RuntimeError("ChatTTS device state used before the worker created it")
        hf = vllm_config.model_config.hf_config
        env = os.environ.get(ENV_KEY)
        spec = TableSpec.from_env(env) if env else None
        _STATE = DeviceState(
            device=torch.device(device),
            # batch rows of a step, padded ones included (CUDA-graph padding may exceed max_num_seqs)
            max_rows=max(int(vllm_config.scheduler_config.max_num_seqs),
                         int(vllm_config.scheduler_config.max_num_batched_tokens)) + 1,
            hidden=int(hf.hidden_size),
            num_vq=int(hf.chattts_num_vq),
            spec=spec,
            default_frames=int(vllm_config.model_config.max_model_len),
        )
    return _STATE


def worker_stats(worker: Any = None) -> dict[str, int]:
    """Counters of this worker process, plus ``batch_size``: requests in the persistent batch
    as of the last batch change."""
    if _STATE is None:
        return {"batch_size": 0}
    return _STATE.stats()
