"""The released third-party clients against the gateway, by base URL: Pipecat's five TTS services,
LiveKit's openai / elevenlabs / deepgram TTS (``synthesize()`` and ``stream()``), and the openai,
elevenlabs and deepgram SDKs (``tests/frameworks/requirements.txt`` pins them).

They run in their own virtual environment (``.venv-frameworks``, made by ``run.sh test``; LiveKit's
pins clash with the gateway's), driven by ``tests/frameworks/drive.py`` against one gateway on
127.0.0.1 with the session's engine (the real vLLM engine on the tiny checkpoint in CI), with TLS
in front for the ElevenLabs SDK's WebSocket call (it speaks wss:// only). Every call must hand its
user decoded audio at the rate asked for, and the clients that turn ElevenLabs alignment into word
timestamps must get one per word.

``docs/dialects/README.md``'s table (client | version | call | works) is written from this run:
the test fails when the table says otherwise, and ``VOICEGW_WRITE_DOCS=1`` rewrites it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from loadtest.fakes import CountingEngine
from tests.dialects.tls import tls_front
from tests.gateway.conftest import GatewayFactory, wait_until

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("drive.py")
DOC = ROOT / "docs" / "dialects" / "README.md"
BEGIN, END = "<!-- frameworks-table:begin -->", "<!-- frameworks-table:end -->"
#: Words in drive.TEXT: the clients that build word timestamps from alignment report this many.
TEXT_WORDS = 10
#: The rate each call asks for (or its client's default).
RATES = {
    "pipecat_elevenlabs_ws": 24_000, "pipecat_elevenlabs_http": 24_000, "pipecat_deepgram_ws": 24_000,
    "pipecat_deepgram_http": 24_000, "pipecat_openai": 24_000, "livekit_openai_synthesize": 24_000,
    "livekit_elevenlabs_synthesize": 22_050, "livekit_elevenlabs_stream": 22_050,
    "livekit_elevenlabs_interrupted_then_next": 22_050,
    "livekit_deepgram_synthesize": 24_000, "livekit_deepgram_stream": 24_000, "openai_speech": 24_000,
    "openai_models_retrieve": 24_000, "elevenlabs_convert": 44_100, "elevenlabs_stream": 16_000,
    "elevenlabs_with_timestamps": 24_000, "elevenlabs_voices_search": 16_000, "elevenlabs_realtime": 24_000,
    "deepgram_rest": 24_000, "deepgram_rest_mulaw": 8_000, "deepgram_ws": 24_000,
}
#: Calls whose client turns the gateway's character alignment into word timestamps.
ALIGNED = {"pipecat_elevenlabs_ws", "pipecat_elevenlabs_http", "livekit_elevenlabs_stream",
           "elevenlabs_with_timestamps"}


def frameworks_python() -> Path | None:
    p = Path(os.environ.get("VOICEGW_FRAMEWORKS_PYTHON") or ROOT / ".venv-frameworks" / "bin" / "python")
    return p if p.exists() else None


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| client | version | call | works |", "|---|---|---|---|"]
    for r in rows:
        works = "yes" if r["ok"] else f"no: {r['error']}"
        lines.append(f"| {r['client']} | {r['version']} | {r['call']} | {works} |")
    return "\n".join(lines)


@pytest.mark.timeout(900)
async def test_released_clients_by_base_url(counting_engine: CountingEngine, make_gateway: GatewayFactory,
                                            tls_cert: Any) -> None:
    py = frameworks_python()
    if py is None:
        if os.environ.get("CI") or os.environ.get("VOICEGW_REQUIRE_FRAMEWORKS"):
            pytest.fail("no .venv-frameworks: run.sh test makes it (tests/frameworks/requirements.txt)")
        pytest.skip("no .venv-frameworks (run.sh test makes it from tests/frameworks/requirements.txt)")
    async with make_gateway(counting_engine) as server, tls_front(server.port, *tls_cert) as tls_port:
        env = {**os.environ, "SSL_CERT_FILE": str(tls_cert[0]), "PYTHONPATH": ""}
        proc = await asyncio.create_subprocess_exec(
            str(py), str(DRIVER), "--http", server.url, "--https", f"https://127.0.0.1:{tls_port}",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env, cwd=str(DRIVER.parent))
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 800)
        except TimeoutError:
            proc.kill()
            raise
        assert await wait_until(lambda: counting_engine.health().running_requests == 0, 30)
    rows = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    log = err.decode(errors="replace")[-6000:]
    assert proc.returncode == 0, log
    assert [r["case"] for r in rows] == list(RATES), log
    for r in rows:
        sys.stdout.write(f"{r['client']} {r['version']} {r['call']}: ok={r['ok']} {r['rate_hz']} Hz "
                         f"{r['samples']} samples words={r['words']} first audio {r.get('first_audio_s')} s {r['wall_s']} s "
                         f"{r['error'] or ''}\n")
    failed = [f"{r['call']}: {r['error']}" for r in rows if not r["ok"]]
    assert not failed, "\n".join(failed) + "\n" + log
    for r in rows:
        assert r["rate_hz"] == RATES[r["case"]], r
        assert r["samples"] >= r["rate_hz"] // 10, r  # at least 100 ms
        assert r["peak"] > 0.0, r  # not silence
        if r["case"] in ALIGNED:
            assert r["words"] == TEXT_WORDS, r
    # the interrupted answer's rest is not spoken first (it was 1,962 ms): the next answer's first
    # audio comes as soon as a fresh stream's (both gated by LiveKit's MP3 demuxer, docs/dialects/elevenlabs.md)
    barge = next(r for r in rows if r["case"] == "livekit_elevenlabs_interrupted_then_next")
    fresh = next(r for r in rows if r["case"] == "livekit_elevenlabs_stream")
    assert barge["first_audio_s"] is not None and fresh["first_audio_s"] is not None, (barge, fresh)
    assert barge["first_audio_s"] < fresh["first_audio_s"] + 0.15, (barge, fresh)

    want = table(rows)
    doc = DOC.read_text()
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    if os.environ.get("VOICEGW_WRITE_DOCS"):
        DOC.write_text(f"{head}{BEGIN}\n{want}\n{END}{tail}")
    else:
        assert f"{BEGIN}\n{want}\n{END}" in doc, "docs/dialects/README.md's table differs from this run " \
            "(VOICEGW_WRITE_DOCS=1 rewrites it):\n" + want
