"""Rewrites of a voice's ONNX graph, at load and in memory, that compute the same thing in fewer ops.

A Piper voice exported by torch at opset 15 spells each of its layer norms
(VITS normalizes over channels: transpose, norm over the last axis,
transpose back) as nine elementwise and reduction ops:

    y = (x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) * gamma + beta

onnxruntime's own LayerNorm fusion leaves these alone (the joe voice keeps
all 36 of its layer norms; its other 3 Sqrt nodes are the duration
predictor's splines), so `fuse_layer_norms` replaces each with one
`LayerNormalization` (opset 17) node. The joe voice's prior has 36 such
patterns; fusing them took its run from 21.7 to 20.2 ms on 2 threads and
31.2 to 29.7 ms on 1 for a 177-phoneme sentence (0.93x and 0.95x,
interleaved in one process), and left its output within float rounding
(about 130 dB SNR) of the original graph.

Only the exact pattern is rewritten: the reductions over the last axis
alone, a constant exponent of 2, a constant scalar epsilon, a constant 1-D
gamma and beta of one shape (more than one channel), and no intermediate
used outside the pattern (a graph output, another node, or a subgraph).
Anything else is left as it was, so a graph this does not recognise runs
unchanged. The engine's tests compare the streamed audio with the original,
unrewritten graph of the voice file.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

# LayerNormalization entered the default domain at opset 17. A graph at 15 or
# 16 is raised to it: from 15 to 17 only types widened, ScatterND and
# ScatterElements gained an optional reduction, GridSample is new, and
# RoiAlign's default coordinate mode changed (so a graph with a RoiAlign is
# left alone). Below 15 more changed meaning (Softmax's axis at 13, axes as
# inputs at 13): such a graph is not rewritten at all.
MIN_OPSET = 15
LAYER_NORM_OPSET = 17
# From opset 18, ReduceMean takes its axes as an input rather than an attribute.
_AXES_AS_INPUT_OPSET = 18


def fuse_layer_norms(model: onnx.ModelProto) -> int:
    """Replace every exact layer-norm pattern of `model`'s main graph in place; returns how many."""
    opset = _default_opset(model)
    if opset is None or opset < MIN_OPSET:
        return 0
    graph = model.graph
    if opset < LAYER_NORM_OPSET and "RoiAlign" in _op_types(graph):
        return 0
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    constants = _Constants(graph, producers)
    # Names a pattern's intermediates must not be: the graph's outputs, and any
    # name a subgraph (If, Loop, Scan) reads from this graph.
    outputs = {v.name for v in graph.output} | _subgraph_reads(graph)

    replaced: dict[int, onnx.NodeProto] = {}  # id of the pattern's last node -> the fused node
    removed: set[int] = set()
    for node in graph.node:
        match = _match(node, consumers, constants, outputs, opset)
        if match is None:
            continue
        nodes, x, gamma, beta, eps, y = match
        if any(id(n) in removed for n in nodes):
            continue
        fused = helper.make_node(
            "LayerNormalization", [x, gamma, beta], [y], name=f"{node.name or 'ReduceMean'}/LayerNormFused",
            axis=-1, epsilon=eps,
        )
        removed.update(id(n) for n in nodes)
        replaced[id(nodes[-1])] = fused
    if not replaced:
        return 0
    kept = [replaced.get(id(n), n) for n in graph.node if id(n) not in removed or id(n) in replaced]
    del graph.node[:]
    graph.node.extend(kept)
    if opset < LAYER_NORM_OPSET:
        for entry in model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = LAYER_NORM_OPSET
    return len(replaced)


def _nodes_within(graph: onnx.GraphProto, top: bool = True):
    """Every node of `graph`'s subgraphs (If, Loop, Scan) at any depth, and of `graph` itself when `top`."""
    todo = [graph] if top else [g for n in graph.node for g in _subgraphs(n)]
    while todo:
        for node in todo.pop().node:
            yield node
            todo.extend(_subgraphs(node))


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


def _op_types(graph: onnx.GraphProto) -> set[str]:
    """Every op type in `graph` and its subgraphs."""
    return {node.op_type for node in _nodes_within(graph)}


def _subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    """Every input name of every node inside `graph`'s subgraphs, at any depth."""
    return {name for node in _nodes_within(graph, top=False) for name in node.input}


def _default_opset(model: onnx.ModelProto) -> int | None:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return int(entry.version)
    return None


def _names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor and node name of `graph` and its subgraphs."""
    names = {i.name for i in graph.initializer} | {v.name for v in list(graph.input) + list(graph.output)}
    for node in _nodes_within(graph):
        names.update(node.input)
        names.update(node.output)
        names.add(node.name)
    return names


def _fresh(base: str, taken: set[str]) -> str:
    """A prefix no name of the graph starts with (a rewrite names its new tensors and nodes under it)."""
    prefix, n = base, 1
    while any(name.startswith(prefix + "/") or name == prefix for name in taken):
        prefix, n = f"{base}{n}", n + 1
    taken.add(prefix)
    return prefix


def _ancestors(producers: dict[str, onnx.NodeProto], name: str) -> set[str]:
    """The tensors `name` depends on (itself included), by name."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        tensor = todo.pop()
        node = producers.get(tensor)
        if node is None or tensor in seen:
            continue
        seen.update(node.output)
        todo.extend(node.input)
    return seen


class _Constants:
    """Values of initializers and Constant nodes, by tensor name."""

    def __init__(self, graph: onnx.GraphProto, producers: dict[str, onnx.NodeProto]) -> None:
        # An initializer also listed as a graph input can be fed at run time: not a constant.
        fed = {i.name for i in graph.input}
        self.initializers = {i.name: i for i in graph.initializer if i.name not in fed}
        self.producers = producers

    def get(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producers.get(name)
        if node is not None and node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            return numpy_helper.to_array(node.attribute[0].t)
        return None


def _attribute(node: onnx.NodeProto, name: str, default=None):
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def _over_last_axis(node: onnx.NodeProto, constants: _Constants, opset: int) -> bool:
    """A ReduceMean over the last axis alone, keeping it (so it broadcasts back)."""
    if node.op_type != "ReduceMean" or _attribute(node, "keepdims", 1) != 1:
        return False
    if opset >= _AXES_AS_INPUT_OPSET:
        given = constants.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        axes = None if given is None else [int(a) for a in given.reshape(-1)]
    else:
        axes = _attribute(node, "axes")
    return axes is not None and list(axes) == [-1]


def _only_user(name: str, consumers, op_type: str) -> onnx.NodeProto | None:
    users = consumers.get(name, [])
    if len(users) == 1 and users[0].op_type == op_type:
        return users[0]
    return None


def _other(node: onnx.NodeProto, name: str) -> str | None:
    """The other input of a binary node one of whose inputs is `name`."""
    if len(node.input) != 2:
        return None
    if node.input[0] == name:
        return node.input[1]
    if node.input[1] == name:
        return node.input[0]
    return None


def _match(mean: onnx.NodeProto, consumers, constants: _Constants, outputs: set[str], opset: int):
    """(nodes, x, gamma, beta, eps, y) when `mean` starts an exact layer norm, else None."""
    if not _over_last_axis(mean, constants, opset):
        return None
    x = mean.input[0]
    sub = _only_user(mean.output[0], consumers, "Sub")
    if sub is None or list(sub.input) != [x, mean.output[0]]:
        return None
    users = consumers.get(sub.output[0], [])
    power = next((u for u in users if u.op_type == "Pow"), None)
    div = next((u for u in users if u.op_type == "Div"), None)
    if len(users) != 2 or power is None or div is None or power.input[0] != sub.output[0] or div.input[0] != sub.output[0]:
        return None
    exponent = constants.get(power.input[1])
    if exponent is None or exponent.size != 1 or float(exponent.reshape(-1)[0]) != 2.0:
        return None
    variance = _only_user(power.output[0], consumers, "ReduceMean")
    if variance is None or not _over_last_axis(variance, constants, opset):
        return None
    add_eps = _only_user(variance.output[0], consumers, "Add")
    if add_eps is None:
        return None
    eps = constants.get(_other(add_eps, variance.output[0]) or "")
    if eps is None or eps.size != 1 or not np.isfinite(eps).all() or float(eps.reshape(-1)[0]) < 0:
        return None
    sqrt = _only_user(add_eps.output[0], consumers, "Sqrt")
    if sqrt is None or list(div.input) != [sub.output[0], sqrt.output[0]]:
        return None
    scale = _only_user(div.output[0], consumers, "Mul")
    if scale is None:
        return None
    gamma = _other(scale, div.output[0])
    shift = _only_user(scale.output[0], consumers, "Add")
    if gamma is None or shift is None:
        return None
    beta = _other(shift, scale.output[0])
    g, b = constants.get(gamma), constants.get(beta or "")
    # A one-element gamma broadcasts over any last axis in the pattern, but
    # LayerNormalization wants one value per channel: leave it alone.
    if g is None or b is None or g.ndim != 1 or g.size < 2 or g.shape != b.shape:
        return None
    if g.dtype != np.float32 or b.dtype != np.float32:
        return None
    nodes = (mean, sub, power, variance, add_eps, sqrt, div, scale, shift)
    if any(out in outputs for n in nodes[:-1] for out in n.output):
        return None
    return nodes, x, gamma, beta, float(eps.reshape(-1)[0]), shift.output[0]
