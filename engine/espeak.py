"""Offline fallback ``SpeechEngine``: eSpeak NG (formant synthesis) through ctypes.

The shared library and its data come from the ``espeakng-loader`` wheel (no system package).
eSpeak NG keeps global state and is not thread-safe, so one dedicated worker thread owns it:

* Each request's text is cut into *pieces* (sentences, then clauses, then words; at most
  ``piece_chars`` characters). The worker synthesizes one piece at a time, round-robin over
  the requests that have room, so concurrent requests share the worker fairly and a long
  text cannot hold everyone else back.
* eSpeak runs in synchronous mode: ``espeak_Synth`` calls our callback with ~``buffer_ms`` of
  22050 Hz PCM at a time. The callback resamples (``engine.audio_format.StreamResampler``,
  soxr, one per request) and hands the
  chunk to the request's asyncio queue through ``loop.call_soon_threadsafe``. Returning 1 from
  the callback stops eSpeak at once: that is how ``abort`` is prompt.
* Bounded: a request is only given its next piece while it has less than ``max_buffered_ms``
  of audio waiting to be read, so at most ``max_buffered_ms`` + one piece of audio (~8 s for
  120 characters) ever sits in its queue, however slowly the gateway reads.

Voices (``SpeechRequest.speaker`` -> eSpeak voice):

* ``None`` -> the engine's ``default_speaker``.
* an ``int``, or a string of digits (``"2222"``, ChatTTS-style seed) -> ``VOICES[seed % len(VOICES)]``.
* ``"espeak:<name>"`` -> that eSpeak voice verbatim, e.g. ``"espeak:en-gb+f4"`` or ``"espeak:de"``.
* any other string (an upstream ChatTTS speaker embedding) -> ``VOICES[sha256(s) % len(VOICES)]``,
  so one embedding always gets the same voice.

The language part follows the text: when most letters are CJK ideographs the voice's
language becomes ``cmn`` (Mandarin) and the variant (``+f3`` ...) is kept. ChatTTS control
tokens (``[uv_break]``, ``[laugh]``, ``[oral_2]`` ...) are removed before synthesis.
``SpeechRequest.params`` is ignored. eSpeak NG output is not bit-exact between runs (a few
samples of jitter in pause lengths), so only durations are comparable.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import hashlib
import itertools
import logging
import re
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.api import AudioChunk, EngineError, EngineErrorKind, EngineHealth, ResumeMode, SpeechRequest
from engine.audio_format import StreamResampler, pcm16_bytes, pcm16_to_float

log = logging.getLogger(__name__)

#: eSpeak NG's output rate (fixed by its data).
ESPEAK_SAMPLE_RATE_HZ = 22_050

#: Voices chosen by seed: eSpeak NG language + voice variant (``espeak-ng-data/voices/!v``).
VOICES: tuple[str, ...] = (
    "en-us",
    "en-us+f3",
    "en-us+m3",
    "en-us+f2",
    "en-us+m7",
    "en+f4",
    "en+m1",
    "en-us+f5",
    "en-us+m5",
    "en-gb-x-rp+f1",
    "en-us+m2",
    "en-gb-scotland+m4",
)

_VOICE_NAME_RE = re.compile(r"^[A-Za-z0-9_\-]+(\+[A-Za-z0-9_\- ]+)?$")
_CONTROL_TOKEN_RE = re.compile(r"\[[A-Za-z_]+(?:_\d+)?\]")
_CJK_RE = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LETTER_RE = re.compile(r"[^\W\d_]")
_SENTENCE_RE = re.compile(r"(?<=[.!?;。！？；\n])\s*")
_CLAUSE_RE = re.compile(r"(?<=[,:，、：])\s*")

# eSpeak NG C API constants (speak_lib.h).
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_ESPEAK_CHARS_UTF8 = 1
_ESPEAK_ENDPAUSE = 0x1000
_ESPEAK_RATE = 1
_ESPEAK_VOLUME = 2

_SynthCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


def voice_for(speaker: str | int | None, text: str = "", default: str | int | None = 2222) -> str:
    """The eSpeak voice name for a ``SpeechRequest.speaker`` (see module docstring). Pure."""
    if speaker is None or speaker == "":
        speaker = default if default is not None else 0
    if isinstance(speaker, bool):
        speaker = int(speaker)
    if isinstance(speaker, int):
        voice = VOICES[speaker % len(VOICES)]
    elif speaker.strip().isdigit():
        voice = VOICES[int(speaker.strip()) % len(VOICES)]
    elif speaker.startswith("espeak:"):
        name = speaker[len("espeak:") :].strip()
        voice = name if _VOICE_NAME_RE.match(name) else VOICES[0]
    else:
        digest = hashlib.sha256(speaker.encode("utf-8", "replace")).digest()
        voice = VOICES[int.from_bytes(digest[:8], "big") % len(VOICES)]
    if text and _mostly_cjk(text):
        _, plus, variant = voice.partition("+")
        voice = "cmn" + plus + variant
    return voice


def _mostly_cjk(text: str) -> bool:
    letters = len(_LETTER_RE.findall(text))
    return letters > 0 and len(_CJK_RE.findall(text)) * 2 >= letters


def clean_text(text: str) -> str:
    """Remove ChatTTS control tokens and collapse whitespace. Pure."""
    return " ".join(_CONTROL_TOKEN_RE.sub(" ", text).split())


def split_pieces(text: str, max_chars: int = 120) -> list[str]:
    """Cut text into pieces of at most ``max_chars`` (sentence > clause > word > hard cut). Pure."""
    out: list[str] = []
    for sentence in _SENTENCE_RE.split(text):
        sentence = sentence.strip()
        if not sentence:
            continue
        if len(sentence) <= max_chars:
            out.append(sentence)
            continue
        buf = ""
        for part in itertools.chain.from_iterable(
            (c.split(" ") if len(c) > max_chars else [c]) for c in _CLAUSE_RE.split(sentence)
        ):
            if not part:
                continue
            while len(part) > max_chars:  # one huge "word" (no spaces, e.g. CJK text)
                if buf:
                    out.append(buf)
                    buf = ""
                out.append(part[:max_chars])
                part = part[max_chars:]
            candidate = f"{buf} {part}" if buf else part
            if len(candidate) > max_chars and buf:
                out.append(buf)
                buf = part
            else:
                buf = candidate
        if buf:
            out.append(buf)
    return out


@dataclass(eq=False)
class _Job:
    request_id: str
    voice: str
    pieces: collections.deque[str]
    out_rate_hz: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[bytes | None | BaseException]
    resampler: StreamResampler | None = None
    queued_samples: int = 0
    """Output samples handed to the queue and not yet read (guarded by the engine lock)."""
    aborted: bool = False
    done: bool = False
    """The worker has pushed the end marker (None) or an error."""
    failed: str = field(default="")

    def push(self, item: bytes | None | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # loop closed: the consumer is gone
            self.aborted = True


class EspeakSpeech:
    """``SpeechEngine`` speaking with eSpeak NG. See the module docstring."""

    name = "espeak"
    native_sample_rate_hz = ESPEAK_SAMPLE_RATE_HZ
    resume_mode = ResumeMode.SEGMENT
    """eSpeak NG does not make the same samples twice (a few hundred samples' difference between
    calls with the same text and voice, whatever libc's seed): a segment restarts from its start."""

    def __init__(
        self,
        default_speaker: str | int | None = 2222,
        rate_wpm: int = 175,
        volume: int = 100,
        piece_chars: int = 120,
        max_buffered_ms: float = 4_000.0,
        buffer_ms: int = 60,
    ) -> None:
        self.default_speaker = default_speaker
        self.rate_wpm = rate_wpm
        self.volume = volume
        self.piece_chars = piece_chars
        self.max_buffered_ms = max_buffered_ms
        self.buffer_ms = buffer_ms
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._jobs: dict[str, _Job] = {}
        self._rr: collections.deque[str] = collections.deque()
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: str = ""
        self._stopping = False
        self._current: _Job | None = None
        self._callback = _SynthCallback(self._on_audio)  # keep a reference for the C side
        self._lib: ctypes.CDLL | None = None

    # ----------------------------------------------------------------- lifecycle

    def check_voice(self, voice: str | int) -> str | None:
        """None: every value picks a voice (``voice_for``)."""
        return None

    async def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._started.clear()
        self._thread = threading.Thread(target=self._run, name="espeak-worker", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._started.wait, 30.0)
        if self._start_error or not self._started.is_set():
            raise EngineError(
                f"espeak: cannot start: {self._start_error or 'timeout'}", EngineErrorKind.UNRECOVERABLE
            )

    async def close(self) -> None:
        with self._lock:
            self._stopping = True
            for job in self._jobs.values():
                job.aborted = True
            self._wake.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)
            self._thread = None

    def health(self) -> EngineHealth:
        alive = self._thread is not None and self._thread.is_alive() and not self._start_error
        with self._lock:
            running = len(self._jobs)
        return EngineHealth(
            name=self.name,
            healthy=alive,
            running_requests=running,
            detail=self._start_error or ("" if alive else "not started"),
        )

    # ----------------------------------------------------------------- requests

    async def abort(self, request_id: str) -> None:
        with self._lock:
            job = self._jobs.get(request_id)
            if job is not None:
                job.aborted = True
                self._wake.notify_all()
        if job is not None and job.loop is asyncio.get_running_loop():
            job.queue.put_nowait(None)  # the consumer ends now, without waiting for the worker

    async def synthesize(self, request: SpeechRequest) -> AsyncGenerator[AudioChunk, None]:
        if self._thread is None or not self._thread.is_alive():
            raise EngineError("espeak: engine not started", EngineErrorKind.UNRECOVERABLE)
        if request.sample_rate_hz <= 0:
            raise EngineError(f"espeak: bad sample rate {request.sample_rate_hz}")
        text = clean_text(request.text)
        job = _Job(
            request_id=request.request_id,
            voice=voice_for(request.speaker, text, self.default_speaker),
            pieces=collections.deque(split_pieces(text, self.piece_chars)),
            out_rate_hz=request.sample_rate_hz,
            loop=asyncio.get_running_loop(),
            queue=asyncio.Queue(),
        )
        with self._lock:
            if request.request_id in self._jobs:
                raise EngineError(f"espeak: duplicate request id {request.request_id!r}")
            self._jobs[job.request_id] = job
            self._rr.append(job.request_id)
            self._wake.notify_all()
        max_samples = int(self.max_buffered_ms * request.sample_rate_hz / 1000)
        try:
            while True:
                item = await job.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None or job.aborted:
                    yield AudioChunk(job.request_id, b"", request.sample_rate_hz, finished=True)
                    return
                with self._lock:
                    before = job.queued_samples
                    job.queued_samples -= len(item) // 2
                    if before >= max_samples > job.queued_samples:
                        self._wake.notify_all()
                yield AudioChunk(job.request_id, item, request.sample_rate_hz)
        finally:
            with self._lock:
                job.aborted = True
                self._jobs.pop(job.request_id, None)
                try:
                    self._rr.remove(job.request_id)
                except ValueError:
                    pass
                self._wake.notify_all()

    # ----------------------------------------------------------------- worker thread

    def _init_library(self) -> ctypes.CDLL:
        import espeakng_loader

        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, self.buffer_ms, espeakng_loader.get_data_path().encode(), 0
        )
        if rate != ESPEAK_SAMPLE_RATE_HZ:
            raise RuntimeError(f"espeak_Initialize returned {rate}")
        lib.espeak_SetSynthCallback(self._callback)
        lib.espeak_SetParameter(_ESPEAK_RATE, self.rate_wpm, 0)
        lib.espeak_SetParameter(_ESPEAK_VOLUME, self.volume, 0)
        return lib

    def _run(self) -> None:
        try:
            self._lib = self._init_library()
        except Exception as exc:  # library missing or data broken
            self._start_error = f"{type(exc).__name__}: {exc}"
            log.error("espeak: %s", self._start_error)
            self._started.set()
            return
        self._started.set()
        voice_now = ""
        while True:
            job, piece = self._next_piece()
            if job is None:
                return
            try:
                if piece is None:  # text exhausted (or aborted): flush and end
                    tail = b"" if job.aborted else self._resample(job, np.zeros(0, np.int16), last=True)
                    if tail:
                        self._push_audio(job, tail)
                    job.push(None)
                    continue
                if job.voice != voice_now:
                    if self._lib.espeak_SetVoiceByName(job.voice.encode()) != 0:
                        log.warning("espeak: unknown voice %r, using %r", job.voice, VOICES[0])
                        self._lib.espeak_SetVoiceByName(VOICES[0].encode())
                    voice_now = job.voice
                self._current = job
                data = piece.encode("utf-8") + b"\0"
                err = self._lib.espeak_Synth(
                    data, len(data), 0, _POS_CHARACTER, 0, _ESPEAK_CHARS_UTF8 | _ESPEAK_ENDPAUSE, None, None
                )
                self._current = None
                if err not in (0, 0x10000FFF):  # EE_OK; "interrupted" when the callback stopped it
                    raise RuntimeError(f"espeak_Synth returned {err:#x}")
            except Exception as exc:
                self._current = None
                log.exception("espeak: request %s failed", job.request_id)
                with self._lock:
                    job.done = True
                job.push(EngineError(f"espeak: {type(exc).__name__}: {exc}"))

    def _next_piece(self) -> tuple[_Job | None, str | None]:
        """Block until some request can take a piece; round-robin. (None, None): stop."""
        with self._lock:
            while True:
                if self._stopping:
                    return None, None
                for _ in range(len(self._rr)):
                    rid = self._rr[0]
                    self._rr.rotate(-1)
                    job = self._jobs.get(rid)
                    if job is None or job.done:
                        continue
                    if job.aborted or not job.pieces:
                        job.done = True
                        return job, None
                    max_samples = self.max_buffered_ms * job.out_rate_hz / 1000
                    if job.queued_samples < max_samples:
                        return job, job.pieces.popleft()
                self._wake.wait()

    def _on_audio(self, wav: Any, numsamples: int, events: Any) -> int:
        """eSpeak's synth callback (worker thread). Return 1 to stop synthesis."""
        job = self._current
        if job is None or job.aborted or self._stopping:
            return 1
        if wav and numsamples > 0:
            samples = np.frombuffer(ctypes.string_at(wav, numsamples * 2), dtype=np.int16)
            pcm = self._resample(job, samples, last=False)
            if pcm:
                self._push_audio(job, pcm)
        return 0

    def _push_audio(self, job: _Job, pcm: bytes) -> None:
        with self._lock:
            job.queued_samples += len(pcm) // 2
        job.push(pcm)

    @staticmethod
    def _resample(job: _Job, samples: np.ndarray, last: bool) -> bytes:
        if job.out_rate_hz == ESPEAK_SAMPLE_RATE_HZ:
            return samples.astype("<i2").tobytes()
        if job.resampler is None:
            job.resampler = StreamResampler(ESPEAK_SAMPLE_RATE_HZ, job.out_rate_hz)
        return pcm16_bytes(job.resampler.process(pcm16_to_float(samples), last=last))
