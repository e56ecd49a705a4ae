"""Reading a Piper `.onnx` voice's weights for the torch port (`torch_vits.py`), by module name.

The ONNX export keeps most parameters under their module names (`enc_p.*`,
`dp.*`, `flow.*`, `dec.*`). Weight norm is folded on export, and the folded
flow weights lose their names (`onnx::Conv_1234`); those are named again from
the graph: the node that consumes them still carries the module's bias name
and its own `/flow/flows.6/enc/in_layers.0/Conv` path, and as a last resort the
graph order of the flow's convolutions. The convolution attributes the graph
holds (strides, pads, dilations) come along, for the hyperparameters the
weight shapes do not tell. Needs onnx and numpy, not torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class OnnxVoice:
    """Weights of a Piper voice by module name, plus the conv attributes the graph holds."""

    weights: dict[str, np.ndarray]
    conv_attrs: dict[str, dict[str, list[int]]] = field(default_factory=dict)

    def count(self, pattern: str) -> int:
        rx = re.compile(pattern)
        return len({m.group(1) for k in self.weights if (m := rx.match(k))})


def is_module_name(name: str) -> bool:
    return bool(re.match(r"^(enc_p|dp|flow|dec|emb_g)\.", name))


def _module_path_from_node(node_name: str) -> str | None:
    # "/flow/flows.6/enc/in_layers.0/Conv" -> "flow.flows.6.enc.in_layers.0"
    parts = [p for p in node_name.split("/") if p]
    if len(parts) < 2:
        return None
    return ".".join(parts[:-1])


def read_onnx_voice(path: str | Path) -> OnnxVoice:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    weights = {k: v.copy() for k, v in inits.items() if is_module_name(k)}
    conv_attrs: dict[str, dict[str, list[int]]] = {}
    unnamed_flow_convs: list[str] = []  # folded flow weights we could not name, in graph order
    first_input = graph.input[0].name if graph.input else "input"

    for node in graph.node:
        if node.op_type in ("Conv", "ConvTranspose") and len(node.input) >= 2:
            weight = node.input[1]
            module = None
            if len(node.input) > 2 and node.input[2].endswith(".bias") and is_module_name(node.input[2]):
                module = node.input[2][: -len(".bias")]
            elif is_module_name(weight) and weight.endswith(".weight"):
                module = weight[: -len(".weight")]
            else:
                module = _module_path_from_node(node.name)
                if module is not None and not is_module_name(module):
                    module = None
            attrs = {a.name: list(onnx.helper.get_attribute_value(a)) for a in node.attribute if a.ints}
            if module is None:
                if weight in inits:
                    unnamed_flow_convs.append(weight)
                continue
            conv_attrs[module] = attrs
            name = module + ".weight"
            if name not in weights and weight in inits:
                weights[name] = inits[weight].copy()
        elif node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == first_input:
            # The phoneme embedding; exports call it "sid" or "onnx::Gather_*".
            if node.input[0] in inits and "enc_p.emb.weight" not in weights:
                weights["enc_p.emb.weight"] = inits[node.input[0]].copy()
        elif node.op_type == "Mul" and node.name.startswith("/dp/flows.0/"):
            # ElementwiseAffine in reverse multiplies by exp(-logs); the export folds
            # that constant, so logs is recovered from it.
            for name in node.input:
                if name in inits and not is_module_name(name) and "dp.flows.0.logs" not in weights:
                    weights["dp.flows.0.logs"] = -np.log(inits[name].astype(np.float64)).astype(np.float32)

    if unnamed_flow_convs:
        _name_flow_convs_by_position(weights, unnamed_flow_convs, inits)
    return OnnxVoice(weights=weights, conv_attrs=conv_attrs)


def _name_flow_convs_by_position(weights: dict, unnamed: list[str], inits: dict) -> None:
    """Name folded WN weights by the order the reverse flow runs them.

    Reverse inference runs the coupling layers last to first, and inside each
    one in_layers.i then res_skip_layers.i, which is the graph's order.
    """
    couplings = sorted(
        {int(m.group(1)) for k in weights if (m := re.match(r"^flow\.flows\.(\d+)\.pre\.weight$", k))},
        reverse=True,
    )
    expected: list[str] = []
    for c in couplings:
        layers = sorted(
            {int(m.group(1)) for k in weights if (m := re.match(rf"^flow\.flows\.{c}\.enc\.in_layers\.(\d+)\.bias$", k))}
        )
        for i in layers:
            expected.append(f"flow.flows.{c}.enc.in_layers.{i}.weight")
            expected.append(f"flow.flows.{c}.enc.res_skip_layers.{i}.weight")
    missing = [n for n in expected if n not in weights]
    if len(missing) != len(unnamed):
        raise ValueError(
            f"cannot map {len(unnamed)} unnamed conv weights onto {len(missing)} missing flow weights"
        )
    for name, src in zip(missing, unnamed):
        weights[name] = inits[src].copy()


def is_unused(name: str) -> bool:
    # Training-only branches sometimes survive an export; inference has no module for them.
    return name.startswith(("dp.post_", "enc_q.", "dp.flows.1."))
