"""Voice names of the ecosystem dialects -> ChatTTS speakers (pure data + lookup).

ChatTTS has no named voices: a speaker is an int seed (the engine samples a speaker embedding from
the checkpoint's speaker statistics with that seed; same seed, same voice) or an encoded
embedding. Each dialect's well-known voice names map to fixed seeds here, so a client that names
``alloy`` or ``aura-asteria-en`` always gets the same ChatTTS voice. The timbre is whatever that
seed samples; it does not imitate the vendor's voice of that name.

Besides the tables, every dialect accepts:

* a decimal seed, optionally prefixed ``seed-``/``seed_``/``seed:`` (``"2222"``, ``"seed-7869"``):
  that ChatTTS seed, 0..2**31-1;
* ``default``: the server's voice (``engine.default_speaker``).

Anything else is an unknown voice (each dialect reports it in its own error shape).
``docs/dialects/*.md`` show these tables; a test keeps them in sync (``markdown_table``).
"""

from __future__ import annotations

import re
from typing import Final

from gateway.dialects.base import FieldError, parse_int

#: OpenAI ``voice`` (``audio.speech``) -> seed.
OPENAI: Final[dict[str, int]] = {
    "alloy": 2222,
    "ash": 1111,
    "ballad": 1397,
    "coral": 1528,
    "echo": 2328,
    "fable": 3333,
    "nova": 4099,
    "onyx": 5099,
    "sage": 6615,
    "shimmer": 6653,
    "verse": 7869,
    "marin": 8888,
    "cedar": 9999,
}

#: ElevenLabs premade voices: voice_id -> (name, seed). The name works as a voice id too.
ELEVENLABS: Final[dict[str, tuple[str, int]]] = {
    "21m00Tcm4TlvDq8ikWAM": ("Rachel", 2222),
    "AZnzlk1XvdvUeBnXmlld": ("Domi", 1528),
    "EXAVITQu4vr4xnSDxMaL": ("Sarah", 4099),
    "ErXwobaYiN019PkySvjV": ("Antoni", 1111),
    "MF3mGyEYCl7XYWbV9V6O": ("Elli", 6653),
    "TxGEqnHWrfWFTfGW9XjX": ("Josh", 5099),
    "VR6AewLTigWG4xSOukaG": ("Arnold", 2328),
    "pNInz6obpgDQGcFmaJgB": ("Adam", 7869),
    "yoZ06aMxZJJ28mfd3POQ": ("Sam", 3333),
    "JBFqnCBsd6RMkjVDRZzb": ("George", 6615),
    "XB0fDUnXU5powFXDhCwa": ("Charlotte", 1397),
    "pFZP5JQG7iQjIQuC4Bku": ("Lily", 8888),
}

_AURA1: Final = ("asteria", "luna", "stella", "athena", "hera", "orion", "arcas", "perseus", "angus",
                 "orpheus", "helios", "zeus")
_AURA1_SEEDS: Final = (2222, 4099, 6653, 1528, 1397, 5099, 1111, 2328, 3333, 7869, 6615, 9999)
_AURA2: Final = ("thalia", "andromeda", "helena", "apollo", "arcas", "aries", "amalthea", "asteria",
                 "athena", "atlas", "aurora", "callista", "cora", "cordelia", "delia", "draco",
                 "electra", "harmonia", "hera", "hermes", "hyperion", "iris", "janus", "juno",
                 "jupiter", "luna", "mars", "minerva", "neptune", "odysseus", "ophelia", "orion",
                 "orpheus", "pandora", "phoebe", "pluto", "saturn", "selene", "theia", "vesta",
                 "zeus")

#: Deepgram ``model`` (``/v1/speak``) -> seed: Aura-1 and the English Aura-2 voices.
DEEPGRAM: Final[dict[str, int]] = {
    **{f"aura-{n}-en": s for n, s in zip(_AURA1, _AURA1_SEEDS, strict=True)},
    **{f"aura-2-{n}-en": 3000 + i for i, n in enumerate(_AURA2)},
}
DEEPGRAM_DEFAULT_MODEL: Final = "aura-asteria-en"

_SEED = re.compile(r"(?:seed[-_:]?)?([0-9]{1,10})", re.IGNORECASE)  # ASCII digits only (fullmatch)
_MAX_SEED: Final = 2**31 - 1

Speaker = int | None
"""What goes into ``session.start``'s ``voice``: a seed, or None for the server's voice."""


class UnknownVoice(ValueError):
    """The name is in no table and is not a seed."""


def _generic(name: str) -> Speaker:
    key = name.strip()
    if key.lower() == "default":
        return None
    m = _SEED.fullmatch(key)
    if m is None:
        raise UnknownVoice(name)
    try:
        return parse_int(m.group(1), "seed", 0, _MAX_SEED)
    except FieldError:
        raise UnknownVoice(name) from None


def openai_voice(name: str) -> Speaker:
    seed = OPENAI.get(name.strip().lower())
    return seed if seed is not None else _generic(name)


def elevenlabs_voice(voice_id: str) -> Speaker:
    if voice_id in ELEVENLABS:
        return ELEVENLABS[voice_id][1]
    for vname, seed in ELEVENLABS.values():
        if vname.lower() == voice_id.strip().lower():
            return seed
    return _generic(voice_id)


def deepgram_voice(model: str) -> Speaker:
    seed = DEEPGRAM.get(model.strip().lower())
    return seed if seed is not None else _generic(model)


def markdown_table(dialect: str) -> str:
    """The voice table of ``dialect`` (``openai``, ``elevenlabs``, ``deepgram``) as Markdown."""
    if dialect == "openai":
        rows = ["| voice | ChatTTS seed |", "|---|---|"]
        rows += [f"| `{k}` | {v} |" for k, v in OPENAI.items()]
    elif dialect == "elevenlabs":
        rows = ["| voice_id | name | ChatTTS seed |", "|---|---|---|"]
        rows += [f"| `{k}` | {n} | {s} |" for k, (n, s) in ELEVENLABS.items()]
    elif dialect == "deepgram":
        rows = ["| model | ChatTTS seed |", "|---|---|"]
        rows += [f"| `{k}` | {v} |" for k, v in DEEPGRAM.items()]
    else:
        raise ValueError(dialect)
    return "\n".join(rows)
