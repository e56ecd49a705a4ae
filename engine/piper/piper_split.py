"""Splitting a Piper voice's one ONNX graph into stages that can stream.

A Piper (VITS) voice is exported as one graph: text in, a whole sentence of
audio out. Only its front needs the whole sentence: the text encoder and the
duration predictor (global attention, and durations for every phoneme). The
flow and the HiFi-GAN decoder after it are convolutional, so they can run on
windows of frames. This module cuts the graph, in memory and with the `onnx`
package only (no torch, no re-export, nothing written beside the model), into:

- `prior`: text encoder and duration predictor, from the phoneme ids to the
  flow's input `z_p`, its frame mask, and the per-phoneme frame counts
  (`add_alignment_output`'s tensor, so word timings keep working);
- `flow`: `z_p` and the mask to the masked latent;
- `decoder`: the masked latent to audio.

When the flow's input cannot be found, the flow stays in the prior (a
two-stage split, still streaming the decoder). When the decoder's input cannot
be found either, `split_voice` raises `SplitError` saying why, and the engine
synthesizes whole units instead.

How far a window needs real frames on each side (the receptive field) is read
off the graph's convolutions, not assumed: see `receptive_field`.

The cuts are found by structure, not by node names, so voices exported by
other tool versions split too:

- the decoder's input is the input of the convolution in front of its first
  upsampling (`ConvTranspose`) layer;
- the flow's input is VITS's `z_p = m_p + randn * exp(logs_p) * noise_scale`:
  the first `Add` after the last random node;
- the frame mask is the other factor of the `Mul` that makes the latent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx
from onnx import helper
from onnx.utils import Extractor

# Graph inputs a stage may take besides its cut tensors: the speaker id of a
# multi-speaker voice conditions the flow and the decoder, and does not depend
# on the text. Anything else (the phoneme ids, their lengths) would tie a
# stage to the whole sentence.
PASS_THROUGH_INPUTS = frozenset({"sid"})

# Ops that move samples along the time axis; everything else a stage holds is
# taken as pointwise in time. The engine checks each split stage against a
# one-shot run at load, so an op that mixes time some other way is caught.
_CONVS = frozenset({"Conv", "ConvTranspose"})
_RANDOM = frozenset({"RandomNormalLike", "RandomNormal", "RandomUniformLike", "RandomUniform"})


class SplitError(ValueError):
    """The graph has no cut this module can use; the message says what is missing."""


@dataclass(frozen=True)
class Stage:
    """One split stage: a graph and the names it is fed and answers with."""

    model: onnx.ModelProto
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    # Frames of real input needed on each side of a window for its output to
    # equal a whole-sequence run; 0 for the prior, which is never windowed.
    context: int = 0


@dataclass(frozen=True)
class VoiceGraphs:
    """A Piper voice cut into a prior, an optional flow, and a decoder."""

    prior: Stage
    flow: Stage | None
    decoder: Stage
    # The decoder's output samples per latent frame (the product of its strides).
    samples_per_frame: int
    # Name of the per-phoneme frame counts among the prior's outputs, if any.
    alignment: str | None
    # Why the flow stayed inside the prior, when it did.
    flow_note: str = ""


def split_voice(model: onnx.ModelProto, alignment: str | None = None) -> VoiceGraphs:
    """Cut `model` (already patched with `add_alignment_output`, if wanted) into stages."""
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    audio = graph.output[0].name
    text_inputs = tuple(i.name for i in graph.input if i.name not in PASS_THROUGH_INPUTS)
    passed = tuple(i.name for i in graph.input if i.name in PASS_THROUGH_INPUTS)
    extractor = Extractor(model)

    latent = _decoder_input(graph, producers)
    decoder = _stage(extractor, graph, (latent,), (audio,), passed, "the decoder")
    context, samples_per_frame = receptive_field(decoder.model.graph, latent)
    decoder = Stage(decoder.model, decoder.inputs, decoder.outputs, context)
    extra = (alignment,) if alignment else ()

    flow: Stage | None = None
    note = ""
    try:
        z_p, mask = _flow_inputs(graph, producers, latent)
        flow = _stage(extractor, graph, (z_p, mask), (latent,), passed, "the flow")
        flow_context, flow_scale = receptive_field(flow.model.graph, z_p)
        if flow_scale != 1:
            raise SplitError("the flow changes the frame rate")
        flow = Stage(flow.model, flow.inputs, flow.outputs, flow_context)
        prior = _stage(extractor, graph, text_inputs, (z_p, mask, *extra), passed, "the prior")
    except SplitError as exc:
        note = str(exc)
        flow = None
        prior = _stage(extractor, graph, text_inputs, (latent, *extra), passed, "the prior")
    return VoiceGraphs(prior, flow, decoder, samples_per_frame, alignment, note)


def _decoder_input(graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto]) -> str:
    first_up = next((n for n in graph.node if n.op_type == "ConvTranspose"), None)
    if first_up is None:
        raise SplitError("no upsampling layer (ConvTranspose): this is not a VITS decoder")
    tensor = first_up.input[0]
    # Walk back through pointwise ops (activation, speaker conditioning) to the
    # decoder's first convolution.
    for _ in range(8):
        node = producers.get(tensor)
        if node is None:
            break
        if node.op_type == "Conv":
            return node.input[0]
        tensor = node.input[0]
    raise SplitError("no convolution in front of the decoder's first upsampling layer")


def flow_input(graph: onnx.GraphProto) -> str:
    """The name of VITS's z_p = m_p + randn * exp(logs_p) * noise_scale, the flow's input.

    Everything it depends on is the prior (text encoder, duration predictor);
    everything after it makes the audio. Raises SplitError when it is not found.
    """
    randoms = [n for n in graph.node if n.op_type in _RANDOM]
    if not randoms:
        raise SplitError("no random node, so no z_p = m_p + noise to cut the flow at")
    tensor = randoms[-1].output[0]
    consumers = _consumers(graph)
    for _ in range(4):
        users = consumers.get(tensor, [])
        if len(users) != 1:
            break
        if users[0].op_type == "Add":
            return users[0].output[0]
        tensor = users[0].output[0]
    raise SplitError("the noise does not reach an Add (z_p) within a few steps")


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers


def _flow_inputs(
    graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto], latent: str
) -> tuple[str, str]:
    z_p = flow_input(graph)
    consumers = _consumers(graph)
    maker = producers.get(latent)
    if maker is None or maker.op_type != "Mul":
        raise SplitError("the decoder's input is not a masked product (latent * mask)")
    after_z = _descendants(z_p, consumers)
    others = [name for name in maker.input if name not in after_z]
    if len(others) != 1:
        raise SplitError("cannot tell the frame mask from the flow's output")
    return z_p, others[0]


def _descendants(start: str, consumers: dict[str, list[onnx.NodeProto]]) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for node in consumers.get(todo.pop(), []):
            for out in node.output:
                if out not in seen:
                    seen.add(out)
                    todo.append(out)
    return seen


def _stage(
    extractor: Extractor,
    graph: onnx.GraphProto,
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    passed: tuple[str, ...],
    what: str,
) -> Stage:
    needed = _graph_inputs_needed(graph, outputs, set(inputs))
    stray = needed - set(inputs) - set(passed)
    if stray:
        raise SplitError(f"{what} depends on {', '.join(sorted(stray))} besides its cut inputs")
    feed = tuple(inputs) + tuple(p for p in passed if p in needed and p not in inputs)
    model = extractor.extract_model(list(feed), list(outputs))
    # Window lengths vary per call: make every dimension of the cut tensors symbolic.
    for value in list(model.graph.input) + list(model.graph.output):
        if value.name in inputs or value.name in outputs:
            _symbolic(value)
    return Stage(model, feed, outputs)


def _graph_inputs_needed(graph: onnx.GraphProto, outputs: tuple[str, ...], stop: set[str]) -> set[str]:
    """The original graph inputs that `outputs` depend on, not looking past `stop`."""
    producers = {out: node for node in graph.node for out in node.output}
    graph_inputs = {i.name for i in graph.input}
    seen: set[str] = set()
    found: set[str] = set()
    todo = list(outputs)
    while todo:
        name = todo.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name in stop:
            continue
        if name in graph_inputs:
            found.add(name)
            continue
        node = producers.get(name)
        if node is not None:
            todo.extend(node.input)
            for attr in node.attribute:  # subgraphs (If, Loop) read outer names too
                for sub in list(attr.g.node if attr.HasField("g") else []) + [n for g in attr.graphs for n in g.node]:
                    todo.extend(sub.input)
    return found


def _symbolic(value: onnx.ValueInfoProto) -> None:
    shape = value.type.tensor_type.shape
    rank = len(shape.dim)
    elem = value.type.tensor_type.elem_type or onnx.TensorProto.FLOAT
    names = [f"{value.name}_d{i}" for i in range(rank)]
    new = helper.make_tensor_value_info(value.name, elem, names if rank else None)
    value.CopyFrom(new)


def receptive_field(graph: onnx.GraphProto, source: str) -> tuple[int, int]:
    """Frames of `source` that one output position depends on, on each side, and the upsampling.

    Walks the graph in order, carrying for every tensor that depends on
    `source` its rate (samples per source frame) and its reach (how many
    source frames away, at most, an element of it looks). A convolution adds
    its own half-width (from its kernel, dilation and padding) divided by the
    rate it runs at; a transposed convolution multiplies the rate by its
    stride; pointwise ops keep the largest reach of their inputs. Parallel
    branches (HiFi-GAN's residual blocks) take the maximum, not the sum.
    Returns (ceil(reach), rate at the graph's first output).
    """
    reach: dict[str, tuple[float, int]] = {source: (0.0, 1)}
    for node in graph.node:
        deps = [reach[name] for name in node.input if name in reach]
        if not deps:
            continue
        far = max(d[0] for d in deps)
        rate = max(d[1] for d in deps)
        if node.op_type in _CONVS:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            kernel = int(attrs.get("kernel_shape", [1])[-1])
            dilation = int(attrs.get("dilations", [1])[-1])
            pads = attrs.get("pads", [0, 0])
            left = int(pads[0]) if pads else 0
            span = (kernel - 1) * dilation
            if node.op_type == "Conv":
                stride = int(attrs.get("strides", [1])[-1])
                if stride != 1:
                    raise SplitError(f"{node.name or node.op_type} downsamples; windows would not line up")
                # Output t reads inputs t - left .. t - left + span.
                far += max(left, span - left) / rate
            else:
                stride = int(attrs.get("strides", [1])[-1])
                # Output j reads inputs i with 0 <= j + left - i * stride <= span.
                far += max(span - left, left) / stride / rate
                rate *= stride
        for out in node.output:
            reach[out] = (far, rate)
    final = reach.get(graph.output[0].name)
    if final is None:
        raise SplitError(f"the stage's output does not depend on {source}")
    # A hair of float slack so that an exact integer reach does not round up.
    return math.ceil(final[0] - 1e-9), final[1]
