"""ChatTTS code prompts, tokenized with the checkpoint's own tokenizer (no vLLM tokenizer).

Upstream (``Speaker.decorate_code_prompts`` + ``Tokenizer.encode``, ChatTTS 0.2.5)::

    [Stts][spk_emb]{txt_smp}[speed_5]{text}[Ptts]      with a speaker embedding
    [Stts][empty_spk]{txt_smp}[speed_5]{text}[Ptts]    without

``text`` has ``[Stts]``, ``[spk_emb]`` and ``[empty_spk]`` removed and is stripped; the whole
string is encoded without special tokens (no [CLS]/[SEP]).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CODE_PROMPT = "[speed_5]"


@dataclass(frozen=True)
class CodeModelInfo:
    """What the code engines need to know about a checkpoint (read from its files)."""

    hidden_size: int
    num_text_tokens: int
    num_audio_tokens: int
    num_vq: int
    max_positions: int
    spk_emb_id: int
    empty_spk_id: int

    @property
    def eos_code(self) -> int:
        return self.num_audio_tokens - 1

    @property
    def unified_vocab_size(self) -> int:
        """vLLM vocabulary: text ids, then each codebook's codes."""
        return self.num_text_tokens + self.num_vq * self.num_audio_tokens


def decorate_code_prompt(text: str, has_speaker: bool, txt_smp: str | None = None, prompt: str = DEFAULT_CODE_PROMPT) -> str:
    t = text.replace("[Stts]", "").replace("[spk_emb]", "").replace("[empty_spk]", "").strip()
    if prompt:
        t = prompt + t
    smp = txt_smp or ""
    spk = "[spk_emb]" if has_speaker else "[empty_spk]"
    return f"[Stts]{spk}{smp}{t}[Ptts]"


class PromptBuilder:
    """Builds prompt token ids for a checkpoint directory in upstream layout."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        root = Path(model_dir)
        self._tok = Tokenizer.from_file(str(root / "asset" / "tokenizer" / "tokenizer.json"))
        self.info = read_model_info(root, self._tok)

    def encode(self, s: str) -> list[int]:
        return list(self._tok.encode(s, add_special_tokens=False).ids)

    def code_prompt_ids(self, text: str, has_speaker: bool, txt_smp: str | None = None) -> list[int]:
        return self.encode(decorate_code_prompt(text, has_speaker, txt_smp))


def read_model_info(model_dir: str | Path, tokenizer: object | None = None) -> CodeModelInfo:
    """Sizes from ``asset/gpt/config.json`` and ``asset/Embed.safetensors`` shapes; control ids
    from the tokenizer."""
    from safetensors import safe_open

    root = Path(model_dir)
    cfg = json.loads((root / "asset" / "gpt" / "config.json").read_text())
    with safe_open(str(root / "asset" / "Embed.safetensors"), framework="np") as f:
        keys = set(f.keys())
        n_text = int(f.get_slice("emb_text.weight").get_shape()[0])
        n_audio = int(f.get_slice("emb_code.0.weight").get_shape()[0])
    num_vq = 0
    while f"emb_code.{num_vq}.weight" in keys:
        num_vq += 1
    if tokenizer is None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(root / "asset" / "tokenizer" / "tokenizer.json"))
    spk = tokenizer.token_to_id("[spk_emb]")  # type: ignore[attr-defined]
    empty = tokenizer.token_to_id("[empty_spk]")  # type: ignore[attr-defined]
    if spk is None or empty is None:
        raise ValueError(f"{root}: tokenizer lacks the ChatTTS control tokens")
    return CodeModelInfo(
        hidden_size=int(cfg["hidden_size"]),
        num_text_tokens=n_text,
        num_audio_tokens=n_audio,
        num_vq=num_vq,
        max_positions=int(cfg.get("max_position_embeddings", 4096)),
        spk_emb_id=int(spk),
        empty_spk_id=int(empty),
    )
