"""The code channel: codebooks 1..3 from the vLLM worker to the front end, without logprobs.

vLLM returns one token id per request and step: codebook 0 (``T + code0``). The other three
codes of the frame travel through a **frame table** in shared memory that both sides map:

* ``int64 [slots + 1, frames]``; entry ``(slot, k)`` is frame ``k`` of the request holding
  ``slot``, packed as ``gen << 40 | c0 | c1 << 10 | c2 << 20 | c3 << 30`` (codes < 1024).
  The last slot is the worker's scratch row (rows that do not sample write there).
* **The front end owns it.** :class:`FrameTable` creates the file under ``/dev/shm`` at engine
  start, hands a free slot and a fresh generation ``gen`` to each request
  (``SamplingParams.extra_args``), and frees the slot when the request's stream ends. A slot
  freed goes to the back of a FIFO, so it is reused last; the worker also evicts any batch row
  still holding a slot that a new request takes (an aborted request's last in-flight step).
* **The worker writes it from the GPU step itself**: the table is registered as pinned
  (``cudaHostRegister``) and mapped into the device's address space, so the sampling step's
  scatter writes the frame straight into host memory (no copy, no host sync, no thread). vLLM
  sends token ``k`` to the front end only after its own device-to-host copy of the step's
  sampled tokens, which the stream orders after that scatter; on CPU the table is an ordinary
  tensor over the same memory.
* **The front end reads** entry ``(slot, k)`` when it receives token ``k`` and checks it: the
  generation must be its own and ``c0`` must equal the token. A stale or not-yet-visible entry
  is re-read for a bounded time, then the request fails (never wrong audio).

Bounded: ``slots x frames x 8`` bytes (``slots`` from ``EngineConfig``, ``frames`` = the
model length). Correct under preemption/recompute (frames are sampled once and the worker keeps
them by slot, not by batch row), abort (FIFO reuse + eviction + gen check), prefix caching and
chunked prefill (a row writes only when it samples), async scheduling (stream order), data
parallelism (every engine-core process maps the same table; a request runs on one) and engine
restart (the table outlives the engine core; new processes map it again).

This module imports numpy only; the worker side gets its tensor view from :func:`device_view`.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.shm import map_file, new_path

#: Environment variable naming the table for the worker processes: ``path:slots:frames``.
ENV_KEY = "VOICEGW_FRAME_TABLE"
CODE_BITS = 10
CODE_MASK = (1 << CODE_BITS) - 1
GEN_SHIFT = 40
#: Generations wrap below 2**23 (the packed value stays a positive int64); 0 means "never written".
GEN_LIMIT = 1 << 23


@dataclass(frozen=True)
class TableSpec:
    path: str
    slots: int
    """Slots the front end hands out; the table has one more (the worker's scratch row)."""
    frames: int

    @property
    def rows(self) -> int:
        return self.slots + 1

    @property
    def nbytes(self) -> int:
        return self.rows * self.frames * 8

    def to_env(self) -> str:
        return f"{self.path}:{self.slots}:{self.frames}"

    @classmethod
    def from_env(cls, value: str) -> TableSpec:
        path, slots, frames = value.rsplit(":", 2)
        return cls(path, int(slots), int(frames))


def pack(gen: np.ndarray | int, codes: np.ndarray) -> np.ndarray:
    """``codes`` ``[..., 4]`` -> packed int64 ``[...]`` (numpy; the worker packs with torch)."""
    c = codes.astype(np.int64)
    return (
        (np.int64(gen) << GEN_SHIFT)
        | c[..., 0]
        | (c[..., 1] << CODE_BITS)
        | (c[..., 2] << 2 * CODE_BITS)
        | (c[..., 3] << 3 * CODE_BITS)
    )


def unpack(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Packed ``[...]`` -> (gen ``[...]``, codes ``[..., 4]``)."""
    v = values.astype(np.int64)
    codes = np.stack([(v >> (i * CODE_BITS)) & CODE_MASK for i in range(4)], axis=-1)
    return v >> GEN_SHIFT, codes


class FrameTable:
    """The front end's side: the table, its slots and generations (one per code engine).

    One front end creates the table and hands out all its slots; front ends sharing one engine
    core (``gateway.processes``) each map the table the launching process created
    (:meth:`attach_range`) and hand out a disjoint range of slots, each with its own generations
    (an entry is checked against slot and generation, so ranges never mix)."""

    def __init__(self, slots: int, frames: int, *, spec: TableSpec | None = None,
                 slot_range: tuple[int, int] | None = None) -> None:
        if spec is None:
            if slots < 1 or frames < 1:
                raise ValueError("frame table needs at least one slot and one frame")
            spec = TableSpec(new_path("frames"), slots, frames)
            self._mm, flat = map_file(spec.path, spec.nbytes, create=True)
        else:
            self._mm, flat = map_file(spec.path, spec.nbytes, create=False)
        self.spec = spec
        self.table = flat.reshape(spec.rows, spec.frames)
        lo, hi = slot_range if slot_range is not None else (0, spec.slots)
        if not 0 <= lo < hi <= spec.slots:
            raise ValueError(f"slot range {lo}..{hi} outside the table's {spec.slots} slots")
        self._free: deque[int] = deque(range(lo, hi))
        self._gen = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @classmethod
    def attach_range(cls, spec: TableSpec, lo: int, hi: int) -> FrameTable:
        """Map a table another process created; hand out slots ``lo .. hi-1`` only."""
        return cls(0, 0, spec=spec, slot_range=(lo, hi))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    async def acquire(self) -> tuple[int, int]:
        """A free slot and a fresh generation; waits (FIFO) while every slot is taken."""
        while not self._free:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            except BaseException:
                if fut in self._waiters:
                    self._waiters.remove(fut)
                elif self._free and self._waiters:  # pass a wake-up we will not use on
                    self._wake()
                raise
        slot = self._free.popleft()
        self._gen = self._gen % (GEN_LIMIT - 1) + 1
        return slot, self._gen

    def release(self, slot: int) -> None:
        self._free.append(slot)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    def read(self, slot: int, gen: int, k0: int, tokens: Sequence[int] | np.ndarray) -> np.ndarray | None:
        """Frames ``k0..k0+n`` of ``slot`` as codes ``[n, 4]``, or None while an entry is not
        (yet) the request's own: wrong generation or ``c0`` different from the token."""
        n = len(tokens)
        if k0 + n > self.spec.frames:
            raise IndexError(f"frames {k0}..{k0 + n} beyond the table's {self.spec.frames}")
        if n == 1:  # the common case (one token per step): plain integers, no array temporaries
            v = int(self.table[slot, k0])
            if v >> GEN_SHIFT != gen or v & CODE_MASK != int(tokens[0]):
                return None
            return np.array(
                [[v & CODE_MASK, (v >> CODE_BITS) & CODE_MASK, (v >> 2 * CODE_BITS) & CODE_MASK,
                  (v >> 3 * CODE_BITS) & CODE_MASK]],
                dtype=np.int64,
            )
        g, codes = unpack(self.table[slot, k0 : k0 + n])
        if (g != gen).any() or (codes[:, 0] != tokens).any():
            return None
        return codes

    def close(self, *, unlink: bool = True) -> None:
        """Unmap; ``unlink``: also remove the file (its creator; a front end that attached keeps it)."""
        if unlink:
            try:
                os.unlink(self.spec.path)
            except FileNotFoundError:
                pass
        try:
            self._mm.close()
        except BufferError:  # a view still exported (read results are copies; be safe)
            pass


def attach(spec: TableSpec) -> tuple[mmap.mmap, np.ndarray]:
    """The worker's side: map an existing table (``[rows, frames]`` int64 view)."""
    mm, flat = map_file(spec.path, spec.nbytes, create=False)
    return mm, flat.reshape(spec.rows, spec.frames)


def device_view(spec: TableSpec, device: Any) -> tuple[Any, Any]:
    """(keep-alive, torch int64 tensor ``[rows, frames]`` on ``device``) over the shared table.

    CPU: a tensor over the mapped memory. CUDA: the mapping registered with ``cudaHostRegister``
    (mapped, portable) and wrapped as a device tensor at the same address (unified addressing),
    so a kernel's writes land in the shared pages.
    """
    import torch

    mm, arr = attach(spec)
    if torch.device(device).type == "cpu":
        return (mm, arr), torch.from_numpy(arr)
    ptr = arr.ctypes.data
    cudart = torch.cuda.cudart()
    # cudaHostRegisterPortable | cudaHostRegisterMapped
    err = cudart.cudaHostRegister(ptr, spec.nbytes, 3)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the frame table failed ({err})")

    class _Iface:
        __cuda_array_interface__ = {
            "shape": (spec.rows, spec.frames),
            "typestr": "<i8",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }

    t = torch.as_tensor(_Iface(), device=torch.device(device))
    return (mm, arr), t
