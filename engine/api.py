"""The one interface the gateway sees.

Two levels:

* ``CodeEngine``: text -> ChatTTS code frames (4 codes per GPT step). Backends:
  ``vllm`` (ChatTTS GPT inside stock vLLM, ``engine/vllm/``) and ``reference``
  (upstream ``chattts`` in-process, the oracle and the "native pipeline" baseline).
* ``SpeechEngine``: text -> PCM audio chunks. ``ChatTTSSpeech`` is a CodeEngine plus the
  streaming decoder (``engine/decoder.py``); ``EspeakSpeech`` is the offline fallback.

No WebSocket concept crosses this module. Pure data + protocols: no torch, no asyncio I/O.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

#: Audio rate of ChatTTS (Vocos) output.
NATIVE_SAMPLE_RATE_HZ = 24_000
#: Samples of audio per GPT step (2 mel frames x hop 256).
SAMPLES_PER_STEP = 512
#: Number of codebooks: ChatTTS samples 4 codes per step.
NUM_CODEBOOKS = 4
#: Codes per codebook (625 real FSQ codes + EOS).
NUM_AUDIO_TOKENS = 626
#: The code that ends an utterance when sampled in any codebook.
AUDIO_EOS = NUM_AUDIO_TOKENS - 1


@dataclass(frozen=True)
class SamplingParams:
    """ChatTTS sampling parameters for one request (upstream ``InferCodeParams`` meaning)."""

    temperature: float = 0.3
    """Softmax temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 0.7
    """Nucleus sampling mass kept per codebook."""
    top_k: int = 20
    """Top-k kept per codebook."""
    repetition_penalty: float = 1.05
    """Penalty base applied per occurrence of a code in the last ``repetition_window`` frames."""
    repetition_window: int = 16
    """Frames looked back by the repetition penalty."""
    min_new_tokens: int = 0
    """EOS is blocked before this many steps."""
    max_new_tokens: int = 2048
    """Hard cap on steps per request (2048 steps = 43.7 s of audio)."""
    seed: int | None = None
    """Per-request sampling seed (reproducible runs); ``None`` is random."""
    ignore_eos: bool = False
    """Never stop at EOS: run exactly ``max_new_tokens`` steps (tests, benchmarks)."""


@dataclass(frozen=True)
class SpeechRequest:
    """One segment of text to speak."""

    request_id: str
    """Unique id; used for abort."""
    text: str
    """Text to speak (already segmented by the gateway)."""
    speaker: str | int | None = None
    """Speaker: an int seed (random voice from the speaker statistics), an upstream-encoded
    embedding string (lzma + base16384, as ``Chat.sample_random_speaker`` returns), or None
    for the engine's default voice."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters."""
    sample_rate_hz: int = NATIVE_SAMPLE_RATE_HZ
    """Sample rate wanted for audio (SpeechEngine only): 8000, 16000, 24000 or 48000."""
    prefix_codes: np.ndarray | None = field(default=None, compare=False)
    """Resume a segment: int64 ``[k, NUM_CODEBOOKS]`` frames already generated for it (by an
    aborted earlier request of the same text, speaker and parameters). The engine continues at
    frame ``k`` as if uninterrupted (repetition history and ``min_new_tokens`` count the prefix;
    ``max_new_tokens`` is the segment's total) and yields only the new frames. vLLM backend
    only (``VllmCodeEngine``, which sets ``supports_resume = True``); other code engines do not
    support it (the reference backend ignores it), so callers check ``supports_resume``."""
    queued_audio_ms: float = 0.0
    """Audio the listener holds ahead of this request's first audio when it is submitted (what an
    earlier segment left in the client's buffer and unsent): the speech engine's decoder sizes its
    chunks by the listener's whole lead (``StreamLead``), so a segment queued behind seconds of
    audio starts with whole chunks. 0: the listener is taken to start on this request's first chunk."""


@dataclass(frozen=True)
class CodeFrames:
    """Code frames sampled for one request since the last yield."""

    request_id: str
    codes: np.ndarray
    """int64 array ``[n, NUM_CODEBOOKS]``; EOS frames are never included."""
    hidden: np.ndarray | None = None
    """float32 ``[n, hidden]``: the GPT's last hidden state per step, when the backend
    hands it out (for the ``Decoder`` vocoding path); else None."""
    finished: bool = False
    """True on the last yield of the request."""
    finish_reason: str | None = None
    """"eos", "length" or "abort" once finished."""


@dataclass(frozen=True)
class AudioChunk:
    """PCM16 mono audio produced for one request since the last yield."""

    request_id: str
    pcm: bytes
    """Little-endian int16 mono samples at ``sample_rate_hz``."""
    sample_rate_hz: int
    finished: bool = False
    """True on the last yield of the request (``pcm`` may be empty)."""
    steps: int = 0
    """GPT steps behind this chunk (0 for non-ChatTTS engines)."""
    codes: bytes = b""
    """The code frames the engine generated for the request since the last yield, in the wire
    form of :func:`codes_to_bytes` (``ResumeMode.CODES`` engines; else empty). Frames are
    generated before their audio is decoded, so the codes of every sample yielded so far have
    been yielded too: a client holding them can resume the segment there."""


class ResumeMode(enum.Enum):
    """How a segment a client received part of can be continued after its connection is lost."""

    CODES = "codes"
    """From the code frames already generated (``AudioChunk.codes``, given back as
    ``SpeechRequest.prefix_codes``): the engine decodes them again and generates the rest as if
    uninterrupted; the caller drops the samples the client has."""
    SAMPLES = "samples"
    """The engine makes the same audio again for the same request: the caller drops the samples
    the client has."""
    SEGMENT = "segment"
    """Neither: the segment can only be spoken again from its start."""


#: Bytes per code frame in the wire form (``NUM_CODEBOOKS`` little-endian int16).
CODE_FRAME_BYTES = 2 * NUM_CODEBOOKS


def codes_to_bytes(codes: np.ndarray) -> bytes:
    """Code frames ``[n, NUM_CODEBOOKS]`` -> their wire form: little-endian int16, row-major."""
    return np.ascontiguousarray(codes, dtype="<i2").tobytes()


def codes_from_bytes(data: bytes) -> np.ndarray:
    """The wire form -> int64 ``[n, NUM_CODEBOOKS]``; ``ValueError`` when ``data`` is not whole
    frames or holds a code outside ``0 .. NUM_AUDIO_TOKENS - 2`` (EOS is never a frame's)."""
    if len(data) % CODE_FRAME_BYTES:
        raise ValueError(f"{len(data)} bytes is not a whole number of {CODE_FRAME_BYTES}-byte code frames")
    arr = np.frombuffer(data, dtype="<i2").astype(np.int64).reshape(-1, NUM_CODEBOOKS)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= AUDIO_EOS):
        raise ValueError("a code outside the codebook")
    return arr


class EngineErrorKind(enum.Enum):
    RECOVERABLE = "recoverable"
    """This request failed; the engine still serves others."""
    UNRECOVERABLE = "unrecoverable"
    """The engine is dead (e.g. engine-core process crashed); it must restart."""


class EngineError(Exception):
    """Raised from ``generate``/``synthesize`` iterators. Message is for logs, never clients."""

    def __init__(self, message: str, kind: EngineErrorKind = EngineErrorKind.RECOVERABLE):
        super().__init__(message)
        self.kind = kind


class EngineOverloaded(EngineError):
    """Admission refused: the engine cannot start this request within its targets."""

    def __init__(self, message: str, retry_after_ms: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms
        """When a retry is likely to be admitted (the admission estimate), if known."""


@dataclass(frozen=True)
class EngineHealth:
    name: str
    """Engine name, e.g. "chattts-vllm", "chattts-reference", "espeak"."""
    healthy: bool
    running_requests: int
    """Requests currently inside the engine (must return to 0 after aborts)."""
    detail: str = ""
    counters: Mapping[str, float] = field(default_factory=dict)
    """Monotonic totals since start, engine-specific names (the vLLM engine: ``requests``,
    ``first_outputs``, ``ttft_s``, ``steps``, ``outputs``; the decoder: ``decode_jobs``,
    ``decode_s``, and its process's ``decoder_forwards``, ``decoder_rows``, ``decoder_padded_rows``,
    ``decoder_busy_s``). ``gateway.monitor`` logs their rates."""


@runtime_checkable
class CodeEngine(Protocol):
    """Text -> ChatTTS code frames."""

    name: str

    async def start(self) -> None: ...

    def generate(self, request: SpeechRequest) -> AsyncIterator[CodeFrames]: ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> EngineHealth: ...

    async def close(self) -> None: ...


@runtime_checkable
class SpeechEngine(Protocol):
    """Text -> PCM audio chunks. What the gateway uses."""

    name: str
    native_sample_rate_hz: int
    resume_mode: ResumeMode
    """How a partly received segment is continued (``SpeechRequest.prefix_codes``,
    ``AudioChunk.codes``)."""

    async def start(self) -> None: ...

    def check_voice(self, voice: str | int) -> str | None:
        """Why ``voice`` (a ``SpeechRequest.speaker`` value) cannot be used, in a fixed phrase for
        the client, or None when it can. Cheap: called when a session starts."""
        ...

    def synthesize(self, request: SpeechRequest) -> AsyncIterator[AudioChunk]: ...

    async def abort(self, request_id: str) -> None: ...

    def health(self) -> EngineHealth: ...

    async def close(self) -> None: ...
