"""The pure cores stay pure at import: no torch, asyncio, sockets or websockets.

Each module is imported in a fresh interpreter (``-X importtime`` is not needed: the test looks
at ``sys.modules`` afterwards), so one module's imports cannot hide another's. The torch/vLLM
compatibility boot (``engine._compat``) runs only where an engine starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PURE = [
    "gateway.session",
    "gateway.protocol",
    "gateway.segmenter",
    "gateway.flow",
    "gateway.scheduling",
    "engine.api",
    "engine.config",
    "gateway.config",
    "engine.decoder.window",
]
FORBIDDEN = ["torch", "asyncio", "websockets", "socket", "vllm", "transformers"]
#: A user's interpreter: not the vLLM child boot an engine of this test process may be starting
#: with at this moment (``engine/vllm/_env.py``).
ENV = {k: v for k, v in os.environ.items() if k != "VOICEGW_VLLM_BOOT"}


@pytest.mark.parametrize("module", PURE)
def test_pure_core_imports_nothing_heavy(module: str) -> None:
    code = (
        f"import sys, json; import {module}; "
        f"print(json.dumps([m for m in {FORBIDDEN!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing {module} loads {loaded}"


def test_python_client_imports_without_torch() -> None:
    code = "import sys; import clients.python.client, loadtest.client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


# ---- layering: who may import whom (read from the source with ``ast``, nothing is imported) ----

#: The tree the layering rules read (``VOICEGW_LAYERING_ROOT`` points them at another checkout).
LAYER_ROOT = Path(os.environ.get("VOICEGW_LAYERING_ROOT") or ROOT)
PACKAGES = ("engine", "gateway", "voicegw", "clients", "loadtest", "bench")
#: What ``gateway`` may import of ``engine``: its interface (the protocols and plain data types,
#: the engine's settings, the audio format helpers the dialects resample with).
GATEWAY_ENGINE_ALLOWED = {"engine.api", "engine.config", "engine.audio_format"}
#: What ``clients`` may import of ``gateway``: the wire format alone (pure modules: message schemas,
#: mu-law), the one definition both ends share. Everything else of the server is out of bounds.
CLIENTS_GATEWAY_ALLOWED = {"gateway.protocol", "gateway.audio"}
#: Packages a package must never import (at any depth, inside functions and ``TYPE_CHECKING`` too).
FORBIDDEN_UP = {
    "engine": {"voicegw", "gateway", "clients", "loadtest", "bench"},
    "gateway": {"voicegw", "clients", "loadtest", "bench"},
    "clients": {"engine", "gateway", "voicegw", "loadtest", "bench"},
}


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its source (function bodies included);
    ``from a.b import c`` counts as ``a.b.c`` when that is a module, else as ``a.b``."""
    import ast

    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:  # a name inside a module: the module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph(root: Path) -> dict[str, set[str]]:
    mods = _modules(root)
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_layers_import_only_downward() -> None:
    """engine imports nothing above it; gateway nothing above it and of engine only the
    interface (``GATEWAY_ENGINE_ALLOWED``); clients nothing of the server but the wire format
    (``CLIENTS_GATEWAY_ALLOWED``)."""
    bad = []
    for mod, deps in sorted(_graph(LAYER_ROOT).items()):
        pkg = mod.split(".")[0]
        for dep in sorted(deps):
            top = dep.split(".")[0]
            if pkg == "clients" and dep in CLIENTS_GATEWAY_ALLOWED:
                continue
            if top in FORBIDDEN_UP.get(pkg, ()):
                bad.append(f"{mod} -> {dep}")
            elif pkg == "gateway" and top == "engine" and dep not in GATEWAY_ENGINE_ALLOWED:
                bad.append(f"{mod} -> {dep} (not the engine's interface: {sorted(GATEWAY_ENGINE_ALLOWED)})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_cycles() -> None:
    """No two modules of the project import each other, directly or around a loop; every import
    counts, those inside functions and under ``TYPE_CHECKING`` too (a deferred import is still a
    dependency)."""
    cycles = _cycles(_graph(LAYER_ROOT))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_client_core_is_sans_io() -> None:
    """The client's decisions (``clients.python.core``: overload retry, reconnect, resume planning,
    playout) import no event loop, socket, WebSocket library or torch: the Python client is an I/O
    shell over them, and the shared scenario table runs them without a network."""
    code = (
        "import sys, json; import clients.python.core; "
        f"print(json.dumps([m for m in {FORBIDDEN!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing clients.python.core loads {loaded}"
