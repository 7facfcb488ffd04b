"""The browser client's protocol constants (clients/web/protocol.js) equal gateway/protocol.py's.

protocol.js carries ``wire_constants()`` as a JSON object between two marker comments; this test
parses it and compares. After a protocol change regenerate it with

    python -m tests.browser.test_protocol_constants --write
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from gateway import protocol as P

WEB = Path(__file__).resolve().parents[2] / "clients" / "web"
PROTOCOL_JS = WEB / "protocol.js"
BEGIN = "/* BEGIN GENERATED: gateway.protocol.wire_constants() */"
END = "/* END GENERATED */"

_TEMPLATE = """\
// voicegw wire protocol constants for the browser client.
// Generated from gateway/protocol.py (wire_constants()); the gateway also serves them at
// /protocol.json. tests/browser/test_protocol_constants.py checks they match; regenerate with
//   python -m tests.browser.test_protocol_constants --write

export const PROTOCOL = Object.freeze(
{begin}
{body}
{end}
);
"""


def render() -> str:
    body = json.dumps(P.wire_constants(), indent=2, ensure_ascii=False)
    return _TEMPLATE.format(begin=BEGIN, body=body, end=END)


def parse_js_constants(text: str) -> Any:
    m = re.search(re.escape(BEGIN) + r"(.*?)" + re.escape(END), text, re.S)
    assert m, f"{PROTOCOL_JS}: generated block markers not found"
    return json.loads(m.group(1))


def test_protocol_js_matches_gateway() -> None:
    js = parse_js_constants(PROTOCOL_JS.read_text())
    assert js == P.wire_constants(), (
        "clients/web/protocol.js is out of date: run python -m tests.browser.test_protocol_constants --write"
    )


def test_client_code_uses_only_known_names() -> None:
    """Every ``T.X`` / ``S.X`` / ``E.X`` / ``C.X`` name used in voicegw.js exists in the protocol."""
    consts = P.wire_constants()
    groups = {"T": "client_types", "S": "server_types", "E": "error_codes", "C": "close_codes"}
    src = (WEB / "voicegw.js").read_text()
    used = re.findall(r"\b([TSEC])\.([A-Z_]+)\b", src)
    assert used, "voicegw.js should refer to protocol names through T./S./E./C."
    for g, name in used:
        assert name in consts[groups[g]], f"voicegw.js uses {g}.{name}, unknown to gateway/protocol.py"


def test_worklet_header_and_formats() -> None:
    src = (WEB / "player-worklet.js").read_text()

    def const(name: str) -> int:
        m = re.search(rf"const {name} = (\d+);", src)
        assert m, name
        return int(m.group(1))

    assert const("HEADER_BYTES") == P.AUDIO_HEADER_BYTES
    assert const("FORMAT_PCM16") == P.AudioFormat.PCM16.wire_code
    assert const("FORMAT_MULAW") == P.AudioFormat.MULAW.wire_code
    # the worklet reads the format code at byte 1 and samples after the header: the header layout
    assert P.AUDIO_HEADER.format == "<BBHIII"


if __name__ == "__main__":
    if "--write" in sys.argv:
        PROTOCOL_JS.write_text(render())
        print(f"wrote {PROTOCOL_JS}")
    else:
        print(render())
