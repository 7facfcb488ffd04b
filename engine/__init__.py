from engine._compat import ensure_torch_companions

ensure_torch_companions()
