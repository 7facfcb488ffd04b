"""The one configuration: the sections of ``engine.config`` and ``gateway.config`` composed into
``Config``, read once from TOML, environment and CLI.

Precedence (later wins): defaults < TOML file (``--config`` / ``VOICEGW_CONFIG``)
< environment (``VOICEGW_<SECTION>_<FIELD>``, e.g. ``VOICEGW_GATEWAY_PORT=9000``)
< CLI flags (``--gateway.port 9000`` or the short aliases the CLI declares).

Every field has a docstring (the attribute docstring right below it); ``describe()`` turns
them into the configuration reference (``docs/configuration.md``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import ConfigError, EngineConfig
from gateway.config import (
    GatewayConfig,
    GatewaySettings,
    LimitsConfig,
    SchedulerConfig,
    SegmenterConfig,
    SessionConfig,
)

__all__ = [
    "GPU_DEFAULTS", "Config", "ConfigError", "EngineConfig", "GatewayConfig", "LimitsConfig", "SchedulerConfig",
    "SegmenterConfig", "SessionConfig", "cli_fields", "describe", "field_docs", "load_config", "on_cuda",
]


@dataclass(frozen=True)
class Config(GatewaySettings):
    """Everything, read once at start: the gateway's sections and the engine's
    (``gateway.config.GatewaySettings``), and which keys were set."""

    explicit: frozenset[str] = frozenset()
    """``section.field`` keys given in TOML, environment or CLI (``load_config`` fills it): the
    ``GPU_DEFAULTS`` never replace those (``on_cuda``)."""


_SECTIONS: dict[str, type] = {
    "gateway": GatewayConfig,
    "engine": EngineConfig,
    "scheduler": SchedulerConfig,
    "limits": LimitsConfig,
    "session": SessionConfig,
    "session.segmenter": SegmenterConfig,
}
"""Every section; a dotted one is a table inside its parent (``[session.segmenter]``)."""

GPU_DEFAULTS: dict[str, Any] = {
    "engine.enforce_eager": False,
    "engine.max_num_seqs": 512,
    "engine.max_num_batched_tokens": 8192,
    "engine.decoder_max_batch": 256,
    "engine.decoder_dtype": "float16",
    "engine.decoder_compile": True,
    "gateway.engine_cores": 2,
    "gateway.cuda_mps": True,
}
"""The defaults that differ when ``voicegw serve`` runs ChatTTS on vLLM on a CUDA GPU (the field
defaults are the CPU ones): compiled with CUDA graphs, hundreds of sequences per batch, the decoder's
largest bucket 256 rows, its forward compiled and in float16, two engine cores sharing the GPU
under CUDA MPS (bench/RESULTS.md says which of these each GPU figure was measured with).
``gateway.engine_cores`` stays 1 where the group cannot be split in two: ``gateway.port`` 0 (one
process) or an explicit odd ``gateway.processes``; the decoder's dtype and compile stay the CPU ones
when ``engine.decoder_device`` puts the decoder on the CPU."""

_DECODER_GPU_KEYS = frozenset({"engine.decoder_dtype", "engine.decoder_compile"})


def on_cuda(cfg: Config) -> Config:
    """``cfg`` with ``GPU_DEFAULTS`` for every key not given explicitly (``Config.explicit``), but
    ``gateway.engine_cores`` only where ``gateway.processes`` can be a multiple of it, and the
    decoder's GPU keys only where the decoder runs on the GPU."""
    changed: dict[str, dict[str, Any]] = {}
    for key, value in GPU_DEFAULTS.items():
        if key == "gateway.engine_cores" and (
                cfg.gateway.port == 0 or ("gateway.processes" in cfg.explicit and cfg.gateway.processes % value)):
            continue
        if key in _DECODER_GPU_KEYS and cfg.engine.decoder_device == "cpu":
            continue
        if key not in cfg.explicit:
            section, _, name = key.rpartition(".")
            changed.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{sec: dataclasses.replace(getattr(cfg, sec), **kw) for sec, kw in changed.items()})

def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal right after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _coerce(section: str, name: str, tp: Any, value: Any) -> Any:
    key = f"{section}.{name}"
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if tp is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if tp is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if tp is str:
            if not isinstance(value, (str, int)):
                raise ValueError
            return str(value)
        if origin is tuple:
            if isinstance(value, str):
                items = [v.strip() for v in value.split(",") if v.strip()]
            elif isinstance(value, (list, tuple)):
                items = [str(v) for v in value]
            else:
                raise ValueError
            return tuple(items)
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is tuple:
        return "a list of strings (comma-separated in env/CLI)"
    return {bool: "a boolean (true/false)", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


REMOVED: dict[str, str] = {
    "engine.synthetic_ttft_ms": "removed with the synthetic backend",
    "engine.synthetic_steps_per_s": "removed with the synthetic backend",
    "engine.synthetic_ms_per_char": "removed with the synthetic backend",
}
"""Settings that existed once: a user who still sets one is told so, not just 'unknown'."""


def load_config(
    toml_path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the config: defaults < TOML < env ``VOICEGW_SECTION_FIELD`` < overrides.

    ``overrides`` maps ``"section.field"`` to a value (the CLI passes parsed flags here).
    Raises ``ConfigError`` with a message naming the key.
    """
    env = os.environ if env is None else env
    raw: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    toml_path = toml_path or env.get("VOICEGW_CONFIG") or None
    if toml_path:
        path = Path(toml_path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path}: not found") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: invalid TOML ({exc})") from None
        top = ", ".join(k for k in _SECTIONS if "." not in k)
        for section, values in data.items():
            if section not in _SECTIONS or "." in section:
                raise ConfigError(f"config file {path}: unknown section [{section}]; known: {top}")
            if not isinstance(values, dict):
                raise ConfigError(f"config file {path}: [{section}] must be a table")
            for name, value in values.items():
                if f"{section}.{name}" in _SECTIONS:
                    if not isinstance(value, dict):
                        raise ConfigError(f"config file {path}: [{section}.{name}] must be a table")
                    raw[f"{section}.{name}"].update(value)
                else:
                    raw[section][name] = value
    # longest prefix first: VOICEGW_SESSION_SEGMENTER_* is the segmenter's, not session's
    claimed: set[str] = set()
    for section in sorted(_SECTIONS, key=len, reverse=True):
        prefix = f"VOICEGW_{section.upper().replace('.', '_')}_"
        for k, v in env.items():
            if k.startswith(prefix) and k not in claimed:
                claimed.add(k)
                raw[section][k[len(prefix) :].lower()] = v
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, _, name = dotted.rpartition(".")
        if section not in _SECTIONS:
            raise ConfigError(f"{dotted}: unknown section {section!r}")
        raw[section][name] = value

    built: dict[str, Any] = {}
    for section in sorted(_SECTIONS, key=lambda k: -k.count(".")):  # tables inside others first
        cls = _SECTIONS[section]
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls) if f"{section}.{f.name}" not in _SECTIONS}
        kwargs: dict[str, Any] = {}
        for name, value in raw[section].items():
            if f"{section}.{name}" in REMOVED:
                raise ConfigError(f"{section}.{name}: {REMOVED[f'{section}.{name}']}; remove it from the configuration")
            if name not in names:
                raise ConfigError(
                    f"{section}.{name}: unknown setting; known: {', '.join(sorted(names))}"
                )
            kwargs[name] = _coerce(section, name, hints[name], value)
        for f in dataclasses.fields(cls):
            if f"{section}.{f.name}" in built:
                kwargs[f.name] = built.pop(f"{section}.{f.name}")
        built[section] = cls(**kwargs)  # validates (``_Checked``)
    explicit = frozenset(f"{section}.{name}" for section, values in raw.items() for name in values)
    return Config(**built, explicit=explicit)


def describe() -> str:
    """The configuration reference as Markdown (docs/configuration.md is generated from it)."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `voicegw/config.py` (`voicegw config-doc`). Precedence: defaults < TOML "
        "(`--config FILE` or `VOICEGW_CONFIG`) < environment `VOICEGW_<SECTION>_<FIELD>` < CLI "
        "`--<section>.<field> VALUE`. A default shown as \"(CUDA: ...)\" is what `voicegw serve` uses "
        "instead when ChatTTS runs on vLLM on a CUDA GPU and the key is not set (`GPU_DEFAULTS`).",
        "",
    ]
    for section, cls in _SECTIONS.items():
        docs = field_docs(cls)
        lines += [f"## [{section}]", "", (cls.__doc__ or "").strip(), "", "| key | default | env | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f"{section}.{f.name}" in _SECTIONS:
                continue  # its own table
            default = f.default if f.default is not dataclasses.MISSING else None
            env_name = f"VOICEGW_{section.upper().replace('.', '_')}_{f.name.upper()}"
            shown = f"`{default!r}`"
            if f"{section}.{f.name}" in GPU_DEFAULTS:
                shown += f" (CUDA: `{GPU_DEFAULTS[f'{section}.{f.name}']!r}`)"
            lines.append(f"| `{f.name}` | {shown} | `{env_name}` | {docs.get(f.name, '')} |")
        lines.append("")
    return "\n".join(lines)


def cli_fields() -> list[tuple[str, type, Any, str]]:
    """(``section.field``, type, default, help) for every setting: the CLI builds flags from it."""
    out = []
    for section, cls in _SECTIONS.items():
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f"{section}.{f.name}" in _SECTIONS:
                continue  # its own table
            # argparse %-formats help strings: a literal % must be doubled
            out.append((f"{section}.{f.name}", hints[f.name], f.default, docs.get(f.name, "").replace("%", "%%")))
    return out
