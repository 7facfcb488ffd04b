"""What the CLI runs: ``voicegw say TEXT -o out.wav`` and ``voicegw chat``."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from pathlib import Path
from typing import TextIO

from clients.python.client import Client, PlaybackMode, Utterance, UtteranceStats, VoicegwError
from clients.python.wav import WavWriter


async def say(
    url: str,
    text: str,
    out_wav: str | Path | None,
    *,
    voice: str | int | None = None,
    sample_rate_hz: int = 24_000,
    token: str | None = None,
    play: bool = False,
    playback: PlaybackMode | None = None,
) -> UtteranceStats:
    """Speak ``text`` through the gateway at ``url``; write the audio to ``out_wav`` (if given).

    Without ``play`` the client acts as a recorder (``playback="instant"``): the server sends as
    fast as the engine produces. With ``play`` it plays to the speakers (``sounddevice``; else a
    simulated real-time playback) and returns once playback has finished. Raises ``VoicegwError``
    (``handshake_failed``, an error code, ``closed``) when the utterance cannot be spoken.
    """
    mode: PlaybackMode = playback or ("speakers" if play else "instant")
    async with Client(url, token=token, voice=voice, sample_rate_hz=sample_rate_hz, playback=mode) as c:
        utt = c.speak(text)
        with WavWriter(out_wav, sample_rate_hz) if out_wav else contextlib.nullcontext() as w:
            async for chunk in utt:
                if w is not None:
                    w.write(chunk.pcm)
        if mode in ("speakers", "realtime"):
            await utt.wait_played()
        return utt.stats


async def _stdin_lines() -> AsyncIterator[str]:
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if line == "":
            return
        yield line


async def _aiter_lines(lines: AsyncIterable[str] | Iterable[str]) -> AsyncIterator[str]:
    if isinstance(lines, AsyncIterable):
        async for line in lines:
            yield line
    else:
        for line in lines:
            yield line


async def chat(
    url: str,
    *,
    voice: str | int | None = None,
    token: str | None = None,
    out_wav: str | Path | None = None,
    sample_rate_hz: int = 24_000,
    play: bool = True,
    lines: AsyncIterable[str] | Iterable[str] | None = None,
    out: TextIO | None = None,
) -> int:
    """Interactive: each line read (stdin by default) is streamed to the gateway and spoken.

    Lines queue behind the one speaking. ``/stop`` barges in (cancels everything speaking or
    queued), ``/quit`` ends. At end of input, waits for the queued speech, then returns 0.
    Audio plays to the speakers when ``sounddevice`` works (else a simulated real-time
    playback) and is appended to ``out_wav`` if given. Returns the exit code.
    """
    out = out or sys.stdout
    mode: PlaybackMode = "speakers" if play else "realtime"
    queue: asyncio.Queue[Utterance | None] = asyncio.Queue(maxsize=64)

    def say_line(msg: str) -> None:
        print(msg, file=out, flush=True)

    try:
        client = Client(url, token=token, voice=voice, sample_rate_hz=sample_rate_hz, playback=mode)
        session = await client.connect()
    except VoicegwError as exc:
        if exc.code == "handshake_failed":
            raise  # the command line says it in one line, as for `say`
        say_line(f"voicegw: {exc}")
        return 1
    say_line(f"connected to {client.url} (engine {session.get('engine')}, {sample_rate_hz} Hz). "
             "Type a line to speak it; /stop to interrupt; /quit to leave.")

    async def consume() -> None:
        writer = WavWriter(out_wav, sample_rate_hz) if out_wav else None
        try:
            while (utt := await queue.get()) is not None:
                try:
                    async for chunk in utt:
                        if writer is not None:
                            writer.write(chunk.pcm)
                    await utt.wait_played()
                except VoicegwError as exc:
                    say_line(f"  ! {exc}")
                    continue
                say_line(f"  [{utt.stats}]")
        finally:
            if writer is not None:
                writer.close()

    consumer = asyncio.create_task(consume())
    code = 0
    try:
        async for raw in _aiter_lines(lines if lines is not None else _stdin_lines()):
            line = raw.strip()
            if not line:
                continue
            if line in ("/quit", "/exit"):
                break
            if line in ("/stop", "/cancel"):
                reply = await client.cancel()
                heard = (reply or {}).get("heard_text") or ""
                say_line(f"  [stopped; heard: {heard!r}]")
                continue
            if client.closed:
                say_line("voicegw: connection closed")
                code = 1
                break
            await queue.put(client.speak(line + " "))
        await queue.put(None)
        await consumer
    finally:
        consumer.cancel()
        with contextlib.suppress(BaseException):
            await consumer
        await client.close()
    return code
