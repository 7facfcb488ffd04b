"""ChatTTS's GPT as an out-of-tree vLLM model (``ChatTTSForVllm``).

Unified vocabulary seen by vLLM (``V = T + 4 * A``, T = 21178 text ids, A = 626 codes)::

    [0, T)            text ids (prompt only; never sampled)
    [T, T + A)        codebook 0 codes  <- the only range vLLM samples
    [T + A*i, ...)    codebook i codes, i = 1..3 (kept for the vocabulary's shape; unused)

All per-request state lives in device tensors indexed by the request's slot
(:mod:`engine.vllm.state`); a step reads and writes it with whole-batch tensor ops only: no
loop over rows, no copy to the host, so the step can be captured in a CUDA graph and vLLM's
async scheduling overlaps the next step's host work with this one's kernels.

Input embedding of a token (``forward``): ``emb_text(id)`` for text ids; for the code token of
frame ``f`` (position ``prompt_len + f``) the sum of ``emb_code[i](code_i)`` over the four
codebooks, read from the slot's history. At ``[spk_emb]`` the slot's speaker vector replaces
the embedding (upstream ``Speaker.apply``).

``compute_logits`` runs the four weight-normed heads and upstream's sampling pipeline for all
four codebooks (:mod:`engine.vllm.sampling`), stores the frame (history + the shared frame
table of :mod:`engine.vllm.channel`), and hands vLLM a one-hot row at codebook 0's code, which
vLLM samples greedily. When any codebook samples EOS, codebook 0 is forced to EOS so vLLM
stops the request.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.models.llama import LlamaModel
from vllm.model_executor.models.utils import PPMissingLayer

from engine.vllm.channel import CODE_BITS, GEN_SHIFT
from engine.vllm.sampling import code_keys, frame_sampler, use_eager
from engine.vllm.state import MAX_WINDOW, DeviceState, device_state

_log = logging.getLogger(__name__)


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
        self._vllm_config = vllm_config
        self._device_state: DeviceState | None = None
        #: CUDA graphs of the sampling step by batch-size bucket ({} until captured; None: off).
        self._graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] | None = {}
        self._graph_sizes: list[int] = []
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

    def _state(self, device: torch.device) -> DeviceState:
        st = self._device_state
        if st is None:
            st = self._device_state = device_state(self._vllm_config, device)
        return st

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self._stable(self._embed(input_ids, positions))
        return self.model(None, positions, intermediate_tensors, inputs_embeds=inputs_embeds)

    def _stable(self, emb: torch.Tensor) -> torch.Tensor:
        """``emb`` copied into a persistent buffer (GPU): CUDA graphs replay from fixed addresses.

        Under PIECEWISE graphs vLLM captures the compiled decoder's graphs with ``inputs_embeds``
        at the addresses of the capture run; a fresh tensor per step would make every replay
        read stale memory. The buffer is allocated at the first forward (vLLM's profiling run,
        the largest batch) and only grows for a larger batch, which vLLM never replays.
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

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The input embedding of a step, on the device, for every token of every row at once.

        A token's row comes from the attention metadata's ``query_start_loc`` (device), its
        request's slot from the row -> slot map, its frame index from its position minus the
        request's text prompt length. Text tokens embed with ``emb_text``; code tokens (frame
        ``f``) with the sum of the four code embeddings of frame ``f`` from the slot's history
        (recompute after preemption included); ``[spk_emb]`` with the slot's speaker vector.
        Also marks the rows that sample this step (their step ends at their last known token).
        """
        st = self._state(input_ids.device)
        n = int(input_ids.shape[0])
        md = _first_metadata(get_forward_context().attn_metadata)
        qsl = getattr(md, "query_start_loc", None)
        if qsl is None:  # profiling / dummy runs without metadata: every token is text
            emb = self.emb_text(input_ids.clamp(0, self.n_text - 1))
            return emb.to(self.model_dtype)
        qsl = qsl.to(torch.int64)
        ends = qsl[1:]
        rows = int(ends.shape[0])  # batch rows of the step (padded ones included)
        tok = torch.arange(n, device=input_ids.device, dtype=torch.int64)
        row = torch.searchsorted(ends, tok, right=True)
        real = row < rows  # tokens past the last row's end are padding
        rslot = st.row_slot[:rows]
        slot = torch.where(real, rslot[row.clamp(max=rows - 1)], st.scratch)
        pos = positions[:n].to(torch.int64)
        frame = pos - st.prompt_len[slot]
        is_code = frame >= 0
        codes = st.codes[slot, frame.clamp(0, st.frames - 1)]  # [n, num_vq]
        side = torch.where(st.side_on[slot].unsqueeze(-1), codes[:, 1:], torch.zeros_like(codes[:, 1:]))
        parts = [self.emb_code[0](codes[:, 0])] + [self.emb_code[i](side[:, i - 1]) for i in range(1, self.num_vq)]
        # Same reduction as upstream (stack on a new last dim, then sum).
        e_code = torch.stack(parts, -1).sum(-1)
        e_text = self.emb_text(input_ids.clamp(0, self.n_text - 1))
        emb = torch.where(is_code.unsqueeze(-1), e_code, e_text)
        is_spk = (input_ids == self.spk_emb_id) & ~is_code & st.has_spk[slot]
        emb = torch.where(is_spk.unsqueeze(-1), st.speaker[slot], emb)
        # Rows that sample: the step ends at the request's last known token.
        end_pos = pos[(ends - 1).clamp(0, n - 1)] + 1
        samples = (ends > qsl[:-1]) & (end_pos - st.prompt_len[rslot] == st.n_frames[rslot]) & (rslot != st.scratch)
        st.row_samples.zero_()  # rows past this step's must not sample (graph buckets read them)
        st.row_samples[:rows].copy_(samples)
        st.counters[1] += (is_code & real & (frame < st.n_frames[slot] - 1)).sum()
        return emb.to(self.model_dtype)

    # ------------------------------------------------------------------ logits

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Upstream's sampling pipeline for all four codebooks, on the device, for every row.

        The four weight-normed heads -> temperature -> repetition penalty over the slot's last
        ``window`` frames -> top-p -> top-k -> EOS blocked before ``min_new`` -> one draw per
        codebook (:func:`engine.vllm.sampling.sample_step`, compiled on CUDA). A row that samples writes its
        frame into its slot's history and into the shared frame table (codebooks 1..3 reach
        the front end there) and counts one more frame. vLLM gets a one-hot row at codebook
        0's code (EOS when any codebook drew EOS) and samples it greedily.
        """
        st = self._state(hidden_states.device)
        if hidden_states.device.type == "cuda" and self._graphs is not None:
            try:
                return self._graphed_logits(st, hidden_states)
            except Exception:  # noqa: BLE001 - fall back to the launched kernels, keep serving
                _log.warning("CUDA graphs of the ChatTTS sampler failed; launching its kernels", exc_info=True)
                self._graphs = None
        return self._logits(st, hidden_states)

    def _graphed_logits(self, st: DeviceState, h: torch.Tensor) -> torch.Tensor:
        """:meth:`_logits` replayed from a CUDA graph captured per batch-size bucket (vLLM's
        capture sizes), all buckets at the first call (vLLM's profiling run: their memory is
        counted before the KV cache is sized). Rows past the batch map to the scratch slot and
        do not sample, so a bucket larger than the batch writes nothing real."""
        graphs = self._graphs
        assert graphs is not None
        if not graphs:
            self._capture_logits(st, h)
        rows = int(h.shape[0])
        bucket = next((b for b in self._graph_sizes if b >= rows), None)
        if bucket is None:  # larger than any capture size: launch the kernels
            return self._logits(st, h)
        g, h_in, out = graphs[bucket]
        h_in[:rows].copy_(h)
        g.replay()
        return out[:rows]

    def _capture_logits(self, st: DeviceState, h: torch.Tensor) -> None:
        cc = getattr(self._vllm_config, "compilation_config", None)
        sizes = sorted({int(x) for x in (getattr(cc, "cudagraph_capture_sizes", None) or []) if 0 < int(x) <= st.max_rows})
        self._graph_sizes = sizes
        pool = torch.cuda.graph_pool_handle()
        graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        for b in reversed(sizes):  # the largest first: later (smaller) captures reuse its pool
            h_in = torch.zeros((b, h.shape[1]), dtype=h.dtype, device=h.device)
            self._logits(st, h_in)  # compile / first-use work outside the capture
            torch.cuda.synchronize(h.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
                out = self._logits(st, h_in)
            graphs[b] = (g, h_in, out)
        torch.cuda.synchronize(h.device)
        assert self._graphs is not None
        self._graphs.update(graphs)
        _log.info("ChatTTS sampler: %d CUDA graphs captured (batch sizes %s..%s)", len(graphs),
                  sizes[0] if sizes else "-", sizes[-1] if sizes else "-")

    def _logits(self, st: DeviceState, hidden_states: torch.Tensor) -> torch.Tensor:
        """The sampling step for ``hidden_states`` ``[R, H]`` (one row per batch row): the
        frame drawn, written into the state, and vLLM's one-hot logits ``[R, V]``."""
        rows = int(hidden_states.shape[0])
        dev = hidden_states.device
        samples = st.row_samples[:rows]
        args = (
            hidden_states, self.head_code, st.row_slot[:rows], samples, st.codes, st.n_frames, st.gen,
            st.window, st.temperature, st.top_p, st.top_k, st.penalty, st.min_new, st.greedy, st.seed,
            code_keys(self.num_vq, self.n_audio, dev), st.scratch, self.eos_code, MAX_WINDOW, CODE_BITS, GEN_SHIFT,
        )
        try:
            codes, packed, wslot, wk = frame_sampler(dev)(*args)
        except Exception:  # noqa: BLE001 - a compiler failure must not take the engine down
            _log.warning("compiled ChatTTS sampler failed; using the eager one", exc_info=True)
            use_eager(dev)
            codes, packed, wslot, wk = frame_sampler(dev)(*args)
        st.codes.index_put_((wslot, wk), codes)
        st.table.index_put_((wslot, wk), packed)
        st.n_frames.index_add_(0, wslot, samples.to(torch.int64))
        st.counters[0] += samples.sum()
        st.counters[2] += 1
        vocab = self.n_text + self.num_vq * self.n_audio
        out = torch.full((rows, vocab), float("-inf"), dtype=torch.float32, device=dev)
        out.scatter_(1, (codes[:, :1] + self.n_text), 0.0)
        return out
