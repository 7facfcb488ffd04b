"""Speech engines behind one interface (``engine.api``).

Importing this package loads nothing heavy: the pure modules (``engine.api``,
``engine.decoder.window``, ...) stay torch-free at import. Code that is about to import
transformers, vocos or chattts calls ``engine._compat.ensure_torch_companions()`` first (the
vLLM engine does it in ``engine.vllm._env.prepare``).
"""
