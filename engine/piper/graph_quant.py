"""The prior's convolutions in 8-bit integers, rewritten at load and in memory.

Why. The first audio of a sentence waits for the prior (text encoder and
duration predictor) to run over the whole sentence. What grows with the
sentence is mostly the encoder's feed-forward layers: in VITS each is a
kernel-3 convolution from 192 to 768 channels and one back, over every
phoneme id, about 10 MFLOP per id for the joe voice's six layers; then the
attention's four 192-channel projections per layer, and the duration
predictor's pointwise convolutions. In float32 they run near what two cores
can do, so the only way to make them much cheaper is fewer bits. This module
rewrites each such convolution as an integer matrix product: the activations
are quantized per call (8 bits, per tensor), the weights once here (8 bits,
symmetric, per output channel), and the product accumulates in int32.

Only the prior changes. The flow and the decoder, which make the audio
itself, stay float32: the rewrite touches only convolutions that the flow's
input `z_p` depends on (`piper_split.flow_input`), so a voice whose flow input
cannot be found is not rewritten at all. `piper_voice` then checks the
rewritten prior against the float one on a probe sentence before using it
(`compare_priors`): the durations per phoneme id and the latent means must
stay well inside the noise the voice itself samples, or the float prior is
kept and the log says why.

A convolution is rewritten when its weight is a constant 1-D kernel, with no
groups, stride or dilation, and enough input per output (`MIN_INNER`) for
the integer product to pay off. As a matrix product:

    x [N, C, L] -> transpose [N, L, C] -> DynamicQuantizeLinear (uint8, its
    scale and zero point) -> pad with the zero point -> K shifted slices,
    joined [N, L, K*C] -> MatMulInteger with the weight as [K*C, O] int8 ->
    Cast -> times both scales -> + bias -> transpose [N, O, L]

The activations are quantized before the shifted slices are taken, so the
quantizing reads each value once rather than K times and the slices copy
bytes, not floats; and once per input tensor, so convolutions that read the
same input (an attention layer's q, k and v) share it. Padding with the zero
point is the float zeros quantized exactly, so this gives the same integers
as quantizing the joined columns. On the joe voice's prior (p50 over nine
first sentences, one process, interleaved, by hand), quantizing first took
0.93x the time of quantizing the columns on 1 thread and 0.93x on 2; with the
pointwise convolutions rewritten too (`MIN_INNER` from 256 to 192), 0.77x
and 0.85x (18.8 to 14.5 ms, and 16.1 to 13.7).

On x86 without VNNI, onnxruntime's u8 x s8 kernels add pairs of products
in 16 bits, which 8-bit weights can overflow; there the weights get 7 bits,
as onnxruntime's own quantizer advises (`weight_bits`).
"""

from __future__ import annotations

import logging
import platform

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graph_fuse import MIN_OPSET, _ancestors, _attribute, _Constants, _default_opset, _fresh, _names, _nodes_within, _subgraph_reads
from .piper_split import flow_input

log = logging.getLogger(__name__)

# Input values per output value (channels times kernel) below which a
# convolution stays float: a small product gains less than the quantizing
# costs. The joe voice's feed-forward layers have 576 and 2304, its attention
# projections and the duration predictor's pointwise convolutions 192; what
# it keeps float are depthwise (grouped) and single-channel convolutions.
MIN_INNER = 192
# The same without the pointwise convolutions, for the fallback (`pointwise`
# False): the rule before they were added, the feed-forward layers alone.
WIDE_MIN_INNER = 256
# What the rewritten prior may differ by on the probe (`compare_priors`).
# Measured on the joe voice, per phoneme id over the probes (piper_voice):
# 0.050 frames per id and 29.6 dB (0.014 and 32.0 with the feed-forward
# layers alone); two float runs with the voice's own noise differ by about
# 0.76 frames per id.
MAX_DURATION_DIFF = 0.1  # mean |frames| per phoneme id
MIN_LATENT_SNR_DB = 24.0  # the latent means over the ids both runs give frames


def weight_bits() -> int:
    """8, or 7 on x86 without a VNNI dot product (see the module's docstring)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64", "i386", "i686"):
        return 8
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return 8 if {"avx512_vnni", "avx_vnni"} & flags else 7
    except OSError:
        pass
    return 7


def quantize_prior(model: onnx.ModelProto, bits: int | None = None, pointwise: bool = True) -> int:
    """Rewrite, in place, the convolutions that the flow's input depends on; returns how many.

    With `pointwise` False, only kernels wider than 1 with `WIDE_MIN_INNER`
    inputs per output (the text encoder's feed-forward layers in VITS): the
    rewrite that changes the prior least, tried when the full one fails its check.

    Raises SplitError (from `flow_input`) when the flow's input cannot be found:
    then nothing is rewritten, since the audio-making stages could not be told apart.
    """
    opset = _default_opset(model)
    if opset is None or opset < MIN_OPSET:
        return 0  # Shape's start/end (opset 15) and the Slice inputs below need a recent opset
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    prior = _ancestors(producers, flow_input(graph))
    constants = _Constants(graph, producers)
    reserved = {v.name for v in graph.output} | _subgraph_reads(graph)
    bits = bits or weight_bits()
    taken = _names(graph)
    kept: list[onnx.NodeProto] = []
    replaced: set[str] = set()  # the float weights and biases of the rewritten convolutions
    inputs: dict[str, tuple[str, str, str]] = {}  # float input -> its quantized form, made once for every reader
    count = 0
    for node in graph.node:
        conv = _int8_conv(node, constants, pointwise) if node.output[0] in prior and node.output[0] not in reserved else None
        if conv is None:
            kept.append(node)
            continue
        weight, bias = conv
        x = node.input[0]
        if x not in inputs:
            nodes, inputs[x] = _quantized_input(graph, x, _fresh(f"{node.name or node.output[0]}/int8_input", taken))
            kept.extend(nodes)
        base = _fresh(f"{node.name or node.output[0]}/int8", taken)
        kept.extend(_as_quantized_matmul(graph, node, weight, bias, bits, base, inputs[x]))
        replaced.update(name for name in node.input[1:] if name)
        count += 1
    if count:
        del graph.node[:]
        graph.node.extend(kept)
        # Float weights nothing reads any more would still be serialized into every session.
        used = {name for node in _nodes_within(graph) for name in node.input}
        unused = [i for i in graph.initializer if i.name in replaced and i.name not in used]
        for initializer in unused:
            graph.initializer.remove(initializer)
    return count


def _int8_conv(node: onnx.NodeProto, constants: _Constants, pointwise: bool = True) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(weight, bias) of a convolution this module rewrites, else None."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    weight = constants.get(node.input[1])
    if weight is None or weight.dtype != np.float32 or weight.ndim != 3:
        return None
    out_channels, in_channels, kernel = weight.shape
    if in_channels * kernel < (MIN_INNER if pointwise else WIDE_MIN_INNER) or (kernel < 2 and not pointwise):
        return None
    if _attribute(node, "group", 1) != 1 or _attribute(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    if list(_attribute(node, "strides", [1])) != [1] or list(_attribute(node, "dilations", [1])) != [1]:
        return None
    shape = _attribute(node, "kernel_shape")
    if shape is not None and list(shape) != [kernel]:
        return None
    bias = None
    if len(node.input) > 2 and node.input[2]:
        bias = constants.get(node.input[2])
        if bias is None or bias.shape != (out_channels,):
            return None
    return weight, bias


def _quantized_input(graph: onnx.GraphProto, x: str, base: str) -> tuple[list[onnx.NodeProto], tuple[str, str, str]]:
    """Nodes quantizing `x` [N, C, L] time-major: ([N, L, C] uint8, its scale, its zero point)."""
    name = lambda part: f"{base}/{part}"  # noqa: E731
    nodes = [
        helper.make_node("Transpose", [x], [name("time_major")], name=name("Transpose"), perm=[0, 2, 1]),
        helper.make_node(
            "DynamicQuantizeLinear", [name("time_major")], [name("q"), name("scale"), name("zero")],
            name=name("DynamicQuantizeLinear"),
        ),
    ]
    return nodes, (name("q"), name("scale"), name("zero"))


def _as_quantized_matmul(
    graph: onnx.GraphProto, conv: onnx.NodeProto, weight: np.ndarray, bias: np.ndarray | None, bits: int, base: str,
    x: tuple[str, str, str],
) -> list[onnx.NodeProto]:
    out_channels, in_channels, kernel = weight.shape
    name = lambda part: f"{base}/{part}"  # noqa: E731

    def constant(part: str, value: np.ndarray) -> str:
        graph.initializer.append(numpy_helper.from_array(value, name(part)))
        return name(part)

    # Row k*C + c of the matrix holds the weights of input channel c at tap k.
    matrix = weight.transpose(2, 1, 0).reshape(kernel * in_channels, out_channels)
    limit = float(2 ** (bits - 1) - 1)
    scale = np.abs(matrix).max(axis=0) / limit
    scale[scale == 0] = 1.0
    quantized = np.clip(np.round(matrix / scale), -limit, limit).astype(np.int8)

    nodes = []
    columns, x_scale, x_zero = x
    pads = list(_attribute(conv, "pads", [0, 0]))
    if any(pads):
        # Padded with the zero point: the float zeros the convolution pads with, quantized exactly.
        pad = constant("pads", np.array([0, pads[0], 0, 0, pads[1], 0], dtype=np.int64))
        nodes.append(helper.make_node("Pad", [columns, pad, x_zero], [name("padded")], name=name("Pad")))
        columns = name("padded")
    if kernel > 1:
        nodes.append(helper.make_node("Shape", [columns], [name("length")], name=name("Shape"), start=1, end=2))
        axis = constant("axis", np.array([1], dtype=np.int64))
        taps = []
        for k in range(kernel):
            end = name(f"end{k}")
            nodes.append(helper.make_node(
                "Sub", [name("length"), constant(f"trim{k}", np.array([kernel - 1 - k], dtype=np.int64))], [end],
                name=name(f"Sub{k}"),
            ))
            start = constant(f"start{k}", np.array([k], dtype=np.int64))
            nodes.append(helper.make_node("Slice", [columns, start, end, axis], [name(f"tap{k}")], name=name(f"Slice{k}")))
            taps.append(name(f"tap{k}"))
        nodes.append(helper.make_node("Concat", taps, [name("columns")], name=name("Concat"), axis=2))
        columns = name("columns")
    nodes.append(helper.make_node(
        "MatMulInteger", [columns, constant("weight_q", quantized), x_zero], [name("product_i32")], name=name("MatMulInteger"),
    ))
    nodes.append(helper.make_node("Cast", [name("product_i32")], [name("product")], name=name("Cast"), to=TensorProto.FLOAT))
    nodes.append(helper.make_node(
        "Mul", [x_scale, constant("weight_scale", scale.astype(np.float32))], [name("scales")], name=name("MulScales"),
    ))
    product = name("scaled")
    nodes.append(helper.make_node("Mul", [name("product"), name("scales")], [product], name=name("Mul")))
    if bias is not None:
        nodes.append(helper.make_node("Add", [product, constant("bias", bias.astype(np.float32))], [name("biased")], name=name("Add")))
        product = name("biased")
    nodes.append(helper.make_node("Transpose", [product], [conv.output[0]], name=name("TransposeBack"), perm=[0, 2, 1]))
    return nodes


def compare_priors(
    reference_run, rewritten_run, feeds: list[dict], alignment: bool, what: str = "the int8 prior",
    max_duration_diff: float | None = None, min_snr_db: float | None = None,
) -> str:
    """'' when the rewritten prior (`what`) matches the reference one closely enough on `feeds`, else why not.

    Each run maps a feed (noise scales at zero, so both are deterministic) to
    the prior's outputs: the flow's input z_p [1, channels, frames], its mask,
    and, with `alignment`, the frames of each phoneme id.
    """
    max_duration_diff = MAX_DURATION_DIFF if max_duration_diff is None else max_duration_diff
    min_snr_db = MIN_LATENT_SNR_DB if min_snr_db is None else min_snr_db
    moved, ids, signal, error = 0, 0, 0.0, 0.0  # durations compared per phoneme id, over all feeds
    for feed in feeds:
        a, b = reference_run(feed), rewritten_run(feed)
        if not alignment:
            # No durations to line the two up by: they must make the same frames, and z_p is compared whole.
            frames_a, frames_b = a[0].shape[2], b[0].shape[2]
            if frames_a != frames_b:
                return f"{what} makes {frames_b} frames where the reference makes {frames_a}"
            signal += float((np.asarray(a[0], np.float64) ** 2).sum())
            error += float(((np.asarray(a[0], np.float64) - np.asarray(b[0], np.float64)) ** 2).sum())
            continue
        dur_a = np.asarray(a[-1]).reshape(-1).astype(np.int64)
        dur_b = np.asarray(b[-1]).reshape(-1).astype(np.int64)
        moved += int(np.abs(dur_a - dur_b).sum())
        ids += dur_a.size
        # z_p without noise is each id's latent mean, repeated over its frames: compare
        # the first frame of every id that both runs give frames to.
        both = (dur_a > 0) & (dur_b > 0)
        first_a = (np.cumsum(dur_a) - dur_a)[both]
        first_b = (np.cumsum(dur_b) - dur_b)[both]
        mean_a = np.asarray(a[0])[0][:, first_a].astype(np.float64)
        mean_b = np.asarray(b[0])[0][:, first_b].astype(np.float64)
        signal += float((mean_a**2).sum())
        error += float(((mean_a - mean_b) ** 2).sum())
    snr = 10.0 * np.log10(max(signal, 1e-20) / max(error, 1e-30))
    diff = moved / ids if ids else 0.0
    if diff > max_duration_diff:
        return f"{what}'s durations differ by {diff:.3f} frames per id (at most {max_duration_diff})"
    if snr < min_snr_db:
        return f"{what}'s latent means are {snr:.1f} dB from the reference (at least {min_snr_db:.0f})"
    log.debug("%s checked: durations %.3f frames per id and latent means %.1f dB from the reference", what, diff, snr)
    return ""
