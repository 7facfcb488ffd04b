"""ElevenLabs multi-context WebSocket (``/v1/text-to-speech/{voice_id}/multi-stream-input``), driven
the way Pipecat's ``ElevenLabsTTSService`` and LiveKit's ``elevenlabs.TTS.stream()`` drive it
(message for message, as their sources send them): a context per turn, ``flush`` then
``close_context`` at the end of a turn, ``close_context`` alone to interrupt, keep-alives,
``close_socket``."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect

from loadtest.fakes import CountingEngine, FakeSpeechEngine
from tests.gateway.conftest import GatewayFactory, wait_until

RACHEL = "21m00Tcm4TlvDq8ikWAM"
QUERY = "model_id=eleven_flash_v2_5&output_format=pcm_16000&auto_mode=true&inactivity_timeout=180&sync_alignment=true"


def _url(server: Any) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/text-to-speech/{RACHEL}/multi-stream-input?{QUERY}"


async def _send(ws: ClientConnection, **msg: Any) -> None:
    await ws.send(orjson.dumps(msg).decode())


async def _until_final(ws: ClientConnection, cid: str, got: dict[str, bytearray], within_s: float = 60) -> list[Any]:
    """Receive until ``isFinal`` for ``cid``; audio goes to ``got[contextId]``. Every message
    is one of the SDK's own types (``AudioOutputMulti``, ``FinalOutputMulti``) or an error."""
    from elevenlabs.types.audio_output_multi import AudioOutputMulti
    from elevenlabs.types.final_output_multi import FinalOutputMulti

    seen = []
    async with asyncio.timeout(within_s):
        while True:
            msg = orjson.loads(await ws.recv())
            seen.append(msg)
            if "error" not in msg:
                (FinalOutputMulti if msg.get("isFinal") else AudioOutputMulti).model_validate(msg)
            if msg.get("audio"):
                got.setdefault(msg["contextId"], bytearray()).extend(base64.b64decode(msg["audio"]))
            if msg.get("isFinal") is True and msg.get("contextId") == cid:
                assert "audio" not in msg  # Pipecat ignores audio in a final message
                return seen


async def test_a_turn_per_context_as_pipecat_sends_it(counting_engine: CountingEngine,
                                                      make_gateway: GatewayFactory) -> None:
    async with make_gateway(counting_engine) as server, \
            connect(_url(server), additional_headers={"xi-api-key": "xi-test"}) as ws:
        got: dict[str, bytearray] = {}
        await _send(ws, text=" ", context_id="turn-1")
        for piece in ["Hello there, ", "this is the first turn. ", "It has two sentences."]:
            await _send(ws, text=piece, context_id="turn-1")
        await _send(ws, context_id="turn-1", flush=True)
        await _send(ws, context_id="turn-1", close_context=True)
        await _until_final(ws, "turn-1", got)
        first = counting_engine.total_samples
        assert len(got["turn-1"]) == 2 * first > 0
        # the next turn on the same socket, LiveKit-style: init with voice_settings {}, text with
        # a trailing space and flush, then an empty flushed text and close_context
        await _send(ws, text=" ", voice_settings={}, context_id="turn-2")
        await _send(ws, text="And this is the second turn. ", context_id="turn-2", flush=True)
        await _send(ws, text="", context_id="turn-2", flush=True)
        await _send(ws, context_id="turn-2", close_context=True)
        await _until_final(ws, "turn-2", got)
        assert len(got["turn-2"]) == 2 * (counting_engine.total_samples - first) > 0
        assert counting_engine.rates == {16_000}
        await _send(ws, close_socket=True)
        await asyncio.wait_for(ws.wait_closed(), 10)
        assert ws.close_code == 1000
        assert await wait_until(lambda: counting_engine.health().running_requests == 0)


async def test_close_context_alone_interrupts_that_context_only(make_gateway: GatewayFactory) -> None:
    engine = FakeSpeechEngine(speed=1.0)  # real time: the long turn is still being generated
    long = "This answer goes on and on, one sentence after another, for quite a while. " * 8
    async with make_gateway(engine) as server, connect(_url(server)) as ws:
        got: dict[str, bytearray] = {}
        await _send(ws, text=" ", context_id="a")
        await _send(ws, text=long, context_id="a")
        async with asyncio.timeout(10):
            while "a" not in got:
                msg = orjson.loads(await ws.recv())
                if msg.get("audio"):
                    got.setdefault(msg["contextId"], bytearray()).extend(base64.b64decode(msg["audio"]))
        await _send(ws, context_id="a", close_context=True)  # the user barged in
        seen = await _until_final(ws, "a", got, within_s=5)
        assert engine.aborted, "the interrupted context's engine work goes on"
        # the next turn is spoken at once, not after the rest of the interrupted one
        await _send(ws, text=" ", context_id="b")
        await _send(ws, text="Sure, stopping now.", context_id="b")
        await _send(ws, context_id="b", flush=True)
        await _send(ws, context_id="b", close_context=True)
        seen = await _until_final(ws, "b", got, within_s=10)
        assert not [m for m in seen if m.get("contextId") == "a" and m.get("audio")]
        assert len(got["b"]) == 2 * engine.expected_samples("Sure, stopping now.", 16_000)
        # a second close of a finished context, and keep-alives, are no-ops
        await _send(ws, context_id="a", close_context=True)
        await _send(ws, text="")
        await _send(ws, text="", context_id="b")
        await _send(ws, text=" ", context_id="c")
        await _send(ws, context_id="c", close_context=True)  # a context that got no text ends at once
        await _until_final(ws, "c", got, within_s=5)


async def test_context_limit_and_voice_settings_in_any_message(fake_engine: FakeSpeechEngine,
                                                               make_gateway: GatewayFactory) -> None:
    async with make_gateway(fake_engine) as server, connect(_url(server)) as ws:
        for i in range(5):
            await _send(ws, text=" ", context_id=f"c{i}")
        await _send(ws, text=" ", context_id="c5")
        err = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert err["error"] == "max_active_conversations" and err["contextId"] == "c5"
        await _send(ws, text="Hi there.", context_id="c0", voice_settings={"speed": 1.2})
        err = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert err["error"] == "invalid_voice_settings" and err["contextId"] == "c0"
        await _send(ws, close_socket=True)
        await asyncio.wait_for(ws.wait_closed(), 10)
        assert ws.close_code == 1000


async def test_text_with_flush_then_close_context_is_livekits_interruption(make_gateway: GatewayFactory) -> None:
    """LiveKit's interrupted stream: its last message is sentence text with ``flush``, then
    ``close_context`` (its normal end adds ``{"text": "", "flush": true}`` before closing). The
    context is barged in at once, so the next context's first audio does not wait for the rest
    of the interrupted one (issue 35 item 5)."""
    engine = FakeSpeechEngine(speed=1.0)  # real time: the long turn is still being generated
    async with make_gateway(engine) as server, \
            connect(_url(server), additional_headers={"xi-api-key": "xi-test"}) as ws:
        got: dict[str, bytearray] = {}
        await _send(ws, text=" ", voice_settings={}, context_id="a")
        await _send(ws, text="This answer is long and goes on and on. " * 8, context_id="a", flush=True)
        while not got.get("a"):
            msg = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
            if msg.get("audio"):
                got.setdefault(msg["contextId"], bytearray()).extend(base64.b64decode(msg["audio"]))
        await _send(ws, context_id="a", close_context=True)  # the user barged in
        t0 = asyncio.get_running_loop().time()
        await _send(ws, text=" ", voice_settings={}, context_id="b")
        await _send(ws, text="The next answer. ", context_id="b", flush=True)
        await _send(ws, text="", context_id="b", flush=True)
        await _send(ws, context_id="b", close_context=True)
        first_b: float | None = None
        while True:
            msg = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
            if msg.get("audio") and msg["contextId"] == "b" and first_b is None:
                first_b = asyncio.get_running_loop().time() - t0
            if msg.get("isFinal") and msg.get("contextId") == "b":
                break
        assert first_b is not None and first_b < 1.0, first_b  # not after the rest of "a" (~20 s)


async def test_keep_alives_hold_the_socket_past_inactivity_timeout(fake_engine: FakeSpeechEngine,
                                                                   make_gateway: GatewayFactory) -> None:
    url = f"ws://127.0.0.1:{{}}/v1/text-to-speech/{RACHEL}/multi-stream-input?output_format=pcm_16000&inactivity_timeout=1"
    async with make_gateway(fake_engine) as server, connect(url.format(server.port)) as ws:
        await _send(ws, text=" ", context_id="a")
        for _ in range(6):  # 2.4 s of keep-alives, as Pipecat sends them between turns
            await asyncio.sleep(0.4)
            await _send(ws, text="", context_id="a")
        await _send(ws, text="Still here. ", context_id="a")
        await _send(ws, context_id="a", flush=True)
        await _send(ws, context_id="a", close_context=True)
        got: dict[str, bytearray] = {}
        seen = await _until_final(ws, "a", got, within_s=10)
        assert got["a"]
        timed = [m for m in seen if m.get("alignment")]
        assert timed and all(m["contextId"] == "a" for m in timed)
        assert "".join(c for m in timed for c in m["alignment"]["chars"]) == "Still here."
        # then silence: the socket closes after inactivity_timeout
        msg = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert msg["error"] == "input_timeout_exceeded"
        await asyncio.wait_for(ws.wait_closed(), 5)
        assert ws.close_code == 1008
