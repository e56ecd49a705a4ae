"""Layer-norm fusion of a voice's graph (engine/piper/graph_fuse.py): the same numbers in fewer ops, near misses left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from voxgate.engine.piper.graph_fuse import LAYER_NORM_OPSET, fuse_layer_norms
from voxgate.engine.piper.piper_voice import embedded_voice_path

C = 6


def layer_norm_graph(*, axes=(-1,), exponent=2.0, eps=1e-5, gamma_shape=(C,), tap=None, opset=15) -> onnx.ModelProto:
    """VITS's channel layer norm as torch exports it: transpose, the nine ops, transpose back.

    `tap` names an intermediate to expose as a second output (a use outside the pattern)."""
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(np.array(exponent, dtype=np.float32), "two"),
        numpy_helper.from_array(np.array(eps, dtype=np.float32), "eps"),
        numpy_helper.from_array(rng.standard_normal(gamma_shape).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.standard_normal(gamma_shape).astype(np.float32), "beta"),
    ]
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("ReduceMean", ["xt"], ["mean"], axes=list(axes)),
        helper.make_node("Sub", ["xt", "mean"], ["centred"]),
        helper.make_node("Pow", ["centred", "two"], ["squared"]),
        helper.make_node("ReduceMean", ["squared"], ["var"], axes=list(axes)),
        helper.make_node("Add", ["var", "eps"], ["var_eps"]),
        helper.make_node("Sqrt", ["var_eps"], ["std"]),
        helper.make_node("Div", ["centred", "std"], ["normed"]),
        helper.make_node("Mul", ["normed", "gamma"], ["scaled"]),
        helper.make_node("Add", ["scaled", "beta"], ["shifted"]),
        helper.make_node("Transpose", ["shifted"], ["y"], perm=[0, 2, 1]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", C, "t"])]
    if tap:
        outputs.append(helper.make_tensor_value_info(tap, TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", C, "t"])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_the_exact_pattern_becomes_one_node_with_the_same_output():
    x = np.random.default_rng(0).standard_normal((2, C, 17)).astype(np.float32) * 3 + 1
    original = layer_norm_graph()
    fused = layer_norm_graph()
    assert fuse_layer_norms(fused) == 1
    assert op_types(fused) == ["Transpose", "LayerNormalization", "Transpose"]
    assert fused.opset_import[0].version == LAYER_NORM_OPSET
    np.testing.assert_allclose(run(fused, x), run(original, x), rtol=1e-5, atol=1e-5)
    onnx.checker.check_model(fused)


@pytest.mark.parametrize(
    "near_miss",
    [
        {"axes": (1,)},  # over time, not the last axis
        {"axes": (-1, -2)},
        {"exponent": 3.0},
        {"gamma_shape": (1, C)},  # not a 1-D gamma
        {"tap": "centred"},  # an intermediate used outside the pattern
        {"tap": "std"},
        {"gamma_shape": (1,)},  # one value broadcast over every channel
    ],
)
def test_near_misses_are_left_as_they_were(near_miss):
    model = layer_norm_graph(**near_miss)
    before = op_types(model)
    assert fuse_layer_norms(model) == 0
    assert op_types(model) == before
    assert model.opset_import[0].version == 15


def test_an_intermediate_read_inside_a_subgraph_keeps_the_pattern():
    model = layer_norm_graph()
    then = helper.make_graph([helper.make_node("Identity", ["centred"], ["picked"])], "then", [],
                             [helper.make_tensor_value_info("picked", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["kept"])], "else", [],
                              [helper.make_tensor_value_info("kept", TensorProto.FLOAT, None)])
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "cond"))
    model.graph.node.append(helper.make_node("If", ["cond"], ["branch"], then_branch=then, else_branch=other))
    model.graph.output.append(helper.make_tensor_value_info("branch", TensorProto.FLOAT, None))
    assert fuse_layer_norms(model) == 0
    x = np.random.default_rng(3).standard_normal((1, C, 5)).astype(np.float32)
    run(model, x)  # still loads and runs


def test_a_graph_below_opset_15_is_not_rewritten():
    # Raising it to 17 would change other ops' meaning (Softmax's axis at 13).
    model = layer_norm_graph(opset=13)
    assert fuse_layer_norms(model) == 0
    assert model.opset_import[0].version == 13


def test_a_graph_with_a_roialign_keeps_its_opset_and_its_norms():
    model = layer_norm_graph()
    model.graph.node.append(helper.make_node("RoiAlign", ["x4", "rois", "idx"], ["pooled"]))
    assert fuse_layer_norms(model) == 0
    assert model.opset_import[0].version == 15


def test_an_epsilon_that_can_be_fed_at_run_time_is_not_baked_in():
    model = layer_norm_graph()
    model.graph.input.append(helper.make_tensor_value_info("eps", TensorProto.FLOAT, []))
    assert fuse_layer_norms(model) == 0


def test_an_opset_18_graph_with_axes_as_an_input_fuses_too():
    model = layer_norm_graph(opset=18)
    for node in model.graph.node:
        if node.op_type == "ReduceMean":
            del node.attribute[:]
            node.input.append("axes")
    model.graph.initializer.append(numpy_helper.from_array(np.array([-1], dtype=np.int64), "axes"))
    x = np.random.default_rng(2).standard_normal((1, C, 9)).astype(np.float32)
    expected = run(model, x)
    assert fuse_layer_norms(model) == 1
    assert model.opset_import[0].version == 18
    np.testing.assert_allclose(run(model, x), expected, rtol=1e-5, atol=1e-5)


def test_the_embedded_voice_fuses_every_layer_norm_and_its_output_stays_within_rounding():
    path = str(embedded_voice_path())
    fused = onnx.load(path)
    # 12 in the text encoder, 24 in the duration predictor's convolutions.
    assert fuse_layer_norms(fused) == 36
    assert "Sqrt" not in [n.op_type for n in fused.graph.node if "norm" in n.name]
    original = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    rewritten = onnxruntime.InferenceSession(fused.SerializeToString(), providers=["CPUExecutionProvider"])
    ids = [1, 0, 20, 0, 59, 0, 24, 0, 27, 0, 3, 0, 35, 0, 14, 0, 51, 0, 100, 0, 10, 0, 2]
    for length_scale in (0.7, 1.0, 1.5):
        feed = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array([0.0, length_scale, 0.0], dtype=np.float32),  # no noise: deterministic
        }
        a, b = original.run(None, feed)[0].reshape(-1), rewritten.run(None, feed)[0].reshape(-1)
        assert a.shape == b.shape
        snr = 10 * np.log10((a.astype(np.float64) ** 2).sum() / max(((a - b).astype(np.float64) ** 2).sum(), 1e-20))
        assert snr >= 60.0
