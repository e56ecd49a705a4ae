"""The prior's convolutions in int8 (engine/piper/graph_quant.py): close to float where it applies,
nothing outside the prior touched, near misses left alone, and the voice checked before it is used."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from voxgate.engine.piper import graph_quant
from voxgate.engine.base import EngineError, SynthesisOptions
from voxgate.engine.piper.graph_quant import MAX_DURATION_DIFF, MIN_INNER, compare_priors, quantize_prior
from voxgate.engine.piper.piper_engine import PiperEngine
from voxgate.engine.piper.piper_split import SplitError
from voxgate.engine.piper.piper_voice import PRIOR_PROBES, LoadedVoice, embedded_voice_path

C, O, K = 128, 96, 3


def prior_like(*, kernel=K, group=1, strides=(1,), dilations=(1,), pads=(1, 1), in_channels=C, weight_input=False,
               after_noise=False, opset=15) -> onnx.ModelProto:
    """x -> Conv -> the noise Add (VITS's z_p) -> one more Conv after it (the flow's side).

    The first Conv is in the prior; the second, after z_p, must never be rewritten."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((O, in_channels // group, kernel)) * 0.1).astype(np.float32)
    inits = [
        numpy_helper.from_array(np.ascontiguousarray(w), "w"),
        numpy_helper.from_array(rng.standard_normal(O).astype(np.float32), "b"),
        numpy_helper.from_array((rng.standard_normal((O, O, 3)) * 0.1).astype(np.float32), "w_flow"),
    ]
    conv = helper.make_node("Conv", ["x", "w", "b"], ["h"], kernel_shape=[kernel], group=group, strides=list(strides),
                            dilations=list(dilations), pads=list(pads))
    nodes = [
        conv,
        helper.make_node("RandomNormalLike", ["h"], ["noise"]),
        helper.make_node("Mul", ["noise", "zero"], ["quiet"]),
        helper.make_node("Add", ["h", "quiet"], ["z_p"]),
        helper.make_node("Conv", ["z_p", "w_flow"], ["flowed"], kernel_shape=[3], pads=[1, 1]),
        helper.make_node("Relu", ["flowed"], ["y"]),
    ]
    inits.append(numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, in_channels, "t"])]
    if weight_input:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, list(w.shape)))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, O, "t"]),
               helper.make_tensor_value_info("z_p", TensorProto.FLOAT, [1, O, "t"])]
    graph = helper.make_graph(nodes, "prior", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# The rewrite's distance from float, by weight bits. 8 bits only where this processor adds u8 x s8
# pairs without 16-bit overflow (graph_quant.weight_bits): forced on an AVX2-only x86 (an EPYC without
# VNNI), the overflow alone took one case here to 29.3 dB, the reason the product gives it 7 bits.
BITS = graph_quant.weight_bits()
MIN_SNR_DB = {8: 30.0, 7: 24.0}


def snr_db(want: np.ndarray, got: np.ndarray) -> float:
    return float(10 * np.log10((want.astype(np.float64) ** 2).sum() / ((want - got).astype(np.float64) ** 2).sum()))


@pytest.mark.parametrize("pads", [(1, 1), (0, 0), (2, 0)])
@pytest.mark.parametrize("bits", sorted({BITS, 7}))
def test_a_convolution_in_the_prior_becomes_an_int8_product_close_to_float(pads, bits):
    x = np.random.default_rng(1).standard_normal((1, C, 37)).astype(np.float32)
    original = prior_like(pads=pads)
    rewritten = prior_like(pads=pads)
    assert quantize_prior(rewritten, bits=bits) == 1
    onnx.checker.check_model(rewritten)
    ops = op_types(rewritten)
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" in ops
    assert ops.count("Conv") == 1  # the flow's, after z_p, stays float
    want, got = run(original, x)[1], run(rewritten, x)[1]
    assert got.shape == want.shape
    assert snr_db(want, got) >= MIN_SNR_DB[bits]


def test_new_names_never_collide_and_the_float_weights_go():
    model = prior_like()
    # A tensor already named where the rewrite would put its own.
    model.graph.node.insert(0, helper.make_node("Identity", ["x"], ["h/int8/padded"]))
    model.graph.output.append(helper.make_tensor_value_info("h/int8/padded", TensorProto.FLOAT, [1, C, "t"]))
    x = np.random.default_rng(4).standard_normal((1, C, 21)).astype(np.float32)
    want = run(prior_like(), x)[1]
    assert quantize_prior(model, bits=BITS) == 1
    onnx.checker.check_model(model)
    got = run(model, x)[1]
    assert snr_db(want, got) >= MIN_SNR_DB[BITS]
    names = [i.name for i in model.graph.initializer]
    assert "w" not in names and "b" not in names and "w_flow" in names  # the replaced float weights are gone


@pytest.mark.parametrize(
    "near_miss",
    [
        {"kernel": 1, "pads": (0, 0), "in_channels": 128},  # pointwise with too little input (128 < MIN_INNER)
        {"group": 2},
        {"strides": (2,)},
        {"dilations": (2,)},
        {"in_channels": 16},  # too little input per output to pay off (16 * 3 < MIN_INNER)
        {"weight_input": True},  # a weight that can be fed at run time is no constant
        {"opset": 13},
    ],
)
def test_near_misses_stay_float(near_miss):
    model = prior_like(**near_miss)
    before = op_types(model)
    assert quantize_prior(model, bits=8) == 0
    assert op_types(model) == before


def test_the_threshold_is_what_the_near_misses_above_rely_on():
    assert 16 * K < MIN_INNER <= C * K and C < MIN_INNER


@pytest.mark.parametrize(
    "convs",
    [
        [(1, (0, 0))] * 3,  # VITS's attention: q, k and v of one input
        [(3, (1, 1)), (3, (2, 0)), (1, (0, 0))],  # kernels and pads that differ: each pads the shared integers itself
    ],
)
def test_convolutions_reading_one_input_share_its_quantization(convs):
    """One quantization serves every convolution that reads the same input, whatever their kernels and pads."""
    x = np.random.default_rng(5).standard_normal((1, 256, 29)).astype(np.float32)
    rng = np.random.default_rng(6)
    inits = [
        numpy_helper.from_array((rng.standard_normal((O, 256, kernel)) * 0.1).astype(np.float32), f"w{k}")
        for k, (kernel, _) in enumerate(convs)
    ]
    nodes = [
        helper.make_node("Conv", ["x", f"w{k}"], [f"h{k}"], kernel_shape=[kernel], pads=list(pads))
        for k, (kernel, pads) in enumerate(convs)
    ]
    nodes += [
        helper.make_node("Sum", ["h0", "h1", "h2"], ["h"]),
        helper.make_node("RandomNormalLike", ["h"], ["noise"]),
        helper.make_node("Mul", ["noise", "zero"], ["quiet"]),
        helper.make_node("Add", ["h", "quiet"], ["z_p"]),
    ]
    inits.append(numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"))
    graph = helper.make_graph(nodes, "shared", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 256, "t"])],
                              [helper.make_tensor_value_info("z_p", TensorProto.FLOAT, [1, O, "t"])], inits)
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)], ir_version=8)
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(original)
    assert quantize_prior(rewritten, bits=BITS) == 3
    ops = op_types(rewritten)
    assert ops.count("MatMulInteger") == 3 and ops.count("DynamicQuantizeLinear") == 1 and "Conv" not in ops
    assert ops.count("Concat") == sum(kernel > 1 for kernel, _ in convs)  # one tap: no columns to join
    assert ops.count("Pad") == sum(any(pads) for _, pads in convs)
    want, got = run(original, x)[0], run(rewritten, x)[0]
    assert got.shape == want.shape
    assert snr_db(want, got) >= MIN_SNR_DB[BITS]


def test_without_the_noise_add_nothing_is_rewritten():
    model = prior_like()
    del model.graph.node[1:]  # no random node: the prior cannot be told from the flow
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, None))
    with pytest.raises(SplitError):
        quantize_prior(model, bits=8)
    assert op_types(model) == ["Conv"]


def test_weight_bits_follow_the_processor(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    real_open = open

    def fake_open(path, *args, **kwargs):
        return real_open(cpuinfo if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr(graph_quant.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr("builtins.open", fake_open)
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert graph_quant.weight_bits() == 8
    cpuinfo.write_text("flags\t\t: fpu avx2 fma\n")  # u8 x s8 pairs would overflow 16 bits
    assert graph_quant.weight_bits() == 7
    monkeypatch.setattr(graph_quant.platform, "machine", lambda: "aarch64")
    assert graph_quant.weight_bits() == 8


def _prior_outputs(durations: list[int], means: np.ndarray) -> list[np.ndarray]:
    """What a run of a prior returns to compare_priors: z_p (each id's mean over its frames), the mask, the durations."""
    columns = [means[:, i : i + 1].repeat(d, axis=1) for i, d in enumerate(durations)]
    z_p = np.concatenate(columns, axis=1)[None].astype(np.float32)
    return [z_p, np.ones((1, 1, z_p.shape[2]), np.float32), np.array(durations, dtype=np.float32)]


def test_compare_priors_passes_small_differences_and_names_large_ones():
    rng = np.random.default_rng(2)
    means = rng.standard_normal((8, 40))
    durations = list(rng.integers(0, 6, 40))
    close = means + rng.standard_normal(means.shape) * 0.01  # 40 dB
    far = means + rng.standard_normal(means.shape) * 0.2  # 14 dB
    shifted = [d + 1 for d in durations]  # every id one frame longer
    float_run = lambda feed: _prior_outputs(durations, means)  # noqa: E731
    assert compare_priors(float_run, lambda feed: _prior_outputs(durations, close), [{}], True) == ""
    assert "dB" in compare_priors(float_run, lambda feed: _prior_outputs(durations, far), [{}], True)
    assert "durations" in compare_priors(float_run, lambda feed: _prior_outputs(shifted, means), [{}], True)
    # Without the durations, the frames must match and z_p is compared frame by frame.
    assert compare_priors(float_run, lambda feed: _prior_outputs(durations, close), [{}], False) == ""
    assert "dB" in compare_priors(float_run, lambda feed: _prior_outputs(durations, far), [{}], False)
    assert "frames" in compare_priors(float_run, lambda feed: _prior_outputs(shifted, means), [{}], False)


@pytest.fixture(scope="module")
def int8_voice():
    return LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], 1, spin="never")


def test_the_embedded_voice_gets_its_prior_convolutions_in_int8(int8_voice):
    # Per layer of the text encoder's six: the feed-forward pair and the attention's q, k, v and
    # output projections; then the encoder's output projection and 17 of the duration predictor's.
    assert int8_voice.int8_convs == 54
    assert int8_voice.why_float == ""
    prior = [n for n in int8_voice.graphs.prior.model.graph.node]
    products = [n.name for n in prior if n.op_type == "MatMulInteger"]
    assert len(products) == 54
    assert sum("ffn_layers" in n for n in products) == 12 and sum("attn_layers" in n for n in products) == 24
    assert sum(n.startswith("/dp/") for n in products) == 17
    # One quantization per input: q, k and v read one in each layer, and the encoder's
    # output feeds both its projection and the duration predictor.
    assert sum(n.op_type == "DynamicQuantizeLinear" for n in prior) == 54 - 2 * 6 - 1
    # Only the depthwise and single-channel convolutions stay float.
    assert all(n.name.startswith("/dp/") for n in prior if n.op_type == "Conv")
    # The audio-making stages are untouched.
    for stage in (int8_voice.graphs.flow, int8_voice.graphs.decoder):
        assert "MatMulInteger" not in op_types(stage.model)


def test_the_int8_prior_stays_far_inside_the_voices_own_sampling_noise(int8_voice):
    """The figure the load-time check rests on, on sentences it was not checked on: the int8
    prior moves an id's duration by a hundredth of a frame on average, where two float runs
    with the voice's own noise move it by most of a frame."""
    float_voice = LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], 1, spin="never", precision="float32")
    assert float_voice.int8_convs == 0
    voice = int8_voice.voice
    config = voice.config
    int8_prior = int8_voice.sessions_for(1).prior
    float_prior = float_voice.sessions_for(1).prior
    int8_diffs, noise_diffs = [], []
    for text in ("The meeting has been moved to three in the afternoon.", "Please hold the line while I check."):
        assert text not in PRIOR_PROBES
        ids = voice.phonemes_to_ids([p for s in voice.phonemize(text) for p in s])
        feed = {"input": np.array([ids], dtype=np.int64), "input_lengths": np.array([len(ids)], dtype=np.int64)}
        quiet = {**feed, "scales": np.array([0.0, config.length_scale, 0.0], dtype=np.float32)}
        noisy = {**feed, "scales": np.array([config.noise_scale, config.length_scale, config.noise_w_scale], dtype=np.float32)}
        a, b = float_prior.run(None, quiet)[-1], int8_prior.run(None, quiet)[-1]
        int8_diffs.append(np.abs(a - b).mean())
        c, d = float_prior.run(None, noisy)[-1], float_prior.run(None, noisy)[-1]
        noise_diffs.append(np.abs(c - d).mean())
    assert np.mean(int8_diffs) < MAX_DURATION_DIFF
    assert np.mean(noise_diffs) > 5 * max(np.mean(int8_diffs), 0.02)


def test_a_prior_that_fails_the_check_stays_float_and_the_log_says_why(monkeypatch, caplog):
    monkeypatch.setattr(graph_quant, "MIN_LATENT_SNR_DB", 200.0)  # no int8 prior comes this close
    with caplog.at_level(logging.WARNING, logger="voxgate.engine.piper.piper_voice"):
        voice = LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], 1, spin="never")
    assert voice.int8_convs == 0
    assert "dB" in voice.why_float
    assert "MatMulInteger" not in op_types(voice.graphs.prior.model)
    assert any("stays float32" in r.getMessage() for r in caplog.records)


def test_a_check_that_cannot_run_keeps_the_voice_loading_in_float32(monkeypatch):
    def broken(self, model, rewritten, **limits):
        raise RuntimeError("no phonemizer for this language")

    monkeypatch.setattr(LoadedVoice, "_check_prior", broken)
    voice = LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], 1, spin="never")
    assert voice.int8_convs == 0 and "could not run" in voice.why_float
    assert voice.graphs is not None  # still streams


def test_the_default_int8_path_streams_exactly_what_int8_whole_units_say():
    """Parity on the default path: the same int8 prior, split or whole, gives the same audio with the noise off."""
    streamed = PiperEngine(threads=1, spin="never")
    whole = PiperEngine(threads=1, spin="never", split=False)
    streamed.load()
    whole.load()
    assert streamed.info()["prior_precision"] == whole.info()["prior_precision"] == "int8"
    quiet = SynthesisOptions(noise_scale=0.0, noise_w_scale=0.0)
    for text in ("The meeting has been moved to three in the afternoon.", "Please hold the line."):
        a = np.concatenate([c.pcm for c in streamed.synthesize(text, quiet)]).astype(np.float64)
        b = np.concatenate([c.pcm for c in whole.synthesize(text, quiet)]).astype(np.float64)
        assert a.shape == b.shape
        assert np.array_equal(a, b) or 10 * np.log10((b**2).sum() / ((a - b) ** 2).sum()) >= 60.0


def test_float32_is_a_setting_and_a_wrong_precision_is_refused():
    engine = PiperEngine(threads=1, prior_precision="float32", spin="never")
    engine.load()
    assert engine.info()["prior_precision"] == "float32"
    assert "float32" in PiperEngine.describe(engine._voice(None))
    with pytest.raises(EngineError, match="--engine-prior-precision"):
        PiperEngine(prior_precision="int4")


def test_a_voice_that_synthesizes_whole_units_gets_the_int8_prior_too():
    voice = LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], 1, split=False, spin="never")
    assert voice.graphs is None and voice.int8_convs == 54


def test_the_prior_precision_is_a_setting_checked_at_start_and_handed_to_piper_only():
    from voxgate.config import ConfigError, Settings, settings_from
    from voxgate.gateway.gateway import _engine_client

    settings = settings_from(None, {"VOXGATE_ENGINE_PRIOR_PRECISION": "float32"})
    assert _engine_client(settings).config.engine_options["prior_precision"] == "float32"
    assert _engine_client(Settings()).config.engine_options["prior_precision"] == "int8"
    assert _engine_client(Settings(engine="tone")).config.engine_options == {}
    with pytest.raises(ConfigError, match="--engine-prior-precision 'half'"):
        Settings(engine_prior_precision="half").check()


def test_a_full_rewrite_that_fails_falls_back_to_the_feed_forward_convolutions(monkeypatch, caplog):
    """joe's full int8 prior moves durations by about 0.050 frames per id, its feed-forward layers alone
    by about 0.014: a limit between the two keeps the second, and the log says what stayed float."""
    monkeypatch.setattr(graph_quant, "MAX_DURATION_DIFF", 0.025)
    with caplog.at_level(logging.WARNING, logger="voxgate.engine.piper.piper_voice"):
        voice = LoadedVoice(embedded_voice_path(), ["CPUExecutionProvider"], 1, spin="never")
    assert voice.int8_convs == 12 and voice.why_float == ""
    products = [n.name for n in voice.graphs.prior.model.graph.node if n.op_type == "MatMulInteger"]
    assert all("ffn_layers" in n for n in products)
    assert any("pointwise convolutions stay float32" in r.getMessage() for r in caplog.records)
