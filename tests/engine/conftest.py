"""Engine-test fixtures live in tests/conftest.py: ONE vLLM code engine (``vllm_engine``) and
one upstream reference engine (``reference_engine``) per test session, on the tiny checkpoint
with scaled attention (``parity_model_dir``), shared with the gateway/browser/dialect tests."""

from tests.conftest import ATTENTION_GAIN, BLOCK_TOKENS, KV_BLOCKS, MAX_MODEL_LEN  # noqa: F401
