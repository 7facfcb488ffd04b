"""ChatTTS's GPT as an out-of-tree vLLM model (``ChatTTSForVllm``).

Unified vocabulary seen by vLLM (``V = T + 4 * A``, T = 21178 text ids, A = 626 codes)::

    [0, T)            text ids (prompt only; never sampled)
    [T, T + A)        codebook 0 codes  <- the only range vLLM samples
    [T + A*i, ...)    codebook i codes, i = 1..3: markers for the codes the model sampled

Input embedding of a token: ``emb_text(id)`` for text ids; for a code id (frame ``k`` of the
request, position ``prompt_len + k``) the sum of ``emb_code[i](code_i)`` over the four
codebooks, codes 1..3 read from the request's state. At ``[spk_emb]`` the request's speaker
vector replaces the embedding (upstream ``Speaker.apply``).

``compute_logits`` runs the four weight-normed heads, applies upstream's sampling pipeline per
request (:mod:`engine.vllm.sampling`), samples codebooks 1..3 itself, and hands vLLM the
processed codebook-0 logits (vLLM's own temperature/top-p/top-k are left neutral). When a
side codebook samples EOS, codebook 0 is forced to EOS so vLLM stops the request.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.llama import LlamaModel
from vllm.model_executor.models.utils import PPMissingLayer

from engine.vllm.sampling import RowParams, process_logits, sample_codes
from engine.vllm.state import RequestState, registry

#: Value written at the sampled code of codebooks 1..3 (far above any real logit).
MARKER_LOGIT = 1.0e6


def _first_metadata(attn_metadata: Any) -> Any:
    if attn_metadata is None:
        return None
    if isinstance(attn_metadata, list):  # micro-batching: not supported, no ChatTTS rows
        return None
    if isinstance(attn_metadata, dict):
        for md in attn_metadata.values():
            return md
        return None
    return attn_metadata


class ChatTTSForVllm(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        cfg = vllm_config.model_config.hf_config
        self.config = cfg
        self.n_text = int(cfg.chattts_num_text_tokens)
        self.n_audio = int(cfg.chattts_num_audio_tokens)
        self.num_vq = int(cfg.chattts_num_vq)
        self.spk_emb_id = int(cfg.chattts_spk_emb_id)
        self.embed_path = str(cfg.chattts_embed_path)
        self.eos_code = self.n_audio - 1
        hidden = int(cfg.hidden_size)
        self.hidden_size = hidden
        self.model_dtype = vllm_config.model_config.dtype
        self.model = LlamaModel(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        # ChatTTS never uses LlamaModel.embed_tokens (the upstream loader deletes it).
        self.model.embed_tokens = PPMissingLayer()  # type: ignore[assignment]
        # Embeddings and heads stay float32 whatever the decoder dtype (as upstream).
        self.emb_text = nn.Embedding(self.n_text, hidden, dtype=torch.float32)
        self.emb_code = nn.ModuleList(
            [nn.Embedding(self.n_audio, hidden, dtype=torch.float32) for _ in range(self.num_vq)]
        )
        self.head_code = nn.Parameter(
            torch.empty(self.num_vq, self.n_audio, hidden, dtype=torch.float32), requires_grad=False
        )
        self.registry = registry()
        self._max_tokens = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0)
        self._embeds_buf: torch.Tensor | None = None
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def gpt_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in weights:
                if name.startswith("model."):
                    name = name[len("model.") :]
                if name.startswith("embed_tokens."):
                    continue
                yield name, w

        loaded = {f"model.{n}" for n in self.model.load_weights(gpt_weights())}
        emb = load_file(self.embed_path, device="cpu")
        with torch.no_grad():
            self.emb_text.weight.copy_(emb["emb_text.weight"])
            for i in range(self.num_vq):
                code_table: nn.Embedding = self.emb_code[i]  # type: ignore[assignment]
                code_table.weight.copy_(emb[f"emb_code.{i}.weight"])
                g = emb[f"head_code.{i}.parametrizations.weight.original0"]
                v = emb[f"head_code.{i}.parametrizations.weight.original1"]
                self.head_code[i].copy_(torch._weight_norm(v, g, 0))
        loaded |= {"emb_text.weight", "head_code"} | {f"emb_code.{i}.weight" for i in range(self.num_vq)}
        return loaded

    # ------------------------------------------------------------------ forward

    def embed_input_ids(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Embedding without side codes or speaker (interface completeness only)."""
        is_text = input_ids < self.n_text
        e_text = self.emb_text(input_ids.clamp(max=self.n_text - 1))
        e_code = self.emb_code[0]((input_ids - self.n_text).clamp(min=0, max=self.n_audio - 1))
        return torch.where(is_text.unsqueeze(-1), e_text, e_code).to(self.model_dtype)

    get_input_embeddings = embed_input_ids  # name used by older vLLM releases

    def _step_plan(
        self, input_ids: torch.Tensor
    ) -> tuple[np.ndarray | None, list[tuple[int, int, RequestState]], list[int]]:
        """Side codes per token ``[n, num_vq-1]``, (token, row, state) speaker slots, sampling rows."""
        reg = self.registry
        rows_state = reg.active()
        reg.step_rows = []
        if not rows_state or all(s is None for s in rows_state):
            return None, [], []
        md = _first_metadata(get_forward_context().attn_metadata)
        qsl_t = getattr(md, "query_start_loc", None)
        seq_t = getattr(md, "seq_lens", None)
        if qsl_t is None or seq_t is None:
            raise RuntimeError("ChatTTSForVllm: attention metadata without query_start_loc/seq_lens")
        num_reqs = len(rows_state)
        qsl = qsl_t[: num_reqs + 1].tolist()
        seq_lens = seq_t[:num_reqs].tolist()
        n = int(input_ids.shape[0])
        ids_host = input_ids[: qsl[-1]].cpu().numpy()
        side = np.zeros((n, self.num_vq - 1), dtype=np.int64)
        speakers: list[tuple[int, int, RequestState]] = []
        sample_rows: list[int] = []
        for row, st in enumerate(rows_state):
            t0, t1 = qsl[row], qsl[row + 1]
            if st is None or t1 <= t0:
                continue
            end_pos = int(seq_lens[row])
            start_pos = end_pos - (t1 - t0)
            pl = st.prompt_len
            if start_pos < pl and st.params.speaker is not None:
                # Upstream replaces the embedding wherever the prompt holds [spk_emb].
                n_prompt = min(end_pos, pl) - start_pos
                for off in np.nonzero(ids_host[t0 : t0 + n_prompt] == self.spk_emb_id)[0]:
                    speakers.append((t0 + int(off), row, st))
            if end_pos > pl:
                c0 = max(start_pos, pl)
                f0, f1 = c0 - pl, end_pos - pl
                if f1 > st.n_frames:
                    raise RuntimeError(
                        f"ChatTTSForVllm: request {st.params.key} fed frame {f1 - 1} but only "
                        f"{st.n_frames} frames were sampled"
                    )
                tok0 = t0 + (c0 - start_pos)
                if f1 - f0 > 1:
                    reg.stats["recomputed_frames"] += f1 - f0
                st.codes[f0:f1, 0] = ids_host[tok0 : tok0 + (f1 - f0)] - self.n_text
                if st.params.side_codes:
                    side[tok0 : tok0 + (f1 - f0)] = st.codes[f0:f1, 1:]
            if end_pos == pl + st.n_frames:
                sample_rows.append(row)
        reg.step_rows = sample_rows
        return side, speakers, sample_rows

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self._stable(self._embed(input_ids))
        t0 = time.perf_counter_ns()
        out = self.model(None, positions, intermediate_tensors, inputs_embeds=inputs_embeds)
        self.registry.stats["decoder_ns"] += time.perf_counter_ns() - t0
        return out

    def _stable(self, emb: torch.Tensor) -> torch.Tensor:
        """``emb`` copied into a persistent buffer (GPU): CUDA graphs replay from fixed addresses.

        vLLM captures the compiled decoder's graphs with ``inputs_embeds`` at the addresses of the
        capture run; a fresh tensor per step would make every replay read stale memory. The
        buffer is allocated at the first forward (vLLM's profiling run, the largest batch) and
        only grows (re-allocated) for a larger batch, which vLLM never replays from a graph.
        """
        if emb.device.type != "cuda":
            return emb
        n = int(emb.shape[0])
        buf = self._embeds_buf
        if buf is None or buf.shape[0] < n or buf.dtype != emb.dtype or buf.device != emb.device:
            buf = torch.empty((max(n, self._max_tokens), emb.shape[1]), dtype=emb.dtype, device=emb.device)
            self._embeds_buf = buf
        out = buf[:n]
        out.copy_(emb)
        return out

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        try:
            return self._embed_inner(input_ids)
        finally:
            self.registry.stats["embed_ns"] += time.perf_counter_ns() - t0

    def _embed_inner(self, input_ids: torch.Tensor) -> torch.Tensor:
        side_np, speakers, _ = self._step_plan(input_ids)
        device = input_ids.device
        is_text = input_ids < self.n_text
        e_text = self.emb_text(input_ids.clamp(max=self.n_text - 1))
        code0 = (input_ids - self.n_text).clamp(min=0, max=self.n_audio - 1)
        parts = [self.emb_code[0](code0)]
        if side_np is None:
            side = torch.zeros((input_ids.shape[0], self.num_vq - 1), dtype=torch.long, device=device)
        else:
            side = torch.from_numpy(side_np).to(device, non_blocking=True)
        for i in range(1, self.num_vq):
            parts.append(self.emb_code[i](side[:, i - 1]))
        # Same reduction as upstream (stack on a new last dim, then sum).
        e_code = torch.stack(parts, -1).sum(-1)
        emb = torch.where(is_text.unsqueeze(-1), e_text, e_code)
        for tok, _row, st in speakers:
            if st.speaker is None:
                assert st.params.speaker is not None
                st.speaker = torch.tensor(st.params.speaker, dtype=torch.float32, device=device)
            emb[tok] = st.speaker
        return emb.to(self.model_dtype)

    # ------------------------------------------------------------------ logits

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        try:
            return self._compute_logits(hidden_states)
        finally:
            self.registry.stats["logits_ns"] += time.perf_counter_ns() - t0
            self.registry.stats["steps"] += 1

    def _compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.to(torch.float32)
        rows = h.shape[0]
        # [R, num_vq, A]: the four heads (weights computed once from weight norm at load).
        logits4 = torch.stack([F.linear(h, self.head_code[i]) for i in range(self.num_vq)], 1)
        vocab = self.n_text + self.num_vq * self.n_audio
        out = torch.full((rows, vocab), float("-inf"), dtype=torch.float32, device=h.device)
        t, a = self.n_text, self.n_audio
        out[:, t : t + a] = logits4[:, 0]
        states = self.registry.active()
        sample_rows = [r for r in self.registry.step_rows if r < rows and r < len(states)]
        self.registry.step_rows = []
        if not sample_rows:
            return out
        sts: list[RequestState] = [states[r] for r in sample_rows]  # type: ignore[misc]
        dev = h.device
        sel = torch.tensor(sample_rows, device=dev)
        x = logits4[sel]
        window = max(st.params.window for st in sts)
        hist = np.full((len(sts), self.num_vq, max(window, 1)), -1, dtype=np.int64)
        for j, st in enumerate(sts):
            k, w = st.n_frames, st.params.window
            lo = max(0, k - w)
            if k > lo:
                hist[j, :, : k - lo] = st.codes[lo:k].T
        params = RowParams(
            temperature=torch.tensor([st.params.temperature for st in sts], dtype=torch.float32, device=dev),
            top_p=torch.tensor([st.params.top_p for st in sts], dtype=torch.float32, device=dev),
            top_k=torch.tensor([st.params.top_k for st in sts], dtype=torch.int64, device=dev),
            penalty=torch.tensor([st.params.penalty for st in sts], dtype=torch.float32, device=dev),
            block_eos=torch.tensor([st.n_frames < st.params.min_new for st in sts], dtype=torch.bool, device=dev),
            greedy=torch.tensor([st.params.greedy for st in sts], dtype=torch.bool, device=dev),
        )
        processed = process_logits(x, torch.from_numpy(hist).to(dev), params, self.eos_code)
        side = sample_codes(processed[:, 1:], [st.params.greedy for st in sts], [st.generator for st in sts])
        side_eos = (side == self.eos_code).any(dim=1)
        cb0 = processed[:, 0]
        if bool(side_eos.any()):
            forced = torch.full_like(cb0, float("-inf"))
            forced[:, self.eos_code] = 0.0
            cb0 = torch.where(side_eos.unsqueeze(-1), forced, cb0)
        out[sel, t : t + a] = cb0
        for i in range(1, self.num_vq):
            out[sel, t + i * a + side[:, i - 1]] = MARKER_LOGIT
        side_host = side.cpu().numpy()
        for j, st in enumerate(sts):
            k = st.n_frames
            if k < st.codes.shape[0]:
                st.codes[k, 1:] = side_host[j]
            st.n_frames = k + 1
        self.registry.stats["sampled_frames"] += len(sts)
        return out
