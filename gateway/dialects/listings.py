"""``GET /v1/...`` of the dialects: model and voice listings, and 404s, as JSON in the shape of the
client that asks (pure: request path and headers in, status and JSON body out).

Three vendors share the ``/v1/`` prefix and one of them (``/v1/models``) even shares a path, so
the caller is told apart by how it authenticates, as their SDKs always do: ``xi-api-key`` is
ElevenLabs, ``Authorization: Token`` is Deepgram, anything else (``Bearer``, nothing) is OpenAI.

=========================  ===============================================================
path                       answer
=========================  ===============================================================
``/v1/models``             OpenAI ``{"object": "list", "data": [model...]}``; ElevenLabs a
                           JSON array of models (``model_id`` ...); Deepgram ``{"tts": [...]}``
``/v1/voices``             ElevenLabs ``{"voices": [...]}`` (its premade names, seeds)
``/v1/voices/{voice_id}``  ElevenLabs one voice, or 404 in its shape
``/v2/voices``             ElevenLabs v2 (``voices.search()``): ``{"voices": [...], "has_more":
                           false, "total_count": N, "next_page_token": null}``; ``?search=``
                           filters by name (case-insensitive substring)
``/v1/models/{model_id}``  OpenAI one model object (``models.retrieve``), or 404 in its shape
``/v1/audio/voices``       OpenAI-compatible ``{"voices": [names], "data": [...]}``
anything else              404 (under ``/v1/`` or ``/v2/``) in the caller's vendor's error shape
=========================  ===============================================================
"""

from __future__ import annotations

from typing import Any, Final, Literal
from urllib.parse import parse_qs

from gateway.dialects import voices

OPENAI_MODELS: Final = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
ELEVENLABS_MODELS: Final = ("eleven_multilingual_v2", "eleven_turbo_v2_5", "eleven_flash_v2_5", "eleven_monolingual_v1")


def vendor(headers: Any) -> Literal["openai", "elevenlabs", "deepgram"]:
    """``openai`` | ``elevenlabs`` | ``deepgram``: whose client this is, from its auth header."""
    if headers.get("xi-api-key") is not None:
        return "elevenlabs"
    if headers.get("Authorization", "").partition(" ")[0].lower() == "token":
        return "deepgram"
    return "openai"


def not_found(who: str, path: str, request_id: str) -> tuple[int, Any]:
    path = path[:256]
    if who == "elevenlabs":
        return 404, {"detail": {"status": "not_found", "message": f"{path} not found"}}
    if who == "deepgram":
        return 404, {"err_code": "NOT_FOUND", "err_msg": f"{path} not found", "request_id": request_id}
    return 404, {"error": {"message": f"Invalid URL (GET {path})", "type": "invalid_request_error",
                           "param": None, "code": "unknown_url"}}


def _eleven_voice(voice_id: str, name: str, seed: int) -> dict[str, Any]:
    return {"voice_id": voice_id, "name": name, "category": "premade", "labels": {},
            "description": f"ChatTTS speaker seed {seed}", "preview_url": None, "settings": None,
            "available_for_tiers": [], "high_quality_base_model_ids": list(ELEVENLABS_MODELS)}


def _openai_model(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "voicegw"}


def answer(path: str, headers: Any, request_id: str, query: str = "") -> tuple[int, Any]:
    """Status and JSON body for ``GET path`` under ``/v1/`` or ``/v2/``."""
    who = vendor(headers)
    if path == "/v2/voices":
        search = (parse_qs(query).get("search") or [""])[0].strip().lower()
        found = [_eleven_voice(vid, name, seed) for vid, (name, seed) in voices.ELEVENLABS.items()
                 if search in name.lower()]
        return 200, {"voices": found, "has_more": False, "total_count": len(found), "next_page_token": None}
    if path.startswith("/v1/models/") and path.count("/") == 3 and who == "openai":
        model_id = path.rsplit("/", 1)[1]
        if model_id in OPENAI_MODELS:
            return 200, _openai_model(model_id)
        return 404, {"error": {"message": f"The model '{model_id[:256]}' does not exist",
                               "type": "invalid_request_error", "param": None, "code": "model_not_found"}}
    if path == "/v1/models":
        if who == "elevenlabs":
            return 200, [{"model_id": m, "name": m, "can_do_text_to_speech": True, "can_be_finetuned": False,
                          "can_do_voice_conversion": False, "can_use_style": False,
                          "can_use_speaker_boost": False, "serves_pro_voices": False,
                          "token_cost_factor": 1.0, "description": "served by voicegw (ChatTTS)",
                          "requires_alpha_access": False, "max_characters_request_free_user": 2500,
                          "max_characters_request_subscribed_user": 5000, "maximum_text_length_per_request": 5000,
                          "languages": [{"language_id": "en", "name": "English"},
                                        {"language_id": "zh", "name": "Chinese"}]} for m in ELEVENLABS_MODELS]
        if who == "deepgram":
            return 200, {"stt": [], "tts": [{"name": name, "canonical_name": name, "architecture": "aura",
                                             "languages": ["en"], "version": "voicegw", "uuid": f"voicegw-{seed}",
                                             "metadata": {"accent": "", "color": "", "image": "", "sample": "",
                                                          "tags": []}}
                                            for name, seed in voices.DEEPGRAM.items()]}
        return 200, {"object": "list", "data": [_openai_model(m) for m in OPENAI_MODELS]}
    if path == "/v1/voices":
        return 200, {"voices": [_eleven_voice(vid, name, seed) for vid, (name, seed) in voices.ELEVENLABS.items()],
                     "has_more": False, "total_count": len(voices.ELEVENLABS), "next_page_token": None}
    if path.startswith("/v1/voices/") and path.count("/") == 3:
        vid = path.rsplit("/", 1)[1]
        if vid in voices.ELEVENLABS:
            name, seed = voices.ELEVENLABS[vid]
            return 200, _eleven_voice(vid, name, seed)
        return 404, {"detail": {"status": "voice_not_found", "message": f"A voice with voice_id {vid} was not found."}}
    if path == "/v1/audio/voices":
        names = list(voices.OPENAI)
        return 200, {"voices": names, "data": [{"id": n, "object": "voice", "name": n} for n in names]}
    return not_found(who, path, request_id)
