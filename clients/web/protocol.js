// voicegw wire protocol constants for the browser client.
// Generated from gateway/protocol.py (wire_constants()); the gateway also serves them at
// /protocol.json. tests/browser/test_protocol_constants.py checks they match; regenerate with
//   python -m tests.browser.test_protocol_constants --write

export const PROTOCOL = Object.freeze(
/* BEGIN GENERATED: gateway.protocol.wire_constants() */
{
  "version": 1,
  "subprotocol": "voicegw.v1",
  "token_subprotocol_prefix": "voicegw.token.",
  "ws_path": "/ws",
  "client_types": {
    "SESSION_START": "session.start",
    "TEXT_DELTA": "text.delta",
    "TEXT_FLUSH": "text.flush",
    "TEXT_END": "text.end",
    "CANCEL": "cancel",
    "PLAYBACK": "playback",
    "PING": "ping"
  },
  "server_types": {
    "SESSION_STARTED": "session.started",
    "SEGMENT_STARTED": "segment.started",
    "SEGMENT_DONE": "segment.done",
    "SEGMENT_CODES": "segment.codes",
    "UTTERANCE_DONE": "utterance.done",
    "CANCELLED": "cancelled",
    "ERROR": "error",
    "PONG": "pong"
  },
  "formats": {
    "pcm16": 0,
    "mulaw": 1
  },
  "sample_rates_hz": [
    8000,
    16000,
    24000,
    48000
  ],
  "error_codes": {
    "INVALID_JSON": "invalid_json",
    "INVALID_MESSAGE": "invalid_message",
    "UNKNOWN_TYPE": "unknown_type",
    "INVALID_FIELD": "invalid_field",
    "BINARY_NOT_ALLOWED": "binary_not_allowed",
    "SESSION_NOT_STARTED": "session_not_started",
    "SESSION_ALREADY_STARTED": "session_already_started",
    "TEXT_TOO_LONG": "text_too_long",
    "RATE_LIMITED": "rate_limited",
    "QUEUE_FULL": "queue_full",
    "SHUTTING_DOWN": "shutting_down",
    "ENGINE_OVERLOADED": "engine_overloaded",
    "ENGINE_ERROR": "engine_error",
    "ENGINE_UNAVAILABLE": "engine_unavailable",
    "INTERNAL_ERROR": "internal_error"
  },
  "close_codes": {
    "NORMAL": 1000,
    "PROTOCOL_ERROR": 1002,
    "INVALID_DATA": 1007,
    "POLICY_VIOLATION": 1008,
    "MESSAGE_TOO_BIG": 1009,
    "INTERNAL_ERROR": 1011,
    "SERVICE_RESTART": 1012,
    "TRY_AGAIN_LATER": 1013
  },
  "audio_header": {
    "bytes": 16,
    "version": 1,
    "layout": "<BBHIII: version u8, format u8, segment u16, utterance_id u32, seq u32, sample_offset u32 (little-endian)"
  },
  "codes": {
    "frame_bytes": 8,
    "samples_per_frame": 512,
    "native_rate_hz": 24000
  }
}
/* END GENERATED */
);
