"""VITS's relative-position attention with its position terms computed on the band they live in.

Why. Each of the text encoder's attention layers (VITS `attentions.py`, window
w = 4 for Piper) adds two position terms to plain attention, and torch
exports both the way VITS writes them, over every relative position:

    keys:   q [b,h,l,d] @ E_k padded to [2l-1, d]  -> [b,h,l,2l-1], then a
            pad-reshape-pad-reshape-slice "skew" to [b,h,l,l], added to q @ k
    values: the attention weights [b,h,l,l], skewed to [b,h,l,2l-1],
            @ E_v padded to [2l-1, d], added to the attention's output

E_k and E_v hold 2w+1 rows; every other row of the padded tables is zero. So
the products run over 2l-1 positions where 2w+1 are non-zero, and the skews
copy [b,h,l,2l] tensors. `band_relative_attention` computes the same numbers
from the band:

    keys:   R = q @ E_k^T [b,h,l,2w+1]; term[i,j] = R[i, j-i+w] for |j-i| <= w, else 0
    values: B[i,k] = p[i, i+k-w] (0 off the sentence) [b,h,l,2w+1]; term = B @ E_v

each as one Gather with an index table of the sentence's length, built once
per graph from the first layer's queries. The products and the value term
now grow with the sentence, not its square; the key term is still an [l, l]
gather, as the scores it is added to are. The output is the original graph's
to float rounding (a product with a different inner size may group its sums
differently); the joe voice's is bit-identical at lengths 1-187. On the joe
voice's prior as served (with the int8 rewrite after it) this takes 2,554
nodes to 2,136. The gain is small (`python bench/bench_streaming.py --only prior`;
docs/benchmarks.md).

What is matched is the shape of the export, not its arithmetic: an initializer
[1, 2w+1, d] that reaches a MatMul's second input through a pad and slices,
unsqueezes, transposes or reshapes; for keys, that MatMul's output reaching an
Add through pads and reshapes (and slices); for values, its first input coming
from a Softmax the same way; only terms the flow's input depends on (the text
encoder's). `piper_voice` therefore runs the rewritten prior against the
original on probe sentences and on inputs shorter than the window before
using it, and keeps the original (the log says why) unless they agree to
float rounding.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graph_fuse import MIN_OPSET, _ancestors, _default_opset, _fresh, _names, _subgraph_reads
from .piper_split import SplitError, flow_input

# What the banded prior may differ from the original by on the probes
# (graph_quant.compare_priors): float rounding, nothing more; one duration
# rounded the other way on the shorter probe sentence is about 0.02 frames
# per id. The joe voice differs by nothing at all.
MAX_BAND_DURATION_DIFF = 0.05  # mean |frames| per phoneme id
MIN_BAND_SNR_DB = 80.0
# Ops the export routes a relative-embedding table through on its way to the product.
_TABLE_OPS = frozenset({"Pad", "Slice", "Unsqueeze", "Transpose", "Reshape"})
# Ops of the skews between [.., l, 2l-1] and [.., l, l].
_SKEW_OPS = frozenset({"Pad", "Reshape", "Slice"})


@dataclass
class _Term:
    kind: str  # "keys" or "values"
    product: onnx.NodeProto  # the dense MatMul
    source: str  # keys: the queries; values: the attention weights
    dense: str  # the tensor the band replaces: the skewed key term, or the value product
    table: np.ndarray  # [2w+1, d]


def band_relative_attention(model: onnx.ModelProto) -> int:
    """Rewrite, in place, every relative-position term of `model`'s main graph found; returns how many."""
    opset = _default_opset(model)
    if opset is None or opset < MIN_OPSET:
        return 0  # Shape's start/end is opset 15
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for tensor in node.input:
            consumers[tensor].append(node)
    try:
        # The text encoder's terms alone: the load-time check runs the prior, so
        # attention anywhere else (over frames, in a flow) is left as it was.
        prior = _ancestors(producers, flow_input(graph))
    except SplitError:
        return 0
    reserved = {v.name for v in graph.output} | _subgraph_reads(graph)
    fed = {i.name for i in graph.input}
    read_before = {name for node in graph.node for name in node.input}
    terms = []
    for initializer in graph.initializer:
        if initializer.name in fed or len(initializer.dims) != 3 or initializer.dims[0] != 1 or initializer.dims[1] % 2 != 1:
            continue
        table = numpy_helper.to_array(initializer)
        if table.dtype != np.float32:
            continue
        product = _product_of(initializer.name, consumers)
        if product is None:
            continue
        term = _keys(product, table[0], consumers) or _values(product, table[0], producers)
        if term is not None and term.dense not in reserved and term.product.output[0] in prior:
            terms.append(term)
    keys = [t for t in terms if t.kind == "keys"]
    if not keys or len({t.table.shape[0] for t in terms}) != 1:
        return 0
    position = {id(node): n for n, node in enumerate(graph.node)}
    keys.sort(key=lambda t: position[id(t.product)])
    # One index table, from the first key term's queries, put right after they
    # are made: every term of one encoder sees the same length (the check at
    # load confirms it), and a term before that point is left as it was.
    first = producers.get(keys[0].source)
    start = position[id(first)] + 1 if first is not None else 0
    terms = [t for t in terms if position[id(t.product)] >= start]
    taken = _names(graph)
    before: dict[int, list[onnx.NodeProto]] = defaultdict(list)  # node position -> new nodes to put in front of it
    index_nodes, key_index, value_index = _index_tables(graph, keys[0].source, keys[0].table.shape[0] // 2, _fresh("/relative_band", taken))
    before[start].extend(index_nodes)
    for term in terms:
        base = _fresh(f"{term.product.name or term.product.output[0]}/band", taken)
        name = lambda part, base=base: f"{base}/{part}"  # noqa: E731
        if term.kind == "keys":
            table_name = _constant(graph, name("table_t"), np.ascontiguousarray(term.table.T))
            nodes = [
                helper.make_node("MatMul", [term.source, table_name], [name("near")], name=name("MatMul")),
                *_gather(graph, name, name("near"), key_index, name("term")),
            ]
        else:
            table_name = _constant(graph, name("table"), np.ascontiguousarray(term.table))
            nodes = [
                *_gather(graph, name, term.source, value_index, name("near_weights")),
                helper.make_node("MatMul", [name("near_weights"), table_name], [name("term")], name=name("MatMul")),
            ]
        before[position[id(term.product)]].extend(nodes)
        for user in consumers[term.dense]:
            for k, tensor in enumerate(user.input):
                if tensor == term.dense:
                    user.input[k] = name("term")
    ordered: list[onnx.NodeProto] = []
    for n, node in enumerate(graph.node):
        ordered.extend(before.get(n, ()))
        ordered.append(node)
    del graph.node[:]
    graph.node.extend(_live(graph, ordered))
    # The tables and constants only the dense terms read would still be serialized into every session.
    used = {name for node in graph.node for name in node.input} | _subgraph_reads(graph)
    used |= {v.name for v in list(graph.input) + list(graph.output)}
    for initializer in [i for i in graph.initializer if i.name in read_before and i.name not in used]:
        graph.initializer.remove(initializer)
    return len(terms)


def _product_of(table: str, consumers) -> onnx.NodeProto | None:
    """The MatMul taking `table` as its second input through the export's table ops alone, a Pad among them."""
    tensor, ops = table, set()
    while True:
        users = consumers.get(tensor, [])
        if len(users) != 1:
            return None
        user = users[0]
        if user.op_type == "MatMul" and list(user.input[1:]) == [tensor]:
            return user if "Pad" in ops else None
        if user.op_type not in _TABLE_OPS or user.input[0] != tensor:
            return None
        tensor = user.output[0]
        ops.add(user.op_type)


def _keys(product, table, consumers) -> _Term | None:
    """The key term: the product's output skewed (Shape reads aside) into one Add."""

    def user(tensor: str) -> onnx.NodeProto | None:
        users = [u for u in consumers.get(tensor, []) if u.op_type != "Shape"]
        if len(users) != 1 or users[0].op_type in _SKEW_OPS and users[0].input[0] != tensor:
            return None
        return users[0]

    end = _through_skew(product.output[0], user, lambda node: node.output[0])
    if end is None or end[1].op_type != "Add":
        return None
    return _Term("keys", product, product.input[0], end[0], table)


def _values(product, table, producers) -> _Term | None:
    """The value term: the product's first input skewed from a Softmax's output."""
    end = _through_skew(product.input[0], producers.get, lambda node: node.input[0])
    if end is None or end[1].op_type != "Softmax":
        return None
    return _Term("values", product, end[0], product.output[0], table)


def _through_skew(tensor: str, next_node, across) -> tuple[str, onnx.NodeProto] | None:
    """From `tensor`, one node at a time (`next_node`, crossed by `across`), through
    pads, reshapes and slices to the first node of another kind: (the tensor that
    reaches it, that node), when the way held a pad and a reshape."""
    ops: set[str] = set()
    while True:
        node = next_node(tensor)
        if node is None:
            return None
        if node.op_type not in _SKEW_OPS:
            return (tensor, node) if {"Pad", "Reshape"} <= ops else None
        ops.add(node.op_type)
        tensor = across(node)


def _constant(graph: onnx.GraphProto, name: str, value: np.ndarray) -> str:
    graph.initializer.append(numpy_helper.from_array(value, name))
    return name


def _gather(graph, name, source: str, index: str, out: str) -> list[onnx.NodeProto]:
    """out[b,h,i,:] = source[b,h,i,:] with a zero after it, gathered by flat `index` [l, n] over (i, column)."""
    pads = _constant(graph, name("pads"), np.array([0, 0, 0, 0, 0, 0, 0, 1], dtype=np.int64))
    flat = _constant(graph, name("flat"), np.array([0, 0, -1], dtype=np.int64))
    return [
        helper.make_node("Pad", [source, pads], [name("padded")], name=name("Pad")),
        helper.make_node("Reshape", [name("padded"), flat], [name("rows")], name=name("Reshape")),
        helper.make_node("Gather", [name("rows"), index], [out], name=name("Gather"), axis=2),
    ]


def _index_tables(graph, queries: str, w: int, base: str) -> tuple[list[onnx.NodeProto], str, str]:
    """Nodes computing, from the length l of `queries` [b,h,l,d], the flat gather indices

    keys   [l, l]:    i*(2w+2) + (j-i+w if |j-i| <= w else 2w+1)   (2w+1: R's appended zero)
    values [l, 2w+1]: i*(l+1) + (i+k-w if 0 <= i+k-w < l else l)   (l: p's appended zero)
    """
    name = lambda part: f"{base}/{part}"  # noqa: E731
    c = lambda part, v: _constant(graph, name(part), np.array(v, dtype=np.int64))  # noqa: E731
    n = lambda op, inputs, out, **kw: helper.make_node(op, inputs, [name(out)], name=name(out), **kw)  # noqa: E731
    nodes = [
        n("Shape", [queries], "length_1", start=2, end=3),
        n("Squeeze", [name("length_1")], "length"),
        n("Range", [c("zero", 0), name("length"), c("one", 1)], "positions"),
        n("Unsqueeze", [name("positions"), c("axis1", [1])], "i"),
        n("Unsqueeze", [name("positions"), c("axis0", [0])], "j"),
        # keys
        n("Sub", [name("j"), name("i")], "offset"),
        n("Abs", [name("offset")], "distance"),
        n("Less", [name("distance"), c("w_plus_1", w + 1)], "near"),
        n("Add", [name("offset"), c("w", w)], "column"),
        n("Where", [name("near"), name("column"), c("zero_column", 2 * w + 1)], "key_column"),
        n("Mul", [name("i"), c("key_row", 2 * w + 2)], "key_start"),
        n("Add", [name("key_start"), name("key_column")], "key_index"),
        # values
        n("Add", [name("i"), c("taps", np.arange(-w, w + 1)[None, :])], "key_position"),
        n("GreaterOrEqual", [name("key_position"), name("zero")], "from_start"),
        n("Less", [name("key_position"), name("length")], "to_end"),
        n("And", [name("from_start"), name("to_end")], "inside"),
        n("Where", [name("inside"), name("key_position"), name("length")], "value_column"),
        n("Add", [name("length"), name("one")], "value_row"),
        n("Mul", [name("i"), name("value_row")], "value_start"),
        n("Add", [name("value_start"), name("value_column")], "value_index"),
    ]
    return nodes, name("key_index"), name("value_index")


def _live(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """`nodes` less those nothing reads (the dense terms' products and skews, with their shape arithmetic)."""
    live = {v.name for v in graph.output} | _subgraph_reads(graph)
    kept = []
    for node in reversed(nodes):
        if any(out in live for out in node.output):
            kept.append(node)
            live.update(node.input)
    kept.reverse()
    return kept
