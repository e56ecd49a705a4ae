"""VITS, as Piper trains it, in torch: inference only, weights read from a Piper `.onnx` voice.

The weights are read from the voice's ONNX graph by `torch_vits_load.py`;
hyperparameters come from the weight shapes and the convolution attributes,
so any single-speaker Piper voice loads without a conversion step.

The model is split where streaming needs it: `encode()` runs the text encoder,
duration predictor and flow for whole clauses (cheap, and batched over streams
with masks); `decode()` runs the HiFi-GAN vocoder on any window of the latent
frames, batched over windows of different lengths with per-layer masks so that
a padded batch gives the same samples as one window at a time.

This module imports torch; only the torch engine imports it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .torch_vits_load import OnnxVoice, is_unused, read_onnx_voice

# Constants of the VITS recipe that the weights do not reveal.
SPLINE_TAIL_BOUND = 5.0
SPLINE_MIN_BIN = 1e-3
SPLINE_MIN_DERIVATIVE = 1e-3
RESBLOCK1_DILATIONS = (1, 3, 5)
RESBLOCK2_DILATIONS = (1, 3)
# Inputs are zero-padded (and masked) up to a multiple of this many steps:
# oneDNN builds a kernel per input shape, tens of ms each on CPU, so a few
# recurring shapes beat a new shape for every clause and window.
LENGTH_BUCKET = 16


# ---------------------------------------------------------------------------
# Building blocks


class ChannelNorm(nn.Module):
    """LayerNorm over the channel axis of [batch, channels, time]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.transpose(1, 2), (x.shape[1],), self.gamma, self.beta, 1e-5)
        return y.transpose(1, 2)


class RelativeAttention(nn.Module):
    """Self-attention with learned relative-position terms inside a +-window band."""

    def __init__(self, channels: int, heads: int, window: int, shared_heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.window = window
        k = channels // heads
        self.conv_q = nn.Conv1d(channels, channels, 1)
        self.conv_k = nn.Conv1d(channels, channels, 1)
        self.conv_v = nn.Conv1d(channels, channels, 1)
        self.conv_o = nn.Conv1d(channels, channels, 1)
        self.emb_rel_k = nn.Parameter(torch.zeros(shared_heads, 2 * window + 1, k))
        self.emb_rel_v = nn.Parameter(torch.zeros(shared_heads, 2 * window + 1, k))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, c, t = x.shape
        h, w = self.heads, self.window
        k = c // h
        q = run_conv(self.conv_q, x).view(b, h, k, t).transpose(2, 3) / math.sqrt(k)
        key = run_conv(self.conv_k, x).view(b, h, k, t).transpose(2, 3)
        value = run_conv(self.conv_v, x).view(b, h, k, t).transpose(2, 3)

        # band[i, o] is column i + o - w of row i; computing only the band keeps
        # the relative terms O(t * window) instead of O(t^2).
        band = (torch.arange(t, device=x.device)[:, None] + torch.arange(2 * w + 1, device=x.device)[None, :])
        band = band.expand(b, h, t, 2 * w + 1)

        scores = q @ key.transpose(-2, -1)
        rel = q @ self.emb_rel_k.transpose(-2, -1).unsqueeze(0)  # [b, h, t, 2w+1]
        wide = torch.zeros(b, h, t, t + 2 * w, dtype=scores.dtype, device=x.device)
        wide.scatter_(-1, band, rel)
        scores = scores + wide[..., w : w + t]
        scores = scores.masked_fill(mask == 0, -1e4)
        p = torch.softmax(scores, dim=-1)

        out = p @ value
        p_rel = F.pad(p, (w, w)).gather(-1, band)  # [b, h, t, 2w+1]
        out = out + p_rel @ self.emb_rel_v.unsqueeze(0)
        out = out.transpose(2, 3).reshape(b, c, t)
        return run_conv(self.conv_o, out)


class FeedForward(nn.Module):
    def __init__(self, channels: int, filters: int, kernel: int) -> None:
        super().__init__()
        self.conv_1 = nn.Conv1d(channels, filters, kernel, padding=kernel // 2)
        self.conv_2 = nn.Conv1d(filters, channels, kernel, padding=kernel // 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = torch.relu(run_conv(self.conv_1, x * mask))
        return run_conv(self.conv_2, x * mask) * mask


class AttentionStack(nn.Module):
    def __init__(self, channels: int, filters: int, heads: int, layers: int, kernel: int, window: int, shared: int) -> None:
        super().__init__()
        self.attn_layers = nn.ModuleList(RelativeAttention(channels, heads, window, shared) for _ in range(layers))
        self.norm_layers_1 = nn.ModuleList(ChannelNorm(channels) for _ in range(layers))
        self.ffn_layers = nn.ModuleList(FeedForward(channels, filters, kernel) for _ in range(layers))
        self.norm_layers_2 = nn.ModuleList(ChannelNorm(channels) for _ in range(layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        attn_mask = mask.unsqueeze(2) * mask.unsqueeze(-1)
        x = x * mask
        for attn, n1, ffn, n2 in zip(self.attn_layers, self.norm_layers_1, self.ffn_layers, self.norm_layers_2):
            x = n1(x + attn(x, attn_mask))
            x = n2(x + ffn(x, mask))
        return x * mask


class TextEncoder(nn.Module):
    def __init__(self, vocab: int, out_channels: int, hidden: int, filters: int, heads: int,
                 layers: int, kernel: int, window: int, shared: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.out_channels = out_channels
        self.emb = nn.Embedding(vocab, hidden)
        self.encoder = AttentionStack(hidden, filters, heads, layers, kernel, window, shared)
        self.proj = nn.Conv1d(hidden, out_channels * 2, 1)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = (self.emb(ids) * math.sqrt(self.hidden)).transpose(1, 2)
        x = self.encoder(x * mask, mask)
        stats = run_conv(self.proj, x) * mask
        m, logs = stats.split(self.out_channels, dim=1)
        return x, m, logs


class DilatedSeparableConvs(nn.Module):
    """DDSConv: depthwise dilated convs (dilation kernel**i) with 1x1 mixing."""

    def __init__(self, channels: int, kernel: int, layers: int) -> None:
        super().__init__()
        self.convs_sep = nn.ModuleList()
        self.convs_1x1 = nn.ModuleList()
        self.norms_1 = nn.ModuleList()
        self.norms_2 = nn.ModuleList()
        for i in range(layers):
            dilation = kernel**i
            self.convs_sep.append(
                nn.Conv1d(channels, channels, kernel, groups=channels, dilation=dilation,
                          padding=(kernel * dilation - dilation) // 2)
            )
            self.convs_1x1.append(nn.Conv1d(channels, channels, 1))
            self.norms_1.append(ChannelNorm(channels))
            self.norms_2.append(ChannelNorm(channels))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        if g is not None:
            x = x + g
        for sep, pw, n1, n2 in zip(self.convs_sep, self.convs_1x1, self.norms_1, self.norms_2):
            y = F.gelu(n1(sep(x * mask)))
            y = F.gelu(n2(run_conv(pw, y)))
            x = x + y
        return x * mask


def rational_quadratic_inverse(y: torch.Tensor, uw: torch.Tensor, uh: torch.Tensor, ud: torch.Tensor,
                               bound: float) -> torch.Tensor:
    """Inverse of a monotonic rational-quadratic spline on [-bound, bound], identity outside.

    uw, uh: unnormalised bin widths and heights [..., K]; ud: inner knot
    derivatives [..., K-1]. The outer knots get derivative 1 so the spline
    meets the identity tails smoothly.
    """
    bins = uw.shape[-1]
    edge = math.log(math.exp(1 - SPLINE_MIN_DERIVATIVE) - 1)
    derivs = SPLINE_MIN_DERIVATIVE + F.softplus(F.pad(ud, (1, 1), value=edge))

    def knots(unnorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sizes = SPLINE_MIN_BIN + (1 - SPLINE_MIN_BIN * bins) * torch.softmax(unnorm, dim=-1)
        inner = (2 * bound * torch.cumsum(sizes, dim=-1) - bound)[..., :-1]
        lo = torch.full_like(inner[..., :1], -bound)
        cum = torch.cat([lo, inner, -lo], dim=-1)  # [..., K+1], exact at both ends
        return cum, cum[..., 1:] - cum[..., :-1]

    cum_w, widths = knots(uw)
    cum_h, heights = knots(uh)

    # Which bin each y falls in; the last knot is nudged up so y == bound lands in the last bin.
    locs = torch.cat([cum_h[..., :-1], cum_h[..., -1:] + 1e-6], dim=-1)
    idx = ((y.unsqueeze(-1) >= locs).sum(-1) - 1).clamp(0, bins - 1).unsqueeze(-1)

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.gather(-1, idx).squeeze(-1)

    x0, w, y0, h = pick(cum_w), pick(widths), pick(cum_h), pick(heights)
    slope = h / w
    d0, d1 = pick(derivs), pick(derivs[..., 1:])
    dy = y - y0
    # Solve the bin's rational quadratic for theta in [0, 1] (the stable root).
    a = dy * (d0 + d1 - 2 * slope) + h * (slope - d0)
    b = h * d0 - dy * (d0 + d1 - 2 * slope)
    c = -slope * dy
    disc = (b * b - 4 * a * c).clamp_min(0)
    theta = (2 * c) / (-b - torch.sqrt(disc))
    x = theta * w + x0
    inside = (y >= -bound) & (y <= bound)
    return torch.where(inside, x, y)


class ElementwiseAffine(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.m = nn.Parameter(torch.zeros(channels, 1))
        self.logs = nn.Parameter(torch.zeros(channels, 1))

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        return (x - self.m) * torch.exp(-self.logs) * mask


class Flip(nn.Module):
    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        return torch.flip(x, [1])


class SplineCoupling(nn.Module):
    """ConvFlow of the stochastic duration predictor."""

    def __init__(self, channels: int, filters: int, kernel: int, layers: int, bins: int) -> None:
        super().__init__()
        self.half = channels // 2
        self.filters = filters
        self.bins = bins
        self.pre = nn.Conv1d(self.half, filters, 1)
        self.convs = DilatedSeparableConvs(filters, kernel, layers)
        self.proj = nn.Conv1d(filters, self.half * (bins * 3 - 1), 1)

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        x0, x1 = x[:, : self.half], x[:, self.half :]
        h = self.convs(run_conv(self.pre, x0), mask, g)
        h = run_conv(self.proj, h) * mask
        b, c, t = x0.shape
        h = h.reshape(b, c, -1, t).permute(0, 1, 3, 2)  # [b, c, t, 3K-1]
        k = self.bins
        scale = math.sqrt(self.filters)
        x1 = rational_quadratic_inverse(
            x1, h[..., :k] / scale, h[..., k : 2 * k] / scale, h[..., 2 * k :], SPLINE_TAIL_BOUND
        )
        return torch.cat([x0, x1], dim=1) * mask


class StochasticDurationPredictor(nn.Module):
    """Inference half of VITS's flow-based duration predictor: noise -> log durations."""

    def __init__(self, channels: int, filters: int, kernel: int, layers: int, bins: int,
                 coupling_indices: list[int]) -> None:
        super().__init__()
        self.pre = nn.Conv1d(channels, filters, 1)
        self.convs = DilatedSeparableConvs(filters, kernel, layers)
        self.proj = nn.Conv1d(filters, filters, 1)
        top = max(coupling_indices) + 1  # a Flip follows the last coupling
        flows: list[nn.Module] = [ElementwiseAffine(2)]
        for i in range(1, top + 1):
            flows.append(SplineCoupling(2, filters, kernel, layers, bins) if i in coupling_indices else Flip())
        self.flows = nn.ModuleList(flows)
        # Training stacks one coupling right after the affine one that inference skips
        # (its weights are not exported); run the rest last to first.
        skipped = 1 if 1 not in coupling_indices else None
        self.reverse_order = [i for i in range(top, -1, -1) if i != skipped]

    def forward(self, x: torch.Tensor, mask: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        x = run_conv(self.pre, x)
        x = self.convs(x, mask)
        x = run_conv(self.proj, x) * mask
        z = noise
        for i in self.reverse_order:
            z = self.flows[i].reverse(z, mask, g=x)
        return z[:, :1]


class DurationPredictor(nn.Module):
    """The deterministic predictor some VITS voices use instead."""

    def __init__(self, channels: int, filters: int, kernel: int) -> None:
        super().__init__()
        self.conv_1 = nn.Conv1d(channels, filters, kernel, padding=kernel // 2)
        self.norm_1 = ChannelNorm(filters)
        self.conv_2 = nn.Conv1d(filters, filters, kernel, padding=kernel // 2)
        self.norm_2 = ChannelNorm(filters)
        self.proj = nn.Conv1d(filters, 1, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        x = self.norm_1(torch.relu(self.conv_1(x * mask)))
        x = self.norm_2(torch.relu(self.conv_2(x * mask)))
        return self.proj(x * mask) * mask


class WaveNet(nn.Module):
    """Gated dilated conv stack (WN) inside each coupling layer of the flow."""

    def __init__(self, hidden: int, kernel: int, dilation_rate: int, layers: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.in_layers = nn.ModuleList()
        self.res_skip_layers = nn.ModuleList()
        for i in range(layers):
            d = dilation_rate**i
            self.in_layers.append(nn.Conv1d(hidden, 2 * hidden, kernel, dilation=d, padding=(kernel * d - d) // 2))
            self.res_skip_layers.append(nn.Conv1d(hidden, 2 * hidden if i < layers - 1 else hidden, 1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # Same 4-d channels-last layout as the vocoder; see conv_rows.
        x = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        mask = mask.unsqueeze(2)
        out = torch.zeros_like(x)
        last = len(self.in_layers) - 1
        for i, (inp, rs) in enumerate(zip(self.in_layers, self.res_skip_layers)):
            a = conv_rows(inp, x)
            acts = torch.tanh(a[:, : self.hidden]) * torch.sigmoid(a[:, self.hidden :])
            r = conv_rows(rs, acts)
            if i < last:
                x = (x + r[:, : self.hidden]) * mask
                out = out + r[:, self.hidden :]
            else:
                out = out + r
        return (out * mask).squeeze(2)


class MeanCoupling(nn.Module):
    """Mean-only affine coupling layer of the normalising flow."""

    def __init__(self, channels: int, hidden: int, kernel: int, dilation_rate: int, layers: int) -> None:
        super().__init__()
        self.half = channels // 2
        self.pre = nn.Conv1d(self.half, hidden, 1)
        self.enc = WaveNet(hidden, kernel, dilation_rate, layers)
        self.post = nn.Conv1d(hidden, self.half, 1)

    def reverse(self, x: torch.Tensor, mask: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        x0, x1 = x[:, : self.half], x[:, self.half :]
        h = self.enc(run_conv(self.pre, x0) * mask, mask)
        m = run_conv(self.post, h) * mask
        return torch.cat([x0, (x1 - m) * mask], dim=1)


class Flow(nn.Module):
    def __init__(self, channels: int, hidden: int, kernel: int, dilation_rate: int, layers: int,
                 coupling_indices: list[int]) -> None:
        super().__init__()
        top = max(coupling_indices) + 1
        self.flows = nn.ModuleList(
            MeanCoupling(channels, hidden, kernel, dilation_rate, layers) if i in coupling_indices else Flip()
            for i in range(top + 1)
        )

    def reverse(self, z: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for f in reversed(self.flows):
            z = f.reverse(z, mask)
        return z


class ResBlock(nn.Module):
    """HiFi-GAN residual block; type 1 has a second conv per dilation, type 2 does not."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...], kind: int) -> None:
        super().__init__()
        self.kind = kind
        self.kernel = kernel
        self.dilations = dilations

        def conv(d: int) -> nn.Conv1d:
            return nn.Conv1d(channels, channels, kernel, dilation=d, padding=(kernel * d - d) // 2)

        if kind == 1:
            self.convs1 = nn.ModuleList(conv(d) for d in dilations)
            self.convs2 = nn.ModuleList(conv(1) for _ in dilations)
        else:
            self.convs = nn.ModuleList(conv(d) for d in dilations)

    def radius(self) -> int:
        """How many samples either side one output sample depends on."""
        r = sum((self.kernel - 1) // 2 * d for d in self.dilations)
        if self.kind == 1:
            r += (self.kernel - 1) // 2 * len(self.dilations)
        return r

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        # Masking every conv input makes a padded batch row behave like the
        # zero padding at the end of an unpadded window.
        if self.kind == 1:
            for c1, c2 in zip(self.convs1, self.convs2):
                y = _masked(F.leaky_relu(x, 0.1), mask)
                y = _masked(F.leaky_relu(conv_rows(c1, y), 0.1), mask)
                x = x + conv_rows(c2, y)
        else:
            for c in self.convs:
                x = x + conv_rows(c, _masked(F.leaky_relu(x, 0.1), mask))
        return x


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return x if mask is None else x * mask


def run_conv(layer: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """A Conv1d on [batch, channels, time], by the fastest route for its shape.

    Pointwise convs are a matmul (oneDNN's conv setup costs more than the
    work at clause lengths); wider ones go through conv_rows.
    """
    if layer.kernel_size[0] == 1 and layer.groups == 1:
        return F.linear(x.transpose(1, 2), layer.weight.squeeze(-1), layer.bias).transpose(1, 2)
    if layer.groups != 1:
        return layer(x)
    return conv_rows(layer, x.unsqueeze(2).contiguous(memory_format=torch.channels_last)).squeeze(2)


def conv_rows(conv: nn.Conv1d | nn.ConvTranspose1d, x: torch.Tensor) -> torch.Tensor:
    """Apply a 1-d conv module to [batch, channels, 1, time] in channels-last layout.

    oneDNN's channels-last 2-d kernels run the vocoder's long, narrow
    convolutions 2-4x faster on CPU than torch's conv1d path, and suit cuDNN's
    fp16 kernels too. The 4-d weight is cached per weight tensor, so .to() and
    .half() refresh it.
    """
    w = conv.weight
    key = (w.data_ptr(), w.dtype, w.device)
    cached = conv.__dict__.get("_rows_weight")
    if cached is None or cached[0] != key:
        cached = (key, w.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last))
        conv.__dict__["_rows_weight"] = cached
    w4 = cached[1]
    if isinstance(conv, nn.ConvTranspose1d):
        return F.conv_transpose2d(x, w4, conv.bias, stride=(1, conv.stride[0]), padding=(0, conv.padding[0]))
    return F.conv2d(x, w4, conv.bias, padding=(0, conv.padding[0]), dilation=(1, conv.dilation[0]))


class Generator(nn.Module):
    """HiFi-GAN decoder: latent frames -> waveform."""

    def __init__(self, in_channels: int, channels: int, ups: list[tuple[int, int, int]],
                 resblock_kernels: list[int], resblock_dilations: list[tuple[int, ...]], kind: int) -> None:
        super().__init__()
        self.conv_pre = nn.Conv1d(in_channels, channels, 7, padding=3)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        self.strides = [s for _, s, _ in ups]
        self.kernels_per_stage = len(resblock_kernels)
        ch = channels
        for kernel, stride, pad in ups:
            self.ups.append(nn.ConvTranspose1d(ch, ch // 2, kernel, stride, padding=pad))
            ch //= 2
            for k, d in zip(resblock_kernels, resblock_dilations):
                self.resblocks.append(ResBlock(ch, k, d, kind))
        self.conv_post = nn.Conv1d(ch, 1, 7, padding=3, bias=False)
        self.hop = int(np.prod(self.strides))

    def context_frames(self) -> int:
        """Frames of latent either side that can change an output sample.

        Decoding a window with this much context each side gives the same
        samples as decoding the whole utterance.
        """
        frames = 3.0  # conv_pre
        rate = 1
        for i, up in enumerate(self.ups):
            stride = self.strides[i]
            frames += math.ceil(up.kernel_size[0] / stride) / rate
            rate *= stride
            blocks = self.resblocks[i * self.kernels_per_stage : (i + 1) * self.kernels_per_stage]
            frames += max(b.radius() for b in blocks) / rate
        frames += 3 / rate  # conv_post
        return math.ceil(frames) + 1

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        mask = None
        if lengths is not None and bool((lengths < x.shape[2]).any()):
            t = torch.arange(x.shape[2], device=x.device)
            mask = (t[None, :] < lengths[:, None]).view(x.shape[0], 1, 1, -1).to(x.dtype)
        x = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        x = conv_rows(self.conv_pre, _masked(x, mask))
        n = self.kernels_per_stage
        for i, up in enumerate(self.ups):
            x = conv_rows(up, _masked(F.leaky_relu(x, 0.1), mask))
            if mask is not None:
                mask = mask.repeat_interleave(self.strides[i], dim=3)[..., : x.shape[3]]
            acc = None
            for block in self.resblocks[i * n : (i + 1) * n]:
                y = block(x, mask)
                acc = y if acc is None else acc + y
            x = acc / n
        x = conv_rows(self.conv_post, _masked(F.leaky_relu(x), mask))
        return torch.tanh(x).squeeze(2)


# ---------------------------------------------------------------------------
# The whole model


@dataclass
class Aligned:
    """One clause after text encoder and duration predictor: the prior sampled per output frame.

    The flow and the vocoder are both convolutional with a finite reach, so
    either can run on any window of these frames given enough context.
    """

    z_p: torch.Tensor  # [channels, frames]
    durations: torch.Tensor  # [phoneme ids] output frames per id

    @property
    def frames(self) -> int:
        return int(self.z_p.shape[1])


class Vits(nn.Module):
    def __init__(self, voice: OnnxVoice) -> None:
        super().__init__()
        w = voice.weights
        if "emb_g.weight" in w:
            raise ValueError("multi-speaker Piper voices are not supported by the torch engine yet")

        def idx(pattern: str) -> list[int]:
            rx = re.compile(pattern)
            return sorted({int(m.group(1)) for k in w if (m := rx.match(k))})

        vocab, hidden = w["enc_p.emb.weight"].shape
        inter = w["enc_p.proj.weight"].shape[0] // 2
        rel = w["enc_p.encoder.attn_layers.0.emb_rel_k"]
        ffn = w["enc_p.encoder.ffn_layers.0.conv_1.weight"]
        self.enc_p = TextEncoder(
            vocab, inter, hidden, filters=ffn.shape[0], heads=hidden // rel.shape[2],
            layers=len(idx(r"^enc_p\.encoder\.attn_layers\.(\d+)\.")), kernel=ffn.shape[2],
            window=(rel.shape[1] - 1) // 2, shared=rel.shape[0],
        )

        self.stochastic = "dp.flows.0.m" in w
        if self.stochastic:
            filters = w["dp.pre.weight"].shape[0]
            spline_flows = idx(r"^dp\.flows\.(\d+)\.proj\.")
            self.dp: nn.Module = StochasticDurationPredictor(
                hidden, filters, kernel=w["dp.convs.convs_sep.0.weight"].shape[2],
                layers=len(idx(r"^dp\.convs\.convs_sep\.(\d+)\.")),
                bins=(w[f"dp.flows.{spline_flows[0]}.proj.weight"].shape[0] + 1) // 3,
                coupling_indices=spline_flows,
            )
        else:
            c1 = w["dp.conv_1.weight"]
            self.dp = DurationPredictor(hidden, c1.shape[0], c1.shape[2])

        couplings = idx(r"^flow\.flows\.(\d+)\.pre\.")
        first = couplings[0]
        wn_in = w[f"flow.flows.{first}.enc.in_layers.0.weight"]
        wn_layers = idx(rf"^flow\.flows\.{first}\.enc\.in_layers\.(\d+)\.")
        rate = 1
        if len(wn_layers) > 1:
            d = voice.conv_attrs.get(f"flow.flows.{first}.enc.in_layers.1", {}).get("dilations")
            rate = d[0] if d else 1
        self.flow = Flow(inter, wn_in.shape[0] // 2, wn_in.shape[2], rate, len(wn_layers), couplings)

        ups = []
        for i in idx(r"^dec\.ups\.(\d+)\.weight"):
            kernel = w[f"dec.ups.{i}.weight"].shape[2]
            attrs = voice.conv_attrs.get(f"dec.ups.{i}", {})
            stride = attrs.get("strides", [kernel // 2])[0]
            pad = attrs.get("pads", [(kernel - stride) // 2])[0]
            ups.append((kernel, stride, pad))
        kind = 1 if any(k.startswith("dec.resblocks.0.convs1") for k in w) else 2
        per_stage = len(idx(r"^dec\.resblocks\.(\d+)\.")) // len(ups)
        kernels, dilations = [], []
        for j in range(per_stage):
            conv = "convs1" if kind == 1 else "convs"
            kernels.append(w[f"dec.resblocks.{j}.{conv}.0.weight"].shape[2])
            ds = []
            for n in idx(rf"^dec\.resblocks\.{j}\.{conv}\.(\d+)\.weight"):
                default = (RESBLOCK1_DILATIONS if kind == 1 else RESBLOCK2_DILATIONS)[n]
                ds.append(voice.conv_attrs.get(f"dec.resblocks.{j}.{conv}.{n}", {}).get("dilations", [default])[0])
            dilations.append(tuple(ds))
        self.dec = Generator(inter, w["dec.conv_pre.weight"].shape[0], ups, kernels, dilations, kind)

        state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in w.items() if not is_unused(k)}
        # Load strictly: a weight we failed to name must fail here, not sound wrong later.
        self.load_state_dict(state, strict=True)
        self.eval()
        self.channels = inter
        self.hop = self.dec.hop

    @classmethod
    def from_onnx(cls, path: str | Path) -> "Vits":
        return cls(read_onnx_voice(path))

    @property
    def decoder_dtype(self) -> torch.dtype:
        return self.dec.conv_pre.weight.dtype

    def half_decoder(self) -> None:
        """fp16 for the flow and vocoder (the bulk of the work); durations stay fp32 so rounding them never changes."""
        self.flow.half()
        self.dec.half()

    def flow_context(self) -> int:
        """Frames either side that can change one frame of the flow's output."""
        reach = 0
        for f in self.flow.flows:
            if isinstance(f, MeanCoupling):
                for conv in f.enc.in_layers:
                    reach += (conv.kernel_size[0] - 1) // 2 * conv.dilation[0]
        return reach

    def encode(self, ids: list[list[int]], length_scales: list[float], noise_scales: list[float],
               noise_ws: list[float], generators: list[torch.Generator | None] | None = None) -> list[Aligned]:
        """Clauses -> frame-rate priors, batched over clauses of different lengths.

        Noise is drawn per clause (from its own generator if given), so a clause
        gets the same result alone or in a batch.
        """
        device = self.enc_p.emb.weight.device
        b = len(ids)
        gens = generators or [None] * b
        lengths = torch.tensor([len(x) for x in ids], device=device)
        t = _bucket(int(lengths.max()))
        padded = torch.zeros(b, t, dtype=torch.long, device=device)
        noise = torch.zeros(b, 2, t, device=device)
        for i, x in enumerate(ids):
            padded[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            if noise_ws[i]:
                noise[i, :, : len(x)] = _randn((2, len(x)), gens[i], device) * noise_ws[i]
        x_mask = (torch.arange(t, device=device)[None, :] < lengths[:, None]).unsqueeze(1).float()

        x, m_p, logs_p = self.enc_p(padded, x_mask)
        logw = self.dp(x, x_mask, noise)
        scale = torch.tensor(length_scales, device=device).view(b, 1, 1)
        durations = torch.ceil(torch.exp(logw) * x_mask * scale)[:, 0].long()

        out = []
        for i in range(b):
            n = len(ids[i])
            d = durations[i, :n]
            frames = max(1, int(d.sum()))
            # Each phoneme's prior repeated over its frames (the monotonic alignment path).
            z_p = torch.zeros(self.channels, frames, device=device)
            if int(d.sum()):
                m = m_p[i, :, :n].repeat_interleave(d, dim=1)
                z_p[:, : m.shape[1]] = m
                if noise_scales[i]:
                    logs = logs_p[i, :, :n].repeat_interleave(d, dim=1)
                    noise_z = _randn(m.shape, gens[i], device)
                    z_p[:, : m.shape[1]] += noise_z * torch.exp(logs) * noise_scales[i]
            out.append(Aligned(z_p=z_p, durations=d))
        return out

    def flow_windows(self, windows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Prior windows [channels, frames] -> latent windows, in one padded pass.

        Each window is treated as a whole utterance (zero beyond its ends), so
        callers trim flow_context() frames of context from inner edges.
        """
        dtype = self.decoder_dtype
        batch, lengths = _pad([w.to(dtype) for w in windows])
        t = torch.arange(batch.shape[2], device=batch.device)
        mask = (t[None, :] < lengths[:, None]).unsqueeze(1).to(dtype)
        z = self.flow.reverse(batch * mask, mask) * mask
        return [z[i, :, : int(lengths[i])] for i in range(len(windows))]

    def decode(self, windows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Latent windows [channels, frames] -> float waveforms, in one padded pass."""
        batch, lengths = _pad(windows)
        audio = self.dec(batch, lengths)[:, 0]
        return [audio[i, : int(lengths[i]) * self.hop] for i in range(len(windows))]

    def synthesize(self, ids: list[int], noise_scale: float, length_scale: float, noise_w: float,
                   generator: torch.Generator | None = None) -> torch.Tensor:
        """Whole-utterance path, like one call of the ONNX graph."""
        aligned = self.encode([ids], [length_scale], [noise_scale], [noise_w], [generator])[0]
        z = self.flow_windows([aligned.z_p])[0]
        return self.decode([z])[0]


def _bucket(n: int) -> int:
    return -(-n // LENGTH_BUCKET) * LENGTH_BUCKET


def _pad(windows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([w.shape[1] for w in windows], device=windows[0].device)
    batch = torch.zeros(len(windows), windows[0].shape[0], _bucket(int(lengths.max())),
                        dtype=windows[0].dtype, device=windows[0].device)
    for i, w in enumerate(windows):
        batch[i, :, : w.shape[1]] = w
    return batch, lengths



def _randn(shape, generator: torch.Generator | None, device) -> torch.Tensor:
    # Draw on the CPU so a seeded generator gives the same noise on every device.
    return torch.randn(tuple(shape), generator=generator).to(device)
