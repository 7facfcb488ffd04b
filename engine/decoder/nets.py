"""The ChatTTS vocoder in plain torch: GFSQ dequantisation, the DVAE / hidden-state ``Decoder``
convolution stack, Vocos (ConvNeXt backbone + ISTFT head).

Parameter names are upstream's (``ChatTTS.model.dvae.DVAE``, ``vocos.Vocos``), so the
checkpoint's ``asset/{DVAE,Decoder,Vocos}.safetensors`` load as they are; every size is read
from the tensors (kernel sizes included). Architecture constants that a checkpoint does not
store are upstream's: ConvNeXt dilation 2 in the DVAE/Decoder stacks (``DVAEDecoder``
default), 1 in Vocos; FSQ levels (5, 5, 5, 5); ISTFT hop 256 with ``center`` padding.

The network is flattened into a list of *ops* (``ConvOp``, ``ConvNeXtOp``, ``PointwiseOp``).
Each op can run *padded* (exactly upstream's ``forward``: whole-sequence decode) or *valid*
(no padding: the streaming decoder feeds it windows with the context it needs). The reach of
each op is read from its ``nn.Conv1d`` (``kernel_size``, ``dilation``, ``padding``) —
``stage_reaches`` walks them — and ``engine.decoder.window`` turns reaches into windows.

No dependency on ``chattts``, ``vocos``, ``vector_quantize_pytorch`` or ``torchaudio``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.decoder.window import ZERO_REACH, DecoderGeometry, Reach, conv_reach

#: Upstream ``DVAEDecoder`` default dilation of its ConvNeXt depthwise convolutions.
DVAE_BLOCK_DILATION = 2
#: FSQ levels of ChatTTS's GFSQ (``Config.dvae.vq.levels``): 5**4 = 625 codes.
FSQ_LEVELS: tuple[int, ...] = (5, 5, 5, 5)
#: Vocos ISTFT hop (``FourierHeadInitArgs.hop_length``); n_fft is read from ``head.out``.
VOCOS_HOP = 256
#: Mel frames per GPT step: the DVAE/Decoder input vector is split in two frames.
FRAMES_PER_STEP = 2


class ConvNeXtBlock(nn.Module):
    """ConvNeXt block of both stacks (upstream DVAE ``weight`` / Vocos ``gamma`` layer scale)."""

    def __init__(self, dim: int, intermediate: int, kernel: int, dilation: int, scale_name: str) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel, padding=dilation * (kernel // 2), dilation=dilation, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate)
        self.pwconv2 = nn.Linear(intermediate, dim)
        self.scale_name = scale_name
        self.register_parameter(scale_name, nn.Parameter(torch.ones(dim)))

    @property
    def layer_scale(self) -> Tensor:
        return getattr(self, self.scale_name)  # type: ignore[no-any-return]

    def mix(self, y: Tensor) -> Tensor:
        """Everything after the depthwise conv (per frame): [B, C, L] -> [B, C, L]."""
        z = self.norm(y.transpose(1, 2))
        z = self.pwconv2(F.gelu(self.pwconv1(z)))
        z = z * self.layer_scale
        return z.transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mix(self.dwconv(x))


class ConvStack(nn.Module):
    """Upstream ``DVAEDecoder``: conv_in (k3, GELU, k3), ConvNeXt blocks, 1x1 conv_out."""

    def __init__(
        self, idim: int, bn_dim: int, hidden: int, odim: int, n_layer: int, k_in: int, k_block: int, inter: int
    ) -> None:
        super().__init__()
        self.conv_in = nn.Sequential(
            nn.Conv1d(idim, bn_dim, k_in, 1, k_in // 2),
            nn.GELU(),
            nn.Conv1d(bn_dim, hidden, k_in, 1, k_in // 2),
        )
        self.decoder_block = nn.ModuleList(
            [ConvNeXtBlock(hidden, inter, k_block, DVAE_BLOCK_DILATION, "weight") for _ in range(n_layer)]
        )
        self.conv_out = nn.Conv1d(hidden, odim, 1, bias=False)

    @property
    def conv_in_first(self) -> nn.Conv1d:
        return cast(nn.Conv1d, self.conv_in[0])

    @property
    def conv_in_second(self) -> nn.Conv1d:
        return cast(nn.Conv1d, self.conv_in[2])

    @property
    def blocks(self) -> list[ConvNeXtBlock]:
        return [cast(ConvNeXtBlock, b) for b in self.decoder_block]


class _RVQ(nn.Module):
    def __init__(self, codebook_dim: int, dim: int) -> None:
        super().__init__()
        self.project_out = nn.Linear(codebook_dim, dim)


class _Quantizer(nn.Module):
    def __init__(self, deq: GFSQDequant) -> None:
        super().__init__()
        self.quantizer = deq  # upstream key prefix: vq_layer.quantizer.rvqs.{g}.project_out


class GFSQDequant(nn.Module):
    """Codes ``[n, G*R]`` -> features ``[n, dim]`` (upstream ``GFSQ._embed``, plain torch).

    Code column ``g*R + r`` is residual level ``r`` of group ``g``. A code's FSQ digits are
    ``(code // basis) % levels``; each digit maps to ``digit * 2/(L-1) - 1`` (odd ``L``),
    residual level ``r`` is scaled by ``L**-r``, levels are summed and projected per group.
    """

    def __init__(self, groups: int, residual: int, dim_per_group: int, levels: Sequence[int]) -> None:
        super().__init__()
        if any(lv % 2 == 0 for lv in levels):
            raise ValueError(f"even FSQ levels are not supported: {levels}")
        self.groups, self.residual = groups, residual
        self.codebook_size = math.prod(levels)
        lv = torch.tensor(list(levels), dtype=torch.float32)
        basis = torch.cumprod(torch.tensor([1, *levels[:-1]]), dim=0)
        idx = torch.arange(self.codebook_size)
        digits = (idx[:, None] // basis[None, :]) % torch.tensor(list(levels))
        codebook = digits.to(torch.float32) * (2.0 / (lv - 1.0)) - 1.0  # [codebook, len(levels)]
        scales = torch.stack([lv**-r for r in range(residual)])  # [R, len(levels)]
        self.codebook: Tensor
        self.scales: Tensor
        self.register_buffer("codebook", codebook, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.rvqs = nn.ModuleList([_RVQ(len(levels), dim_per_group) for _ in range(groups)])

    def forward(self, codes: Tensor) -> Tensor:
        if codes.ndim != 2 or codes.shape[1] != self.groups * self.residual:
            raise ValueError(f"codes must be [n, {self.groups * self.residual}], got {tuple(codes.shape)}")
        out = []
        for g, rvq in enumerate(self.rvqs):
            acc = self.codebook[codes[:, g * self.residual]] * self.scales[0]
            for r in range(1, self.residual):
                acc = acc + self.codebook[codes[:, g * self.residual + r]] * self.scales[r]
            out.append(cast(_RVQ, rvq).project_out(acc))
        return torch.cat(out, dim=1)


class MelFront(nn.Module):
    """Upstream ``DVAE`` decode path: (dequantised codes | GPT hidden states) -> 100-bin mel."""

    def __init__(self, stack: ConvStack, out_dim: int, k_out: int, vq: GFSQDequant | None) -> None:
        super().__init__()
        self.coef: Tensor
        self.register_buffer("coef", torch.ones(1, out_dim, 1))
        self.decoder = stack
        idim = stack.conv_out.out_channels
        self.out_conv = nn.Conv1d(idim, out_dim, k_out, 1, k_out // 2, bias=False)
        self.vq_layer = _Quantizer(vq) if vq is not None else None
        self.in_dim = stack.conv_in_first.in_channels
        """Channels of one mel-rate frame fed to the stack (half of the per-step vector)."""

    @property
    def step_dim(self) -> int:
        """Per-step input width: code columns (codes path) or hidden size (Decoder path)."""
        if self.vq_layer is not None:
            q = self.vq_layer.quantizer
            return q.groups * q.residual
        return self.in_dim * FRAMES_PER_STEP

    def step_features(self, x: Tensor) -> Tensor:
        """Per-step input ``[n, step_dim]`` -> per-step feature ``[n, in_dim * 2]``."""
        if self.vq_layer is not None:
            return self.vq_layer.quantizer(x)
        return x

    def to_frames(self, feats: Tensor) -> Tensor:
        """``[n, 2*C]`` per step -> ``[C, 2n]`` mel-rate frames (upstream's view/permute)."""
        n = feats.shape[0]
        return feats.reshape(n * FRAMES_PER_STEP, self.in_dim).transpose(0, 1)


class VocosBackbone(nn.Module):
    def __init__(self, in_ch: int, dim: int, inter: int, n_layers: int, k_embed: int, k_block: int) -> None:
        super().__init__()
        self.embed = nn.Conv1d(in_ch, dim, k_embed, padding=k_embed // 2)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.convnext = nn.ModuleList([ConvNeXtBlock(dim, inter, k_block, 1, "gamma") for _ in range(n_layers)])
        self.final_layer_norm = nn.LayerNorm(dim, eps=1e-6)

    @property
    def blocks(self) -> list[ConvNeXtBlock]:
        return [cast(ConvNeXtBlock, b) for b in self.convnext]


class VocosHead(nn.Module):
    def __init__(self, dim: int, n_fft: int) -> None:
        super().__init__()
        self.out = nn.Linear(dim, n_fft + 2)


class VocosNet(nn.Module):
    """Vocos: ``backbone`` (embed conv, LayerNorm, ConvNeXt blocks, final LayerNorm) + ISTFT ``head``."""

    def __init__(self, in_ch: int, dim: int, inter: int, n_layers: int, k_embed: int, k_block: int, n_fft: int) -> None:
        super().__init__()
        self.backbone = VocosBackbone(in_ch, dim, inter, n_layers, k_embed, k_block)
        self.head = VocosHead(dim, n_fft)
        self.n_fft = n_fft
        self.window: Tensor
        self.register_buffer("window", torch.hann_window(n_fft), persistent=False)

    def head_frames(self, x: Tensor) -> Tensor:
        """Backbone features ``[B, dim, L]`` (before final norm) -> windowed ISTFT frames ``[B, n_fft, L]``."""
        z = self.backbone.final_layer_norm(x.transpose(1, 2))
        z = self.head.out(z).transpose(1, 2).float()  # the spectrum and its inverse in float32 under autocast
        mag, p = z.chunk(2, dim=1)
        mag = torch.clip(torch.exp(mag), max=1e2)
        spec = mag * (torch.cos(p) + 1j * torch.sin(p))
        frames = torch.fft.irfft(spec, self.n_fft, dim=1, norm="backward")
        return frames * self.window[None, :, None]


# --------------------------------------------------------------------------- ops


class Op:
    """One step of the flattened network on ``[B, C, L]`` tensors."""

    reach: Reach = ZERO_REACH

    def padded(self, x: Tensor) -> Tensor:  # whole-sequence (upstream) semantics
        raise NotImplementedError

    def valid(self, x: Tensor) -> Tensor:  # no padding: L -> L - reach.span
        raise NotImplementedError


class ConvOp(Op):
    def __init__(self, conv: nn.Conv1d) -> None:
        self.conv = conv
        pad = conv.padding
        if isinstance(pad, str):
            raise ValueError(f"string padding {pad!r} is not streamable")
        self.reach = conv_reach(conv.kernel_size[0], conv.dilation[0], pad[0], conv.stride[0])

    def padded(self, x: Tensor) -> Tensor:
        return self.conv(x)  # type: ignore[no-any-return]

    def valid(self, x: Tensor) -> Tensor:
        c = self.conv
        return F.conv1d(x, c.weight, c.bias, 1, 0, c.dilation, c.groups)


class ConvNeXtOp(Op):
    def __init__(self, block: ConvNeXtBlock) -> None:
        self.block = block
        self.conv = ConvOp(block.dwconv)
        self.reach = self.conv.reach

    def padded(self, x: Tensor) -> Tensor:
        return self.block(x)  # type: ignore[no-any-return]

    def valid(self, x: Tensor) -> Tensor:
        y = self.conv.valid(x)
        residual = x[:, :, self.reach.left : x.shape[2] - self.reach.right]
        return residual + self.block.mix(y)


class PointwiseOp(Op):
    def __init__(self, fn: Callable[[Tensor], Tensor], name: str) -> None:
        self.fn = fn
        self.name = name

    def padded(self, x: Tensor) -> Tensor:
        return self.fn(x)

    def valid(self, x: Tensor) -> Tensor:
        return self.fn(x)


@dataclass
class Stage:
    """A frame-context op followed by the per-frame ops up to the next one."""

    head: Op
    tail: list[Op]

    @property
    def reach(self) -> Reach:
        return self.head.reach

    @property
    def in_channels(self) -> int:
        head = self.head
        if isinstance(head, ConvNeXtOp):
            return int(head.block.dwconv.in_channels)
        if isinstance(head, ConvOp):
            return int(head.conv.in_channels)
        raise TypeError(f"stage starts with {type(head).__name__}: its input width is unknown")

    def valid(self, x: Tensor) -> Tensor:
        y = self.head.valid(x)
        for op in self.tail:
            y = op.valid(y)
        return y

    def padded(self, x: Tensor) -> Tensor:
        y = self.head.padded(x)
        for op in self.tail:
            y = op.padded(y)
        return y


def group_stages(ops: Sequence[Op]) -> list[Stage]:
    """Cut the op list before every op that reads neighbouring frames (reach > 0)."""
    stages: list[Stage] = []
    for op in ops:
        if op.reach.span > 0 or not stages:
            stages.append(Stage(op, []))
        else:
            stages[-1].tail.append(op)
    return stages


class Vocoder(nn.Module):
    """Per-step input (codes or hidden states) -> 24 kHz audio, as a list of streamable stages."""

    def __init__(self, front: MelFront, vocos: VocosNet, hop: int = VOCOS_HOP) -> None:
        super().__init__()
        self.front = front
        self.vocos = vocos
        self.hop = hop
        self.n_fft = vocos.n_fft
        self.model_dir = ""
        """The checkpoint it was loaded from (``load_vocoder``)."""
        self.stages = group_stages(self._ops())
        self.geometry = DecoderGeometry(
            frames_per_step=FRAMES_PER_STEP,
            stage_reaches=tuple(s.reach for s in self.stages),
            n_fft=self.n_fft,
            hop=hop,
            center=True,
        )

    @property
    def uses_codes(self) -> bool:
        return self.front.vq_layer is not None

    def _ops(self) -> list[Op]:
        fr, bb = self.front, self.vocos.backbone
        st = fr.decoder
        ops: list[Op] = [ConvOp(st.conv_in_first), PointwiseOp(F.gelu, "gelu"), ConvOp(st.conv_in_second)]
        ops += [ConvNeXtOp(b) for b in st.blocks]
        ops += [ConvOp(st.conv_out), ConvOp(fr.out_conv), PointwiseOp(lambda y: y * fr.coef, "coef")]
        ops += [
            ConvOp(bb.embed),
            PointwiseOp(lambda y: bb.norm(y.transpose(1, 2)).transpose(1, 2), "norm"),
        ]
        ops += [ConvNeXtOp(b) for b in bb.blocks]
        ops += [PointwiseOp(self.vocos.head_frames, "head")]
        return ops

    def frames(self, x: Tensor) -> Tensor:
        """Per-step input ``[n, step_dim]`` -> first-stage input frames ``[C, 2n]``."""
        return self.front.to_frames(self.front.step_features(x))

    def overlap_add(self, frames: Tensor) -> Tensor:
        """``[B, n_fft, F]`` windowed frames -> ``[B, (F-1)*hop]`` audio (torch.istft, center=True)."""
        b, n_fft, nf = frames.shape
        total = (nf - 1) * self.hop + n_fft
        y = F.fold(frames, (1, total), (1, n_fft), stride=(1, self.hop))[:, 0, 0]
        env = F.fold(
            self.vocos.window.square()[None, :, None].expand(1, n_fft, nf), (1, total), (1, n_fft), stride=(1, self.hop)
        )[0, 0, 0]
        t = n_fft // 2
        return y[:, t : total - t] / env[t : total - t]

    @torch.inference_mode()
    def decode_whole(self, x: Tensor) -> Tensor:
        """Whole-sequence decode of one utterance (upstream semantics, padded convolutions):
        ``[T, step_dim]`` -> ``[(2T-1)*hop]`` float audio."""
        if x.shape[0] == 0:
            return torch.zeros(0)
        y = self.frames(x)[None]
        for s in self.stages:
            y = s.padded(y)
        return self.overlap_add(y)[0]


# --------------------------------------------------------------------------- loading


def _layers(state: Mapping[str, Tensor], prefix: str) -> int:
    idx = {int(k[len(prefix) :].split(".")[0]) for k in state if k.startswith(prefix)}
    return max(idx) + 1 if idx else 0


def _strict_load(module: nn.Module, state: Mapping[str, Tensor], what: str) -> None:
    want = module.state_dict()
    missing = [k for k in want if k not in state]
    if missing:
        raise ValueError(f"{what}: checkpoint lacks {missing[:5]}")
    for k, v in want.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise ValueError(f"{what}: {k} has shape {tuple(state[k].shape)}, expected {tuple(v.shape)}")
    module.load_state_dict({k: state[k] for k in want}, strict=True)


def build_front(state: Mapping[str, Tensor], with_vq: bool, levels: Sequence[int] = FSQ_LEVELS) -> MelFront:
    """A ``MelFront`` sized from an upstream DVAE/Decoder state dict, weights loaded."""
    w_in0 = state["decoder.conv_in.0.weight"]
    w_in2 = state["decoder.conv_in.2.weight"]
    n_layer = _layers(state, "decoder.decoder_block.")
    hidden = w_in2.shape[0]
    if n_layer:
        k_block = state["decoder.decoder_block.0.dwconv.weight"].shape[2]
        inter = state["decoder.decoder_block.0.pwconv1.weight"].shape[0]
    else:
        k_block, inter = 7, 4 * hidden
    stack = ConvStack(
        idim=w_in0.shape[1],
        bn_dim=w_in0.shape[0],
        hidden=hidden,
        odim=state["decoder.conv_out.weight"].shape[0],
        n_layer=n_layer,
        k_in=w_in0.shape[2],
        k_block=k_block,
        inter=inter,
    )
    vq = None
    if with_vq:
        groups = _layers(state, "vq_layer.quantizer.rvqs.")
        if groups == 0:
            raise ValueError("DVAE checkpoint has no vq_layer: cannot decode codes")
        po = state["vq_layer.quantizer.rvqs.0.project_out.weight"]
        if po.shape[1] != len(levels):
            raise ValueError(f"GFSQ codebook dim {po.shape[1]} != len(levels) {len(levels)}")
        from engine.api import NUM_AUDIO_TOKENS, NUM_CODEBOOKS

        if NUM_CODEBOOKS % groups or math.prod(levels) != NUM_AUDIO_TOKENS - 1:
            raise ValueError(f"GFSQ groups {groups} / levels {levels} do not fit {NUM_CODEBOOKS} codebooks")
        vq = GFSQDequant(groups, NUM_CODEBOOKS // groups, po.shape[0], levels)
        if groups * po.shape[0] != stack.conv_in_first.in_channels * FRAMES_PER_STEP:
            raise ValueError("GFSQ output width does not match the decoder input (2 frames per step)")
    out_w = state["out_conv.weight"]
    front = MelFront(stack, out_dim=out_w.shape[0], k_out=out_w.shape[2], vq=vq)
    _strict_load(front, state, "DVAE" if with_vq else "Decoder")
    return front


def build_vocos(state: Mapping[str, Tensor]) -> VocosNet:
    emb = state["backbone.embed.weight"]
    n_layers = _layers(state, "backbone.convnext.")
    dim = emb.shape[0]
    k_block = state["backbone.convnext.0.dwconv.weight"].shape[2] if n_layers else 7
    inter = state["backbone.convnext.0.pwconv1.weight"].shape[0] if n_layers else 3 * dim
    n_fft = state["head.out.weight"].shape[0] - 2
    net = VocosNet(emb.shape[1], dim, inter, n_layers, emb.shape[2], k_block, n_fft)
    _strict_load(net, state, "Vocos")
    return net


def load_vocoder(
    model_dir: str | Path, use_hidden: bool = False, device: str | torch.device = "cpu"
) -> Vocoder:
    """Load the vocoder of a checkpoint in upstream layout (``asset/*.safetensors``).

    ``use_hidden=False``: codes -> DVAE (upstream ``use_decoder=False``);
    ``use_hidden=True``: GPT hidden states -> ``Decoder`` (upstream default ``use_decoder=True``).
    """
    from safetensors.torch import load_file

    root = Path(model_dir) / "asset"
    front_state = load_file(str(root / ("Decoder.safetensors" if use_hidden else "DVAE.safetensors")))
    vocos_state = load_file(str(root / "Vocos.safetensors"))
    voc = Vocoder(build_front(front_state, with_vq=not use_hidden), build_vocos(vocos_state))
    voc.model_dir = str(model_dir)
    return voc.to(device).eval()


def stage_reaches(model: nn.Module) -> list[Reach]:
    """Reach of every ``nn.Conv1d`` in ``model`` in registration order (for modules whose convs
    are composed one after another, e.g. upstream ``DVAEDecoder`` or ``VocosBackbone``)."""
    out = []
    for m in model.modules():
        if isinstance(m, nn.Conv1d):
            pad = m.padding
            assert not isinstance(pad, str)
            out.append(conv_reach(m.kernel_size[0], m.dilation[0], pad[0], m.stride[0]))
    return out
