"""Foundation: config loading/validation, random checkpoints, upstream loading, CLI."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoint import ASSET_FILES, TINY, load_spec, make_checkpoint, missing_files
from voicegw.config import Config, ConfigError, describe, field_docs, load_config

# ----------------------------------------------------------------------------- config


def test_defaults_and_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[gateway]\nport = 9001\nhost = "0.0.0.0"\n[engine]\nbackend = "espeak"\n')
    env = {"VOICEGW_GATEWAY_PORT": "9002", "VOICEGW_LIMITS_MAX_SESSIONS": "7"}
    cfg = load_config(toml_path=toml, env=env, overrides={"gateway.port": "9003"})
    assert cfg.gateway.port == 9003  # CLI beats env beats TOML
    assert cfg.gateway.host == "0.0.0.0"
    assert cfg.engine.backend == "espeak"
    assert cfg.limits.max_sessions == 7
    assert load_config(env={}) == Config()
    assert load_config(env={"VOICEGW_ENGINE_DECODER_DEVICE": "cuda:1"}).engine.decoder_device == "cuda:1"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"VOICEGW_GATEWAY_PORT": "abc"}, "gateway.port: expected an integer, got 'abc'"),
        ({"VOICEGW_GATEWAY_PORT": "70000"}, "gateway.port: must be in 0..65535"),
        ({"VOICEGW_ENGINE_BACKEND": "tensorrt"}, "engine.backend: 'tensorrt' is not one of auto, vllm, reference, espeak"),
        ({"VOICEGW_LIMITS_MAX_SESSIONS": "0"}, "limits.max_sessions: must be > 0"),
        ({"VOICEGW_ENGINE_ENFORCE_EAGER": "maybe"}, "engine.enforce_eager: expected a boolean"),
        ({"VOICEGW_GATEWAY_PROT": "1"}, "gateway.prot: unknown setting; known:"),
        ({"VOICEGW_ENGINE_DECODER_DEVICE": "gpu1"}, "engine.decoder_device: expected '', 'cpu', 'cuda' or 'cuda:N'"),
        ({"VOICEGW_ENGINE_BACKEND": "synthetic"}, "engine.backend: 'synthetic' was removed"),
        ({"VOICEGW_ENGINE_SYNTHETIC_STEPS_PER_S": "86"},
         "engine.synthetic_steps_per_s: removed with the synthetic backend; remove it from the configuration"),
    ],
)
def test_validation_messages_are_clear(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(env=env)
    assert message in str(exc.value)


def test_toml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[nosuch]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"unknown section \[nosuch\]"):
        load_config(toml_path=bad, env={})
    bad.write_text("[gateway\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(toml_path=bad, env={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(toml_path=tmp_path / "missing.toml", env={})


def test_every_field_documented() -> None:
    import dataclasses

    from voicegw import config as c

    for cls in (c.GatewayConfig, c.EngineConfig, c.SchedulerConfig, c.LimitsConfig):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
    assert "VOICEGW_ENGINE_MODEL_DIR" in describe()


def test_session_and_segmenter_reachable_from_toml_env_and_cli(tmp_path: Path) -> None:
    from gateway.session import SessionSettings

    toml = tmp_path / "c.toml"
    toml.write_text("[session]\nmax_in_flight = 3\n[session.segmenter]\nfirst_wait_ms = 250\nmax_units = 150\n")
    cfg = load_config(toml, env={"VOICEGW_SESSION_SEGMENTER_MIN_UNITS": "30", "VOICEGW_SESSION_FRAME_MS": "20"},
                      overrides={"session.segmenter.max_units": 180})
    assert cfg.session.max_in_flight == 3 and cfg.session.frame_ms == 20.0
    seg = cfg.session.segmenter
    assert (seg.first_wait_ms, seg.min_units, seg.max_units) == (250.0, 30, 180)
    st = SessionSettings.from_config(cfg, "e")  # what every session of the server gets
    assert st.segmenter == seg and st.max_in_flight == 3 and st.frame_ms == 20.0
    with pytest.raises(ConfigError, match="session.segmenter.nope: unknown setting"):
        load_config(env={"VOICEGW_SESSION_SEGMENTER_NOPE": "1"})


def test_config_dataclasses_validate_themselves() -> None:
    """A section built in code meets the same rules as one read from a file, cross-field ones too."""
    from voicegw.config import EngineConfig, LimitsConfig, SegmenterConfig, SessionConfig

    with pytest.raises(ConfigError, match="limits.max_sessions: must be > 0"):
        LimitsConfig(max_sessions=0)
    with pytest.raises(ConfigError, match="engine.backend"):
        EngineConfig(backend="gpu-magic")
    with pytest.raises(ConfigError, match="session.segmenter.min_units: must be <= max_units"):
        SegmenterConfig(min_units=300)
    with pytest.raises(ConfigError, match="session.frame_ms: must be <= limits.flow_window_ms"):
        Config(limits=LimitsConfig(flow_window_ms=30.0), session=SessionConfig(frame_ms=40.0))
    with pytest.raises(ConfigError, match="engine.first_chunk_steps"):
        Config(engine=EngineConfig(first_chunk_steps=40, chunk_steps=20))


def test_configuration_doc_up_to_date() -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
    assert doc.read_text() == describe() + "\n", "regenerate: voicegw config-doc > docs/configuration.md"


# ----------------------------------------------------------------------------- checkpoint


def _digest(root: Path) -> str:
    h = hashlib.sha256()
    for rel in ASSET_FILES:
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def test_tiny_checkpoint_layout_and_determinism(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert missing_files(tiny_model_dir) == []
    assert load_spec(tiny_model_dir) == TINY
    again = make_checkpoint(tmp_path / "again", "tiny", seed=0)
    assert _digest(again) == _digest(tiny_model_dir)


def test_tokenizer_has_real_control_ids(tiny_model_dir: Path) -> None:
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    tok = BertTokenizerFast.from_pretrained(str(tiny_model_dir / "asset" / "tokenizer"))
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("[Stts]", "[spk_emb]", "[break_0]", "[Ebreak]")}
    assert ids == {"[Stts]": 21131, "[spk_emb]": 21143, "[break_0]": 21147, "[Ebreak]": 21136}
    enc = tok("[Stts][spk_emb][speed_5]hello world[Ptts]", add_special_tokens=False)["input_ids"]
    assert enc[:2] == [21131, 21143] and enc[-1] == tok.convert_tokens_to_ids("[Ptts]")
    assert 100 not in enc  # no [UNK] for plain English
    assert len(tok) == 21178


def test_upstream_chattts_loads_tiny_and_speaks(tiny_model_dir: Path) -> None:
    import ChatTTS

    from tests.upstream import load_upstream_chat

    chat = load_upstream_chat(tiny_model_dir)
    steps = 24
    params = ChatTTS.Chat.InferCodeParams(
        spk_emb=chat.sample_random_speaker(), min_new_token=steps, max_new_token=steps, manual_seed=3
    )
    for use_decoder in (False, True):
        gen = chat.infer(
            ["hello world"],
            stream=True,  # stream=True skips upstream's removal of near-silent samples
            skip_refine_text=True,
            use_decoder=use_decoder,
            do_text_normalization=False,
            do_homophone_replacement=False,
            split_text=False,
            params_infer_code=params,
        )
        wav = np.concatenate([w[0] for w in gen if w.size])
        # T steps -> 2T mel frames -> (2T - 1) * 256 samples at 24 kHz (ISTFT, hop 256).
        assert abs(wav.shape[0] - (2 * steps - 1) * 256) <= 256, wav.shape
        assert np.isfinite(wav).all()


# ----------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("command", ["", "serve", "say", "chat", "make-checkpoint", "config-doc"])
def test_cli_help(command: str) -> None:
    args = [sys.executable, "-m", "voicegw.cli", *([command] if command else []), "--help"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: voicegw" in out.stdout


def test_cli_make_checkpoint_in_a_fresh_interpreter(tmp_path: Path) -> None:
    """The README's `voicegw make-checkpoint`: a process of its own (the torch companions' boot
    must run before ChatTTS and vocos are imported, not rely on an earlier import)."""
    out = subprocess.run([sys.executable, "-m", "voicegw.cli", "make-checkpoint", "--size", "tiny",
                          str(tmp_path / "ck")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not missing_files(tmp_path / "ck")


def test_cli_version_and_bad_config() -> None:
    out = subprocess.run([sys.executable, "-m", "voicegw.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("voicegw ")
    out = subprocess.run(
        [sys.executable, "-m", "voicegw.cli", "serve", "--port", "notaport"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "gateway.port: expected an integer" in out.stderr


def test_serve_without_weights_falls_back_to_espeak(tmp_path: Path) -> None:
    """`voicegw serve` with no ChatTTS weights and no network still serves real speech (no model
    asked for: the default directory is empty; an explicit --model-dir that does not load fails
    instead, tests/test_cli_errors.py)."""
    import json
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "voicegw.cli", "serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        body = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    assert r.status == 200
                    body = json.loads(r.read())
                    break
            except OSError:
                time.sleep(0.3)
        assert body is not None, "gateway did not answer /healthz"
        assert body["engine"] == "espeak"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "WARNING" in out and "ChatTTS weights not found" in out
    warning = next(line for line in out.splitlines() if "ChatTTS weights not found" in line)
    assert warning.count("--model-dir") == 1 and warning.count("--download") == 1  # the fix once
