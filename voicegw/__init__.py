"""voicegw: a real-time voice gateway (ChatTTS on vLLM behind a WebSocket)."""

__version__ = "0.1.0"
