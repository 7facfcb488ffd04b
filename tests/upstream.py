"""Load upstream ``chattts`` 0.2.5 on a checkpoint directory (real or random, any size).

Upstream's ``Chat`` holds the model sizes in code (``Chat.config``) and checks each asset
file against its packaged ``sha256_map``. For random checkpoints this helper replaces the
map with the checkpoint's own hashes and resizes ``chat.config`` from the checkpoint's
shapes (``engine.checkpoint.load_spec``). The package itself is never patched.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine._compat import ensure_torch_companions
from engine.checkpoint import load_spec, sha256_map, speaker_stat, upstream_configs

ensure_torch_companions()  # before anything imports transformers, vocos or chattts


def load_upstream_chat(model_dir: str | Path, device: str = "cpu"):  # -> ChatTTS.Chat
    import ChatTTS
    import torch

    spec = load_spec(model_dir)
    cfgs = upstream_configs(spec)
    chat = ChatTTS.Chat(logging.getLogger("chattts.upstream"))
    chat.sha256_map = sha256_map(model_dir)
    c = chat.config
    for k, v in cfgs["dvae_decoder"].items():
        setattr(c.dvae.decoder, k, v)
    for k, v in cfgs["dvae_encoder"].items():
        setattr(c.dvae.encoder, k, v)
    for k, v in cfgs["decoder"].items():  # idim = gpt hidden / 2 (hidden split in 2 frames)
        setattr(c.decoder, k, v)
    for k, v in cfgs["vocos_backbone"].items():
        setattr(c.vocos.backbone.init_args, k, v)
    c.vocos.head.init_args.dim = spec.vocos_dim
    c.gpt.hidden_size = spec.gpt_hidden
    c.gpt.intermediate_size = spec.gpt_intermediate
    c.gpt.num_attention_heads = spec.gpt_heads
    c.gpt.num_hidden_layers = spec.gpt_layers
    c.embed.hidden_size = spec.gpt_hidden
    c.spk_stat = speaker_stat(spec.gpt_hidden)
    ok = chat.load(source="custom", custom_path=str(model_dir), device=torch.device(device), compile=False)
    assert ok, "upstream chattts failed to load the checkpoint"
    return chat
