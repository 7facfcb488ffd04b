"""Drive the released third-party TTS clients against a running gateway: one JSON line per call.

Runs in the frameworks' own virtual environment (``tests/frameworks/requirements.txt``; made by
``run.sh test``), not the gateway's: it imports nothing from this project. Every client is used as
its documentation says, with only the base URL and the key changed. For each call it prints::

    {"client": "pipecat-ai", "version": "1.14.0", "call": "ElevenLabsTTSService (WebSocket)",
     "ok": true, "rate_hz": 24000, "samples": 51840, "peak": 0.41, "words": 7, "error": null}

``samples`` is what the client handed its user after decoding (PCM frames for the frameworks, the
SDKs' bytes decoded by PyAV for mp3), so ``ok`` means audio arrived and decoded. ``words`` counts the
word timestamps a framework produced from the gateway's alignment, where it has them.

    python drive.py --http http://127.0.0.1:PORT --https https://127.0.0.1:TLSPORT [--only NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any

import numpy as np

RACHEL = "21m00Tcm4TlvDq8ikWAM"
TEXT = "Hello there. This is the gateway speaking through a framework."
CHUNKS = ["Hello ", "there. ", "This is ", "the gateway ", "speaking ", "through ", "a framework."]
TIMEOUT_S = 90.0


@dataclass
class Audio:
    rate_hz: int = 0
    pcm: bytearray = field(default_factory=bytearray)
    words: int | None = None
    word_times_s: list[tuple[float, float]] = field(default_factory=list)
    started_s: float = field(default_factory=time.monotonic)
    first_audio_s: float | None = None
    """Seconds from the call's start to its first audio (the clients that stream it)."""

    def add(self, data: bytes, rate_hz: int) -> None:
        if self.rate_hz and rate_hz != self.rate_hz:
            raise AssertionError(f"sample rate changed {self.rate_hz} -> {rate_hz}")
        self.rate_hz = rate_hz
        if data and self.first_audio_s is None:
            self.first_audio_s = round(time.monotonic() - self.started_s, 3)
        self.pcm += data


def decode(data: bytes) -> Audio:
    """Compressed audio (mp3, ogg/opus, ...) to 16-bit mono PCM with PyAV."""
    import av

    out = Audio()
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            arr = frame.to_ndarray()
            if arr.dtype != np.int16:
                arr = (np.clip(arr.astype(np.float32), -1.0, 1.0) * 32767).astype(np.int16)
            out.add(arr[0].tobytes(), frame.sample_rate)  # mono: the one plane / the packed row
    return out


# ---- Pipecat ------------------------------------------------------------------------------------

async def _pipecat(make_service: Callable[[Any], Any], rate_hz: int = 24_000) -> Audio:
    """One pipeline [service, collector]: speak TEXT, wait for the service's TTSStoppedFrame, end."""
    import aiohttp
    from pipecat.frames.frames import (
        EndFrame,
        ErrorFrame,
        Frame,
        TTSAudioRawFrame,
        TTSSpeakFrame,
        TTSStoppedFrame,
        TTSTextFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.workers.runner import WorkerRunner

    audio = Audio(words=0)
    stopped = asyncio.Event()
    errors: list[str] = []

    class Collect(FrameProcessor):
        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, TTSAudioRawFrame):
                audio.add(frame.audio, frame.sample_rate)
            elif isinstance(frame, TTSTextFrame) and audio.words is not None:
                audio.words += 1
            elif isinstance(frame, TTSStoppedFrame):
                stopped.set()
            elif isinstance(frame, ErrorFrame):
                errors.append(str(frame.error))
                stopped.set()
            await self.push_frame(frame, direction)

    class Errors(FrameProcessor):  # errors travel upstream
        async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
            await super().process_frame(frame, direction)
            if isinstance(frame, ErrorFrame):
                errors.append(str(frame.error))
                stopped.set()
            await self.push_frame(frame, direction)

    async with aiohttp.ClientSession() as http:
        service = make_service(http)
        worker = PipelineWorker(Pipeline([Errors(), service, Collect()]),
                                params=PipelineParams(audio_out_sample_rate=rate_hz),
                                idle_timeout_secs=None, enable_rtvi=False)
        runner = WorkerRunner(handle_sigint=False)
        run = asyncio.create_task(runner.run(worker))
        await worker.queue_frames([TTSSpeakFrame(TEXT)])
        await asyncio.wait_for(stopped.wait(), TIMEOUT_S)
        await worker.queue_frame(EndFrame())
        await asyncio.wait_for(run, 30)
    if errors:
        raise RuntimeError("; ".join(errors))
    return audio


async def pipecat_elevenlabs_ws(a: argparse.Namespace) -> Audio:
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

    return await _pipecat(lambda http: ElevenLabsTTSService(api_key="xi-test", voice_id=RACHEL,
                                                            url=a.http.replace("http", "ws", 1)))


async def pipecat_elevenlabs_http(a: argparse.Namespace) -> Audio:
    from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService

    return await _pipecat(lambda http: ElevenLabsHttpTTSService(api_key="xi-test", voice_id=RACHEL,
                                                                aiohttp_session=http, base_url=a.http))


async def pipecat_deepgram_ws(a: argparse.Namespace) -> Audio:
    from pipecat.services.deepgram.tts import DeepgramTTSService

    audio = await _pipecat(lambda http: DeepgramTTSService(api_key="dg-test", voice="aura-2-thalia-en",
                                                           base_url=a.http.replace("http", "ws", 1)))
    audio.words = None
    return audio


async def pipecat_deepgram_http(a: argparse.Namespace) -> Audio:
    from pipecat.services.deepgram.tts import DeepgramHttpTTSService

    audio = await _pipecat(lambda http: DeepgramHttpTTSService(api_key="dg-test", voice="aura-2-thalia-en",
                                                               aiohttp_session=http, base_url=a.http))
    audio.words = None
    return audio


async def pipecat_openai(a: argparse.Namespace) -> Audio:
    from pipecat.services.openai.tts import OpenAITTSService

    audio = await _pipecat(lambda http: OpenAITTSService(api_key="sk-test", base_url=a.http + "/v1",
                                                         voice="alloy"))
    audio.words = None
    return audio


# ---- LiveKit Agents -----------------------------------------------------------------------------

async def _lk_collect(stream: Any) -> Audio:
    audio = Audio()
    async with stream:
        async for ev in stream:
            f = ev.frame
            if f.num_channels != 1:
                raise AssertionError(f"{f.num_channels} channels")
            audio.add(bytes(f.data.cast("B")), f.sample_rate)
            for w in f.userdata.get("lk.timed_transcripts") or []:  # word timestamps, where it has them
                if str(w).strip():
                    audio.words = (audio.words or 0) + 1
                    audio.word_times_s.append((float(w.start_time), float(w.end_time)))
    return audio


async def _lk(make_tts: Callable[[Any], Any], streaming: bool) -> Audio:
    import aiohttp

    async with aiohttp.ClientSession() as http:
        tts = make_tts(http)
        try:
            if not streaming:
                return await asyncio.wait_for(_lk_collect(tts.synthesize(TEXT)), TIMEOUT_S)
            stream = tts.stream()
            for c in CHUNKS:
                stream.push_text(c)
            stream.flush()
            stream.end_input()
            return await asyncio.wait_for(_lk_collect(stream), TIMEOUT_S)
        finally:
            await tts.aclose()


def _lk_openai(a: argparse.Namespace) -> Callable[[Any], Any]:
    from livekit.plugins import openai

    return lambda http: openai.TTS(api_key="sk-test", base_url=a.http + "/v1", voice="alloy", model="tts-1")


def _lk_elevenlabs(a: argparse.Namespace) -> Callable[[Any], Any]:
    from livekit.plugins import elevenlabs

    return lambda http: elevenlabs.TTS(api_key="xi-test", voice_id=RACHEL, base_url=a.http + "/v1",
                                       http_session=http)


def _lk_deepgram(a: argparse.Namespace) -> Callable[[Any], Any]:
    from livekit.plugins import deepgram

    return lambda http: deepgram.TTS(api_key="dg-test", base_url=a.http + "/v1/speak", http_session=http)


async def livekit_openai_synthesize(a: argparse.Namespace) -> Audio:
    return await _lk(_lk_openai(a), streaming=False)


async def livekit_elevenlabs_synthesize(a: argparse.Namespace) -> Audio:
    return await _lk(_lk_elevenlabs(a), streaming=False)


async def livekit_elevenlabs_stream(a: argparse.Namespace) -> Audio:
    return await _lk(_lk_elevenlabs(a), streaming=True)


async def livekit_elevenlabs_interrupted_then_next(a: argparse.Namespace) -> Audio:
    """A long answer interrupted once its first audio came (the stream closed, as an agent does on
    barge-in), then the next answer: its audio, timed from its first text."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        tts = _lk_elevenlabs(a)(http)
        try:
            first = tts.stream()
            first.push_text("This long answer is interrupted by the user before it ends. " * 8)
            first.flush()
            await asyncio.wait_for(first.__anext__(), TIMEOUT_S)
            await first.aclose()
            stream = tts.stream()
            collected = asyncio.ensure_future(_lk_collect(stream))  # its clock starts here
            for c in CHUNKS:
                stream.push_text(c)
            stream.flush()
            stream.end_input()
            return await asyncio.wait_for(collected, TIMEOUT_S)
        finally:
            await tts.aclose()


async def livekit_deepgram_synthesize(a: argparse.Namespace) -> Audio:
    return await _lk(_lk_deepgram(a), streaming=False)


async def livekit_deepgram_stream(a: argparse.Namespace) -> Audio:
    return await _lk(_lk_deepgram(a), streaming=True)


# ---- the vendors' SDKs --------------------------------------------------------------------------

async def openai_speech(a: argparse.Namespace) -> Audio:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(api_key="sk-test", base_url=a.http + "/v1", max_retries=0)
    async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format="pcm") as resp:
        audio = Audio()
        async for chunk in resp.iter_bytes():
            audio.add(chunk, 24_000)
    return audio


async def elevenlabs_convert(a: argparse.Namespace) -> Audio:
    from elevenlabs.client import AsyncElevenLabs

    client = AsyncElevenLabs(api_key="xi-test", base_url=a.http)
    data = b"".join([c async for c in client.text_to_speech.convert(voice_id=RACHEL, text=TEXT)])
    return decode(data)  # the SDK's default, mp3_44100_128


async def elevenlabs_stream(a: argparse.Namespace) -> Audio:
    from elevenlabs.client import AsyncElevenLabs

    client = AsyncElevenLabs(api_key="xi-test", base_url=a.http)
    audio = Audio()
    async for c in client.text_to_speech.stream(voice_id=RACHEL, text=TEXT, output_format="pcm_16000"):
        audio.add(c, 16_000)
    return audio


async def elevenlabs_with_timestamps(a: argparse.Namespace) -> Audio:
    import base64

    from elevenlabs.client import AsyncElevenLabs

    client = AsyncElevenLabs(api_key="xi-test", base_url=a.http)
    r = await client.text_to_speech.convert_with_timestamps(voice_id=RACHEL, text=TEXT, output_format="pcm_24000")
    audio = Audio(words=0)
    audio.add(base64.b64decode(r.audio_base_64), 24_000)
    chars = r.alignment.characters if r.alignment else []
    if "".join(chars) != TEXT:
        raise AssertionError(f"alignment characters {''.join(chars)!r} != the text")
    audio.words = len("".join(chars).split())
    return audio


async def elevenlabs_voices_search(a: argparse.Namespace) -> Audio:
    """``voices.search()`` (GET /v2/voices, the SDK README's listing), then speech in the voice found."""
    from elevenlabs.client import AsyncElevenLabs

    client = AsyncElevenLabs(api_key="xi-test", base_url=a.http)
    found = await client.voices.search(search="Rachel")
    if [v.name for v in found.voices] != ["Rachel"] or found.total_count != 1 or found.has_more:
        raise AssertionError(f"voices.search(search='Rachel') gave {found!r}")
    audio = Audio()
    async for c in client.text_to_speech.stream(voice_id=found.voices[0].voice_id, text=TEXT,
                                                output_format="pcm_16000"):
        audio.add(c, 16_000)
    return audio


async def elevenlabs_realtime(a: argparse.Namespace) -> Audio:
    from elevenlabs.client import ElevenLabs

    client = ElevenLabs(api_key="xi-test", base_url=a.https)  # the SDK speaks wss:// only

    def run() -> bytes:
        return b"".join(client.text_to_speech.convert_realtime(
            voice_id=RACHEL, text=iter(CHUNKS), model_id="eleven_flash_v2_5", output_format="pcm_24000"))

    audio = Audio()
    audio.add(await asyncio.to_thread(run), 24_000)
    return audio


async def openai_models_retrieve(a: argparse.Namespace) -> Audio:
    """``models.retrieve("tts-1")`` (GET /v1/models/tts-1), then speech with the model retrieved."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(api_key="sk-test", base_url=a.http + "/v1", max_retries=0)
    model = await client.models.retrieve("tts-1")
    if model.id != "tts-1" or model.object != "model":
        raise AssertionError(f"models.retrieve('tts-1') gave {model!r}")
    resp = await client.audio.speech.create(model=model.id, voice="alloy", input=TEXT, response_format="pcm")
    audio = Audio()
    audio.add(resp.content, 24_000)
    return audio


def _dg_client(a: argparse.Namespace) -> Any:
    from deepgram import AsyncDeepgramClient, DeepgramClientEnvironment

    ws = a.http.replace("http", "ws", 1)
    env = DeepgramClientEnvironment(base=a.http, production=ws, agent=ws, agent_rest=a.http)
    return AsyncDeepgramClient(api_key="dg-test", environment=env)


async def deepgram_rest(a: argparse.Namespace) -> Audio:
    data = b"".join([c async for c in _dg_client(a).speak.v1.audio.generate(
        text=TEXT, model="aura-2-thalia-en", encoding="linear16", sample_rate=24_000)])
    if not data.startswith(b"RIFF"):  # linear16's default container is wav
        raise AssertionError("linear16 without container=none should come in a WAV container")
    return decode(data)


async def deepgram_rest_mulaw(a: argparse.Namespace) -> Audio:
    data = b"".join([c async for c in _dg_client(a).speak.v1.audio.generate(
        text=TEXT, model="aura-2-thalia-en", encoding="mulaw", sample_rate=8_000)])
    if not data.startswith(b"RIFF"):  # Deepgram REST's default container for mulaw is wav
        raise AssertionError("mulaw without container=none should come in a WAV container")
    return decode(data)


async def deepgram_ws(a: argparse.Namespace) -> Audio:
    from deepgram.speak.v1.types import SpeakV1Flush, SpeakV1Text

    audio = Audio()
    async with _dg_client(a).speak.v1.connect(model="aura-2-thalia-en", encoding="linear16",
                                              sample_rate=24_000) as sock:
        await sock.send_text(SpeakV1Text(text=TEXT))
        await sock.send_flush(SpeakV1Flush(type="Flush"))
        async for msg in sock:
            if isinstance(msg, bytes):
                audio.add(msg, 24_000)
            elif getattr(msg, "type", None) == "Flushed":
                break
    return audio


# ---- the table ------------------------------------------------------------------------------------

CASES: list[tuple[str, str, str, Callable[[argparse.Namespace], Awaitable[Audio]]]] = [
    ("pipecat-ai", "pipecat-ai", "ElevenLabsTTSService (multi-context WebSocket)", pipecat_elevenlabs_ws),
    ("pipecat-ai", "pipecat-ai", "ElevenLabsHttpTTSService", pipecat_elevenlabs_http),
    ("pipecat-ai", "pipecat-ai", "DeepgramTTSService (WebSocket)", pipecat_deepgram_ws),
    ("pipecat-ai", "pipecat-ai", "DeepgramHttpTTSService", pipecat_deepgram_http),
    ("pipecat-ai", "pipecat-ai", "OpenAITTSService", pipecat_openai),
    ("livekit-plugins-openai", "livekit-agents", "openai.TTS synthesize()", livekit_openai_synthesize),
    ("livekit-plugins-elevenlabs", "livekit-agents", "elevenlabs.TTS synthesize()", livekit_elevenlabs_synthesize),
    ("livekit-plugins-elevenlabs", "livekit-agents", "elevenlabs.TTS stream() (multi-context WebSocket)",
     livekit_elevenlabs_stream),
    ("livekit-plugins-elevenlabs", "livekit-agents", "elevenlabs.TTS stream() interrupted, then the next answer",
     livekit_elevenlabs_interrupted_then_next),
    ("livekit-plugins-deepgram", "livekit-agents", "deepgram.TTS synthesize()", livekit_deepgram_synthesize),
    ("livekit-plugins-deepgram", "livekit-agents", "deepgram.TTS stream() (WebSocket)", livekit_deepgram_stream),
    ("openai", "openai", "audio.speech.with_streaming_response.create (pcm)", openai_speech),
    ("openai", "openai", "models.retrieve, then audio.speech.create (pcm)", openai_models_retrieve),
    ("elevenlabs", "elevenlabs", "text_to_speech.convert (mp3)", elevenlabs_convert),
    ("elevenlabs", "elevenlabs", "text_to_speech.stream (pcm_16000)", elevenlabs_stream),
    ("elevenlabs", "elevenlabs", "text_to_speech.convert_with_timestamps", elevenlabs_with_timestamps),
    ("elevenlabs", "elevenlabs", "voices.search, then text_to_speech.stream", elevenlabs_voices_search),
    ("elevenlabs", "elevenlabs", "text_to_speech.convert_realtime (stream-input WebSocket)", elevenlabs_realtime),
    ("deepgram-sdk", "deepgram-sdk", "speak.v1.audio.generate (REST)", deepgram_rest),
    ("deepgram-sdk", "deepgram-sdk", "speak.v1.audio.generate (REST, mulaw: WAV by default)", deepgram_rest_mulaw),
    ("deepgram-sdk", "deepgram-sdk", "speak.v1.connect (WebSocket)", deepgram_ws),
]


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", required=True, help="the gateway, http://127.0.0.1:PORT")
    ap.add_argument("--https", required=True, help="TLS in front of it (for SDKs that speak wss:// only)")
    ap.add_argument("--only", default="", help="run only the cases whose function name contains this")
    a = ap.parse_args()
    for dist, shown, call, fn in CASES:
        if a.only and a.only not in fn.__name__:
            continue
        row: dict[str, Any] = {"client": shown, "version": version(dist), "call": call, "case": fn.__name__}
        t0 = time.monotonic()
        try:
            audio = await asyncio.wait_for(fn(a), TIMEOUT_S + 30)
            pcm = np.frombuffer(bytes(audio.pcm), dtype=np.int16)
            row.update(ok=pcm.size > 0 and audio.rate_hz > 0, rate_hz=audio.rate_hz, samples=int(pcm.size),
                       peak=round(float(np.abs(pcm).max() / 32768.0), 3) if pcm.size else 0.0,
                       words=audio.words, error=None if pcm.size else "no audio", first_audio_s=audio.first_audio_s,
                       word_times_s=[[round(a, 3), round(b, 3)] for a, b in audio.word_times_s])
        except BaseException as e:  # noqa: BLE001 (one row per call, whatever it raised)
            if isinstance(e, KeyboardInterrupt):
                raise
            row.update(ok=False, rate_hz=0, samples=0, peak=0.0, words=None,
                       error=f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc(file=sys.stderr)
        row["wall_s"] = round(time.monotonic() - t0, 2)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
