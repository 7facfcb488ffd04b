"""ChatTTS checkpoints: the upstream directory layout, sizes read back from a directory,
and random-weight checkpoints generated locally (``voicegw make-checkpoint``).

Layout (upstream ``chattts`` 0.2.5, ``ChatTTS/config/config.py`` ``Path``)::

    asset/Decoder.safetensors      hidden-state vocoder front (DVAE decoder, no VQ)
    asset/DVAE.safetensors         code -> mel (GFSQ + decoder; + encoder for voice cloning)
    asset/Embed.safetensors        emb_text, emb_code[4], head_text, head_code[4]
    asset/Vocos.safetensors        mel -> 24 kHz audio
    asset/gpt/config.json          LlamaConfig
    asset/gpt/model.safetensors    LlamaModel weights
    asset/tokenizer/{tokenizer.json,tokenizer_config.json,special_tokens_map.json}

Random checkpoints are built by instantiating the upstream module classes at the chosen sizes
(so key names and shapes are exactly upstream's) and saving their state dicts; the tokenizer
is a WordPiece vocabulary built here with the real control-token ids. Weights are
deterministic from the seed. ``full`` has the released model's shapes; ``tiny`` shrinks the
GPT and the convolution stacks so the test suite runs in seconds on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

ASSET_FILES = (
    "asset/Decoder.safetensors",
    "asset/DVAE.safetensors",
    "asset/Embed.safetensors",
    "asset/Vocos.safetensors",
    "asset/gpt/config.json",
    "asset/gpt/model.safetensors",
    "asset/tokenizer/special_tokens_map.json",
    "asset/tokenizer/tokenizer_config.json",
    "asset/tokenizer/tokenizer.json",
)

#: Size of the WordPiece vocabulary before the control tokens (bert-base-chinese).
BASE_VOCAB_SIZE = 21128
#: Control tokens, in id order from 21128. The ids of [Stts] 21131, [Ebreak] 21136,
#: [spk_emb] 21143 and [break_0] 21147 are those of the released tokenizer.
CONTROL_TOKENS: tuple[str, ...] = (
    "[Sbreak]", "[Pbreak]", "[Ptts]", "[Stts]", "[uv_break]", "[laugh]", "[lbreak]",
    "[empty_spk]", "[Ebreak]", "[music]", "[noise]", "[cough]", "[v_break]", "[Sptts]",
    "[Eptts]", "[spk_emb]", "[spk_smp]", "[txt_smp]", "[mask]",
    *(f"[break_{i}]" for i in range(8)),
    *(f"[speed_{i}]" for i in range(10)),
    *(f"[oral_{i}]" for i in range(10)),
    *(f"[laugh_{i}]" for i in range(3)),
)
assert len(CONTROL_TOKENS) == 50
assert BASE_VOCAB_SIZE + CONTROL_TOKENS.index("[Stts]") == 21131
assert BASE_VOCAB_SIZE + CONTROL_TOKENS.index("[Ebreak]") == 21136
assert BASE_VOCAB_SIZE + CONTROL_TOKENS.index("[spk_emb]") == 21143
assert BASE_VOCAB_SIZE + CONTROL_TOKENS.index("[break_0]") == 21147

NUM_TEXT_TOKENS = BASE_VOCAB_SIZE + len(CONTROL_TOKENS)  # 21178


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a ChatTTS checkpoint (upstream names)."""

    gpt_hidden: int = 768
    """GPT hidden size (also speaker embedding size)."""
    gpt_layers: int = 20
    gpt_heads: int = 12
    gpt_kv_heads: int = 12
    gpt_intermediate: int = 3072
    gpt_vocab: int = 32000
    """LlamaModel.embed_tokens rows (unused by ChatTTS, deleted after load)."""
    max_positions: int = 4096
    num_text_tokens: int = NUM_TEXT_TOKENS
    num_audio_tokens: int = 626
    num_vq: int = 4
    dvae_hidden: int = 256
    dvae_layers: int = 12
    dvae_enc_hidden: int = 256
    dvae_enc_layers: int = 12
    decoder_hidden: int = 512
    decoder_layers: int = 12
    vocos_dim: int = 512
    vocos_intermediate: int = 1536
    vocos_layers: int = 8

    @property
    def gpt_head_dim(self) -> int:
        return self.gpt_hidden // self.gpt_heads


FULL = ModelSpec()
TINY = ModelSpec(
    gpt_hidden=128,
    gpt_layers=2,
    gpt_heads=2,
    gpt_kv_heads=2,
    gpt_intermediate=256,
    gpt_vocab=256,
    dvae_hidden=64,
    dvae_layers=2,
    dvae_enc_hidden=32,
    dvae_enc_layers=1,
    decoder_hidden=64,
    decoder_layers=2,
    vocos_dim=64,
    vocos_intermediate=128,
    vocos_layers=2,
)
SMALL = ModelSpec(
    gpt_hidden=384,
    gpt_layers=6,
    gpt_heads=6,
    gpt_kv_heads=6,
    gpt_intermediate=1536,
    gpt_vocab=256,
    dvae_hidden=128,
    dvae_layers=4,
    dvae_enc_hidden=64,
    dvae_enc_layers=2,
    decoder_hidden=128,
    decoder_layers=4,
    vocos_dim=128,
    vocos_intermediate=384,
    vocos_layers=4,
)
"""Between the two (benchmarks): an engine near real time on a 2-core CPU, where a burst of new
utterances meets full batch slots, as a GPU does near its capacity."""
SIZES: dict[str, ModelSpec] = {"tiny": TINY, "small": SMALL, "full": FULL}


def missing_files(model_dir: str | Path) -> list[str]:
    """Asset files absent from ``model_dir`` (empty list: a complete checkpoint)."""
    root = Path(model_dir)
    return [f for f in ASSET_FILES if not (root / f).is_file()]


def load_spec(model_dir: str | Path) -> ModelSpec:
    """Read the sizes of a checkpoint from its config and tensor shapes (no weights loaded)."""
    from safetensors import safe_open

    root = Path(model_dir)
    cfg = json.loads((root / "asset/gpt/config.json").read_text())

    def shapes(name: str) -> dict[str, list[int]]:
        with safe_open(str(root / "asset" / name), framework="np") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118

    emb = shapes("Embed.safetensors")
    dvae = shapes("DVAE.safetensors")
    dec = shapes("Decoder.safetensors")
    voc = shapes("Vocos.safetensors")

    def layers(sh: dict[str, list[int]], prefix: str) -> int:
        idx = {int(k[len(prefix) :].split(".")[0]) for k in sh if k.startswith(prefix)}
        return max(idx) + 1 if idx else 0

    return ModelSpec(
        gpt_hidden=int(cfg["hidden_size"]),
        gpt_layers=int(cfg["num_hidden_layers"]),
        gpt_heads=int(cfg["num_attention_heads"]),
        gpt_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        gpt_intermediate=int(cfg["intermediate_size"]),
        gpt_vocab=int(cfg.get("vocab_size", 32000)),
        max_positions=int(cfg.get("max_position_embeddings", 4096)),
        num_text_tokens=emb["emb_text.weight"][0],
        num_audio_tokens=emb["emb_code.0.weight"][0],
        num_vq=layers(emb, "emb_code."),
        dvae_hidden=dvae["decoder.conv_out.weight"][1],
        dvae_layers=layers(dvae, "decoder.decoder_block."),
        dvae_enc_hidden=dvae["encoder.conv_out.weight"][1] if "encoder.conv_out.weight" in dvae else 0,
        dvae_enc_layers=layers(dvae, "encoder.decoder_block."),
        decoder_hidden=dec["decoder.conv_out.weight"][1],
        decoder_layers=layers(dec, "decoder.decoder_block."),
        vocos_dim=voc["backbone.embed.weight"][0],
        vocos_intermediate=voc["backbone.convnext.0.pwconv1.weight"][0],
        vocos_layers=layers(voc, "backbone.convnext."),
    )


# --------------------------------------------------------------------------- speaker stats


def _encode_f16(arr: np.ndarray) -> str:
    import pybase16384 as b14

    return str(b14.encode_to_string(np.asarray(arr, dtype=np.float16).tobytes()))


def _upstream_config() -> Any:
    """Upstream's ``ChatTTS.config.Config()``, loaded from its file alone: ``import ChatTTS``
    would import the whole upstream stack (vocos, encodec, vector-quantize, torchaudio), which
    the code engine does not need for a constant."""
    import importlib.util

    pkg = importlib.util.find_spec("ChatTTS")
    if pkg is None or not pkg.submodule_search_locations:
        raise ModuleNotFoundError("ChatTTS (chattts==0.2.5) is needed for the released speaker statistics")
    path = Path(list(pkg.submodule_search_locations)[0]) / "config" / "config.py"
    spec = importlib.util.spec_from_file_location("_voicegw_upstream_config", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Config()


def speaker_stat(hidden: int) -> str:
    """Speaker statistics (std, mean; fp16, base16384) used to sample random voices.

    For the released hidden size (768) these are upstream's ``Config.spk_stat``; for other
    sizes (random test checkpoints) a deterministic synthetic statistic of the right size.
    """
    if hidden == FULL.gpt_hidden:
        return str(_upstream_config().spk_stat)
    rng = np.random.default_rng(hidden)
    std = rng.uniform(0.5, 1.5, hidden)
    mean = rng.normal(0.0, 0.1, hidden)
    return _encode_f16(np.concatenate([std, mean]))


def encode_speaker(embedding: np.ndarray) -> str:
    """Encode a speaker embedding the way upstream does (fp16, raw LZMA2, base16384)."""
    import pybase16384 as b14

    raw = lzma.compress(
        np.asarray(embedding, dtype=np.float16).tobytes(),
        format=lzma.FORMAT_RAW,
        filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}],
    )
    return str(b14.encode_to_string(raw))


class SpeakerDecodeError(ValueError):
    """A speaker string does not decode to at most the expected number of fp16 values."""


def decode_speaker(encoded: str, max_values: int | None = None) -> np.ndarray:
    """Inverse of ``encode_speaker``: float16 vector.

    With ``max_values`` the decompression is bounded: at most ``2 * max_values + 1`` bytes are
    ever produced (a decompression bomb costs that much, not what it expands to), and a string
    that holds more than ``max_values`` values, or a truncated stream, raises
    ``SpeakerDecodeError``. A client's string must always be decoded with a bound.
    """
    import pybase16384 as b14

    data = b14.decode_from_string(encoded)
    filters = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME}]
    if max_values is None:
        raw = lzma.decompress(data, format=lzma.FORMAT_RAW, filters=filters)
    else:
        limit_bytes = 2 * max_values + 1
        # a valid stream of <= limit_bytes never looks further back than that: a small dictionary
        # (liblzma allocates it up front; the encoder's preset would make it 64 MiB)
        small = [{"id": lzma.FILTER_LZMA2, "dict_size": max(4096, limit_bytes)}]
        dec = lzma.LZMADecompressor(format=lzma.FORMAT_RAW, filters=small)
        raw = dec.decompress(data, max_length=limit_bytes)
        if len(raw) >= limit_bytes:
            raise SpeakerDecodeError(f"speaker string holds more than {max_values} values")
        if not dec.eof:
            raise SpeakerDecodeError("speaker string is truncated")
    if len(raw) % 2:
        raise SpeakerDecodeError("speaker string does not hold whole fp16 values")
    return np.frombuffer(raw, dtype=np.float16).copy()


# --------------------------------------------------------------------------- tokenizer


def _base_vocab() -> list[str]:
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += ["<S>", "<T>"]
    seen = set(vocab)

    def add(tok: str) -> None:
        if tok not in seen and len(vocab) < BASE_VOCAB_SIZE:
            seen.add(tok)
            vocab.append(tok)

    for c in range(33, 127):
        ch = chr(c)
        if not ch.isupper():
            add(ch)
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789":
        add("##" + ch)
    for ch in "，。、！？；：“”‘’（）《》…—·":
        add(ch)
    common = (
        "the of and to in is you that it he was for on are as with his they at be this have from or "
        "one had by word but not what all were we when your can said there use an each which she do "
        "how their if will up other about out many then them these so some her would make like him "
        "into time has look two more write go see number no way could people my than first water been "
        "call who oil its now find long down day did get come made may part hello world thank thanks "
        "yes okay good morning please sorry today weather speech voice audio test stream"
    ).split()
    for w in common:
        add(w)
    for a in "abcdefghijklmnopqrstuvwxyz":
        for b in "aeiou":
            add("##" + a + b)
            add(a + b)
    cp = 0x4E00
    while len(vocab) < BASE_VOCAB_SIZE:
        add(chr(cp))
        cp += 1
    return vocab


def write_tokenizer(out_dir: Path) -> None:
    """Write ``asset/tokenizer/*``: a BertTokenizerFast with the real control-token ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece

    vocab = _base_vocab()
    tok = Tokenizer(WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")])
    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=False) for t in CONTROL_TOKENS])
    for i, t in enumerate(CONTROL_TOKENS):
        assert tok.token_to_id(t) == BASE_VOCAB_SIZE + i, t
    d = out_dir / "asset" / "tokenizer"
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    special = {
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "pad_token": "[PAD]",
        "sep_token": "[SEP]",
        "unk_token": "[UNK]",
    }
    (d / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "BertTokenizerFast",
                "do_lower_case": True,
                "tokenize_chinese_chars": True,
                "strip_accents": None,
                "clean_up_tokenization_spaces": True,
                "model_max_length": 1000000000000000019884624838656,
                **special,
            },
            indent=2,
        )
        + "\n"
    )


# --------------------------------------------------------------------------- weights


def _save(module_state: dict, path: Path) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in module_state.items()}, str(path))


def upstream_configs(spec: ModelSpec) -> dict[str, dict]:
    """Upstream ``Config`` sub-sections (as dicts) matching ``spec``."""
    return {
        "dvae_decoder": dict(idim=512, odim=512, hidden=spec.dvae_hidden, n_layer=spec.dvae_layers, bn_dim=128),
        "dvae_encoder": dict(idim=512, odim=1024, hidden=spec.dvae_enc_hidden, n_layer=spec.dvae_enc_layers, bn_dim=128),
        "vq": dict(dim=1024, levels=(5, 5, 5, 5), G=2, R=2),
        "decoder": dict(idim=spec.gpt_hidden // 2, odim=spec.gpt_hidden // 2, hidden=spec.decoder_hidden, n_layer=spec.decoder_layers, bn_dim=128),
        "vocos_backbone": dict(
            input_channels=100, dim=spec.vocos_dim, intermediate_dim=spec.vocos_intermediate, num_layers=spec.vocos_layers
        ),
        "vocos_head": dict(dim=spec.vocos_dim, n_fft=1024, hop_length=256, padding="center"),
        "gpt": dict(
            hidden_size=spec.gpt_hidden,
            intermediate_size=spec.gpt_intermediate,
            num_attention_heads=spec.gpt_heads,
            num_key_value_heads=spec.gpt_kv_heads,
            num_hidden_layers=spec.gpt_layers,
            max_position_embeddings=spec.max_positions,
            vocab_size=spec.gpt_vocab,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            hidden_act="silu",
            attention_dropout=0.0,
            tie_word_embeddings=False,
        ),
    }


def make_checkpoint(
    out_dir: str | Path,
    size: Literal["tiny", "small", "full"] | ModelSpec = "tiny",
    seed: int = 0,
) -> Path:
    """Write a ChatTTS-shaped checkpoint with random weights to ``out_dir``; return it.

    Deterministic from ``seed``: the same call writes byte-identical files.
    """
    from engine._compat import ensure_torch_companions

    ensure_torch_companions()  # before anything imports transformers, vocos or chattts
    import torch
    from ChatTTS.model.dvae import DVAE
    from ChatTTS.model.embed import Embed
    from vocos import Vocos
    from vocos.feature_extractors import MelSpectrogramFeatures
    from vocos.heads import ISTFTHead
    from vocos.models import VocosBackbone

    spec = SIZES[size] if isinstance(size, str) else size
    out = Path(out_dir)
    (out / "asset" / "gpt").mkdir(parents=True, exist_ok=True)
    cfgs = upstream_configs(spec)
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            dvae = DVAE(
                decoder_config=cfgs["dvae_decoder"],
                encoder_config=cfgs["dvae_encoder"],
                vq_config=cfgs["vq"],
                dim=512,
            )
            _save(dvae.state_dict(), out / "asset/DVAE.safetensors")
            del dvae
            torch.manual_seed(seed + 1)
            dec = DVAE(decoder_config=cfgs["decoder"], dim=spec.gpt_hidden // 2)
            _save(dec.state_dict(), out / "asset/Decoder.safetensors")
            del dec
            torch.manual_seed(seed + 2)
            emb = Embed(spec.gpt_hidden, spec.num_audio_tokens, spec.num_text_tokens, spec.num_vq)
            # Default init of nn.Embedding is N(0, 1): scale to a transformer-like range so
            # random models produce varied, finite logits.
            for e in [emb.emb_text, *emb.emb_code]:
                e.weight.mul_(0.02 * 8)
            _save(emb.state_dict(), out / "asset/Embed.safetensors")
            del emb
            torch.manual_seed(seed + 3)
            vocos = Vocos(
                feature_extractor=MelSpectrogramFeatures(sample_rate=24000, n_fft=1024, hop_length=256, n_mels=100, padding="center"),
                backbone=VocosBackbone(**cfgs["vocos_backbone"]),
                head=ISTFTHead(**cfgs["vocos_head"]),
            )
            _save(vocos.state_dict(), out / "asset/Vocos.safetensors")
            del vocos
            _write_gpt(out, cfgs["gpt"], seed + 4)
    finally:
        torch.random.set_rng_state(gen_state)
    write_tokenizer(out)
    return out


def _write_gpt(out: Path, gpt_cfg: dict, seed: int) -> None:
    """``asset/gpt``: a randomly initialised transformers ``LlamaModel`` and its config."""
    import torch
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    llama_cfg = LlamaConfig(**gpt_cfg)
    llama_cfg.initializer_range = 0.02
    gpt = LlamaModel(llama_cfg)
    gpt.apply(gpt._init_weights)
    _save(gpt.state_dict(), out / "asset/gpt/model.safetensors")
    cfg_json = {"architectures": ["LlamaModel"], "model_type": "llama", "torch_dtype": "float32", **gpt_cfg}
    (out / "asset/gpt/config.json").write_text(json.dumps(cfg_json, indent=2, sort_keys=True) + "\n")


#: What the code engine (the GPT in vLLM) reads of a checkpoint.
GPT_FILES = ("asset/gpt/config.json", "asset/gpt/model.safetensors", "asset/Embed.safetensors",
             "asset/tokenizer/tokenizer.json")


def make_gpt_checkpoint(out_dir: str | Path, size: Literal["tiny", "small", "full"] | ModelSpec = "full",
                        seed: int = 0) -> Path:
    """The code engine's part of a random checkpoint (GPT, ``Embed``, tokenizer), written with
    torch and transformers only (no ChatTTS, vocos or decoder weights): for benchmarking the
    GPT on hosts without the upstream package. Same shapes and scales as :func:`make_checkpoint`
    (other random values)."""
    import torch

    spec = SIZES[size] if isinstance(size, str) else size
    out = Path(out_dir)
    (out / "asset" / "gpt").mkdir(parents=True, exist_ok=True)
    h, a, t = spec.gpt_hidden, spec.num_audio_tokens, spec.num_text_tokens
    gen = torch.Generator().manual_seed(seed + 2)
    emb: dict[str, torch.Tensor] = {"emb_text.weight": torch.randn(t, h, generator=gen) * 0.16}
    heads = [("head_text", t)] + [(f"head_code.{i}", a) for i in range(spec.num_vq)]
    for i in range(spec.num_vq):
        emb[f"emb_code.{i}.weight"] = torch.randn(a, h, generator=gen) * 0.16
    for name, rows in heads:
        v = torch.randn(rows, h, generator=gen) * 0.02
        emb[f"{name}.parametrizations.weight.original0"] = torch.randn(rows, 1, generator=gen) * 0.01
        emb[f"{name}.parametrizations.weight.original1"] = v
    _save(emb, out / "asset/Embed.safetensors")
    _write_gpt(out, upstream_configs(spec)["gpt"], seed + 4)
    write_tokenizer(out)
    return out


def make_decoder_assets(out_dir: str | Path, size: Literal["tiny", "small", "full"] | ModelSpec = "full",
                        seed: int = 0) -> Path:
    """The decoder's part of a random checkpoint (``DVAE``, ``Decoder``, ``Vocos`` safetensors with
    upstream's key names), built from ``engine.decoder.nets`` with torch alone: with
    :func:`make_gpt_checkpoint`, a whole checkpoint on a host without the upstream package (the
    DVAE encoder, which decoding never reads, is left out)."""
    import torch

    from engine.decoder.nets import FSQ_LEVELS, ConvStack, GFSQDequant, MelFront, VocosNet

    spec = SIZES[size] if isinstance(size, str) else size
    cfgs = upstream_configs(spec)
    out = Path(out_dir)
    (out / "asset").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed + 6)

    def stack(c: dict) -> ConvStack:
        return ConvStack(c["idim"], c["bn_dim"], c["hidden"], c["odim"], c["n_layer"], 3, 7, 4 * c["hidden"])

    vq = cfgs["vq"]
    dvae = MelFront(stack(cfgs["dvae_decoder"]), 100, 3, GFSQDequant(vq["G"], vq["R"], vq["dim"] // vq["G"], FSQ_LEVELS))
    dec = MelFront(stack(cfgs["decoder"]), 100, 3, None)
    vb = cfgs["vocos_backbone"]
    vocos = VocosNet(vb["input_channels"], vb["dim"], vb["intermediate_dim"], vb["num_layers"], 7, 7, 1024)
    for name, module in (("DVAE", dvae), ("Decoder", dec), ("Vocos", vocos)):
        state = module.state_dict()
        for k in state:
            if k.endswith(".weight") and ".decoder_block." in k and k.count(".") == 3 or k.endswith(".gamma"):
                state[k] = torch.full_like(state[k], 1e-6 if name != "Vocos" else 1.0 / vb["num_layers"])
        _save(state, out / f"asset/{name}.safetensors")
    return out


def sha256_map(model_dir: str | Path) -> dict[str, str]:
    """Upstream-style ``sha256_map`` for the files of ``model_dir`` (for ``Chat.load(source="custom")``)."""
    root = Path(model_dir)
    out = {}
    for rel in ASSET_FILES:
        key = "sha256_" + rel.replace("/", "_").replace(".", "_")
        out[key] = hashlib.sha256((root / rel).read_bytes()).hexdigest()
    return out


def spec_as_dict(spec: ModelSpec) -> dict[str, int]:
    return dataclasses.asdict(spec)
