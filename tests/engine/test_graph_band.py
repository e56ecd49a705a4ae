"""Banded relative-position attention (engine/piper/graph_band.py): the same output without the dense position terms."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime
import pytest

from voxgate.engine.piper import graph_band, piper_voice
from voxgate.engine.piper.graph_band import band_relative_attention
from voxgate.engine.piper.graph_fuse import fuse_layer_norms
from voxgate.engine.piper.piper_voice import LoadedVoice, embedded_voice_path

# Real phoneme ids of the joe voice ("Thanks for waiting ..." and shorter cuts of it).
IDS = [1, 0, 20, 0, 59, 0, 24, 0, 27, 0, 3, 0, 35, 0, 14, 0, 51, 0, 100, 0, 10, 0, 2]


@pytest.fixture(scope="module")
def voice_graphs():
    original = onnx.load(str(embedded_voice_path()))
    fuse_layer_norms(original)
    banded = onnx.ModelProto()
    banded.CopyFrom(original)
    terms = band_relative_attention(banded)
    return original, banded, terms


def session(model: onnx.ModelProto):
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_every_layer_loses_its_dense_position_products(voice_graphs):
    original, banded, terms = voice_graphs
    assert terms == 12  # keys and values in each of the text encoder's 6 layers
    names = lambda m: {n.name for n in m.graph.node}  # noqa: E731
    dense = {f"/enc_p/encoder/attn_layers.{k}/MatMul_{m}" for k in range(6) for m in (1, 3)}
    assert dense <= names(original)
    assert not dense & names(banded)
    assert len(banded.graph.node) < len(original.graph.node) - 300  # the skews and their shape arithmetic go too
    # One table of indices for the whole graph, one gather per term.
    assert sum(n.op_type == "Range" and "relative_band" in n.name for n in banded.graph.node) == 1
    assert sum(n.op_type == "Gather" and n.name.endswith("/band/Gather") for n in banded.graph.node) == 12
    # The tables now hold their 9 rows alone: nothing pads them to the sentence's length.
    tables = {i.name for i in original.graph.initializer if "emb_rel" in i.name}
    assert len(tables) == 12 and not tables & {i.name for i in banded.graph.initializer}


@pytest.fixture(scope="module")
def voice_sessions(voice_graphs):
    """Both graphs loaded once: a session of the whole voice takes about half a second to make."""
    original, banded, _ = voice_graphs
    return session(original), session(banded)


@pytest.mark.parametrize("length", [1, 2, 4, 5, 9, 10, len(IDS)])
def test_the_output_is_the_originals_at_every_length_around_the_window(voice_sessions, length):
    """Lengths below, at and past the window (w = 4, 2w + 1 = 9): the band's edges are where an index goes wrong."""
    original, banded = voice_sessions
    ids = IDS[:length]
    for length_scale in (0.8, 1.3):
        feed = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array([0.0, length_scale, 0.0], dtype=np.float32),  # no noise: deterministic
        }
        a = original.run(None, feed)[0].reshape(-1).astype(np.float64)
        b = banded.run(None, feed)[0].reshape(-1).astype(np.float64)
        assert a.shape == b.shape
        snr = 10 * np.log10(max((a**2).sum(), 1e-20) / max(((a - b) ** 2).sum(), 1e-30))
        assert snr >= graph_band.MIN_BAND_SNR_DB


def test_a_dense_term_read_as_a_graph_output_is_kept(voice_graphs):
    original, _, _ = voice_graphs
    model = onnx.ModelProto()
    model.CopyFrom(original)
    tapped = next(n for n in model.graph.node if n.name == "/enc_p/encoder/attn_layers.2/MatMul_3").output[0]
    model.graph.output.append(onnx.helper.make_tensor_value_info(tapped, onnx.TensorProto.FLOAT, None))
    assert band_relative_attention(model) == 11
    assert "/enc_p/encoder/attn_layers.2/MatMul_3" in {n.name for n in model.graph.node}


def test_a_graph_without_relative_attention_is_left_alone():
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.ones((1, 9, 4), dtype=np.float32), "table")  # the right shape, used otherwise
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "table"], ["y"])], "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 9, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 9, 4])], [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()
    assert band_relative_attention(model) == 0
    assert model.SerializeToString() == before


def test_the_loaded_voice_serves_the_banded_prior():
    loaded = LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], threads=1)
    assert loaded.banded_terms == 12
    assert not any(n.name.endswith("/MatMul_1") and "attn_layers" in n.name for n in loaded.graphs.prior.model.graph.node)


def test_a_banded_prior_that_fails_its_check_is_not_served_and_the_log_says_why(monkeypatch, caplog):
    monkeypatch.setattr(piper_voice, "MIN_BAND_SNR_DB", 1e9)  # no rewrite comes this close
    with caplog.at_level(logging.WARNING, logger="voxgate.engine.piper.piper_voice"):
        loaded = LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], threads=1)
    assert loaded.banded_terms == 0
    assert any(n.name.endswith("/MatMul_1") and "attn_layers" in n.name for n in loaded.graphs.prior.model.graph.node)
    assert "keeps its dense position terms" in caplog.text and "latent means" in caplog.text
    assert loaded.int8_convs == 54  # the next rewrite still runs, on the original


def test_a_rewrite_that_breaks_the_graph_leaves_the_voice_loading(monkeypatch, caplog):
    def broken(model):
        count = band_relative_attention(model)
        gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.name.endswith("/band/Gather"))
        gather.input[1] = "/no/such/tensor"
        return count

    monkeypatch.setattr(piper_voice, "band_relative_attention", broken)
    with caplog.at_level(logging.WARNING, logger="voxgate.engine.piper.piper_voice"):
        loaded = LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], threads=1)
    assert loaded.banded_terms == 0 and loaded.graphs is not None
    assert "the check could not run" in caplog.text


def test_whole_units_get_the_banded_prior_too():
    voice = LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], threads=1, split=False, spin="never")
    assert voice.graphs is None and voice.banded_terms == 12


def test_the_check_runs_inputs_shorter_than_the_window():
    """The export takes another branch below w + 1 = 5 ids; the load-time check must see it for any voice."""
    loaded = LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], threads=1, spin="never")
    lengths = sorted(len(feed["input"][0]) for feed in loaded._probe_feeds())
    assert lengths[0] < 5 and 5 in lengths and lengths[-1] > 100
