"""Streaming inside a sentence on onnxruntime: the split graph, windows, seams, fallback.

The stitched audio of a windowed decode must equal a one-shot decode of the
same latent (the noise is drawn once, by the prior, so both see the same
latent), and with the noise off it must equal the original, unsplit graph.
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper

from voxgate.engine.base import SynthesisOptions
from voxgate.engine.piper.piper_engine import FLOW_AHEAD_FRAMES, PiperEngine, embedded_voice_path
from voxgate.engine.piper.piper_voice import LoadedVoice, probe_plan
from voxgate.engine.piper.piper_split import split_voice
from voxgate.engine.piper.windows import WindowSchedule
from tests.speech import the_voice

SENTENCES = [
    "Hello there.",
    "Your package left our warehouse this morning and will arrive tomorrow.",
    "The weather today is sunny with a light breeze from the west, perfect for a long walk by the river.",
]
RATES = (1.0, 0.7, 1.6)


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    err = ref - test.astype(np.float64)
    return float(10 * np.log10((ref**2).sum() / max((err**2).sum(), 1e-20)))


def pcm16(audio: np.ndarray) -> np.ndarray:
    return (np.clip(audio.reshape(-1), -1.0, 1.0) * 32767.0).astype(np.int16)


@pytest.fixture(scope="module")
def engine() -> PiperEngine:
    return the_voice()


def stream(engine: PiperEngine, text: str, options: SynthesisOptions, slack_s):
    """Encoder step, then windows; returns the chunks and the sentence's state after encoding.

    `slack_s`: the listener's buffered audio (None: a direct call), or (slack_s, load)."""
    job = engine.start(text, options)
    job.slack_s, job.load = slack_s if isinstance(slack_s, tuple) else (slack_s, 1.0)
    assert engine.step([job])[0] is None  # the encoder pass makes no audio
    sentence = job.current
    z_p, mask = sentence.z_p.copy(), sentence.mask.copy()
    chunks = []
    while not job.done:
        chunk = engine.step([job])[0]
        assert chunk is not None
        chunks.append(chunk)
    return chunks, z_p, mask


def one_shot(engine: PiperEngine, z_p: np.ndarray, mask: np.ndarray) -> np.ndarray:
    voice = engine._voice(None)
    sessions, graphs = voice.sessions_for(1), voice.graphs
    latent = sessions.flow.run(None, voice._feed(graphs.flow, (z_p, mask)))[0]
    return pcm16(sessions.decoder.run(None, voice._feed(graphs.decoder, (latent,)))[0])


def test_the_embedded_voice_splits_with_contexts_read_off_its_graph():
    model = onnx.load(str(embedded_voice_path()))
    graphs = split_voice(model)
    # HiFi-GAN's widest path (conv_pre, ups.0 and the dilated blocks at 8x) reaches
    # 11.1 frames; the flow's four WaveNets of four 5-wide convolutions reach 32.
    assert graphs.decoder.context == 12
    assert graphs.flow is not None and graphs.flow.context == 32
    assert graphs.samples_per_frame == 256
    assert graphs.decoder.inputs == ("/Mul_7_output_0",)
    assert set(graphs.prior.inputs) == {"input", "input_lengths", "scales"}


SCHEDULES = {
    "growing": (WindowSchedule(), None),  # a direct call: windows grow from the first
    "many seams": (WindowSchedule(first=8, largest=8), 0.0),  # every window 8 frames
    "buffered": (WindowSchedule(), 1.0),  # a second of audio buffered: big windows
    # 4 streams per core, a little buffered: small windows, the flow run ahead.
    "loaded": (WindowSchedule(first=8, largest=24), (0.5, 4.0)),
}


@pytest.fixture(params=sorted(SCHEDULES))
def schedule(request, engine):
    kept = engine.schedule
    engine.schedule, slack = SCHEDULES[request.param]
    yield slack
    engine.schedule = kept


# Every sentence at the normal rate, and a slow and a fast rate on the longer ones (the rate
# changes the latent's length, so where the seams fall; the short sentence adds nothing to that).
CASES = [(text, 1.0) for text in SENTENCES] + [(SENTENCES[2], RATES[1]), (SENTENCES[1], RATES[2])]


def test_stitched_windows_equal_a_one_shot_decode_of_the_same_latent(engine, schedule):
    """Several sentences and rates, under four window schedules."""
    worst = np.inf
    for text, rate in CASES:
        chunks, z_p, mask = stream(engine, text, SynthesisOptions(rate=rate), schedule)
        streamed = np.concatenate([c.pcm for c in chunks])
        reference = one_shot(engine, z_p, mask)
        assert streamed.shape == reference.shape
        worst = min(worst, snr_db(reference, streamed) if np.any(streamed != reference) else np.inf)
        if len(reference) > 22050 and engine.schedule.largest == 8:
            assert len(chunks) > 10  # many seams were exercised
    assert worst >= 60.0, worst


def test_seams_are_clean(engine):
    """At every seam the stitched samples match the one-shot decode to within a
    rounding step of int16, and the waveform has no jump bigger than the speech has elsewhere."""
    kept, engine.schedule = engine.schedule, WindowSchedule(first=12, largest=12)
    try:
        chunks, z_p, mask = stream(engine, SENTENCES[2], SynthesisOptions(), 0.0)
    finally:
        engine.schedule = kept
    streamed = np.concatenate([c.pcm for c in chunks]).astype(np.int32)
    reference = one_shot(engine, z_p, mask).astype(np.int32)
    seams = np.cumsum([len(c.pcm) for c in chunks])[:-1]
    assert len(seams) > 10
    steps = np.abs(np.diff(streamed))
    for seam in seams:
        around = slice(seam - 64, seam + 64)
        assert np.abs(streamed[around] - reference[around]).max() <= 1
        assert steps[seam - 1] <= steps.max()


def test_streamed_audio_equals_the_unsplit_graph_with_the_noise_off():
    # The voice file's own graph computes its prior in float32; so does this engine, so that the
    # comparison is exact. The int8 prior's distance from it is test_graph_quant's.
    engine = PiperEngine(threads=1, prior_precision="float32")
    engine.load()
    session = onnxruntime.InferenceSession(str(embedded_voice_path()), providers=["CPUExecutionProvider"])
    quiet = SynthesisOptions(noise_scale=0.0, noise_w_scale=0.0)
    voice = engine._voice(None)
    for text in SENTENCES:
        for rate in RATES:
            job = engine.start(text, SynthesisOptions(noise_scale=0.0, noise_w_scale=0.0, rate=rate))
            chunks = []
            while not job.done:
                chunk = engine.step([job])[0]
                if chunk is not None:
                    chunks.append(chunk)
            streamed = np.concatenate([c.pcm for c in chunks])
            [phonemes] = voice.voice.phonemize(text)
            ids = voice.voice.phonemes_to_ids(phonemes)
            length = voice.voice.config.length_scale / rate
            whole = session.run(None, {
                "input": np.array([ids], dtype=np.int64),
                "input_lengths": np.array([len(ids)], dtype=np.int64),
                "scales": np.array([0.0, length, 0.0], dtype=np.float32),
            })[0]
            reference = pcm16(whole)
            assert streamed.shape == reference.shape
            assert snr_db(reference, streamed) >= 60.0 or np.array_equal(reference, streamed)
    del quiet


def test_the_load_time_check_sees_both_sides_of_a_window_for_each_stage(engine):
    # A receptive field read too short on either side must show as a seam on
    # the probe: some window has to take its whole context from inside it.
    graphs = engine._voice(None).graphs
    frames, schedule = probe_plan(graphs)
    for stage in (graphs.flow, graphs.decoder):
        windows, done, index = [], 0, 0
        while done < frames:
            w = schedule.next(done, frames, index, stage.context)
            windows.append(w)
            done, index = w.end, index + 1
        assert any(
            w.src_start == w.start - stage.context > 0 and w.src_end == w.end + stage.context < frames for w in windows
        )


def test_first_window_is_small_and_later_windows_grow(engine):
    chunks, _, _ = stream(engine, SENTENCES[2], SynthesisOptions(), None)
    frames = [len(c.pcm) // 256 for c in chunks]
    schedule = WindowSchedule()
    assert 8 <= frames[0] <= 16 and frames[0] == schedule.first
    assert frames[1] > frames[0] and frames[2] > frames[1]
    assert max(frames) <= schedule.largest + schedule.first // 2


def _copy_voice(tmp_path, model: onnx.ModelProto):
    path = tmp_path / "doctored.onnx"
    onnx.save(model, str(path))
    shutil.copy(str(embedded_voice_path()) + ".json", str(path) + ".json")
    return path


def _decoder_reads_the_text(model: onnx.ModelProto) -> onnx.ModelProto:
    """The audio times (1 + 0 * input_lengths): the same sound, but the decoder now
    depends on the text besides the latent, so no cut isolates it."""
    graph = model.graph
    out = graph.output[0].name
    graph.node[-1].output[0] = out + "_raw"
    for node in graph.node:
        node.input[:] = [out + "_raw" if name == out else name for name in node.input]
    graph.initializer.extend([
        helper.make_tensor("doctor_zero", onnx.TensorProto.FLOAT, [], [0.0]),
        helper.make_tensor("doctor_one", onnx.TensorProto.FLOAT, [], [1.0]),
    ])
    graph.node.extend([
        helper.make_node("Cast", ["input_lengths"], ["doctor_len"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Mul", ["doctor_len", "doctor_zero"], ["doctor_nothing"]),
        helper.make_node("Add", ["doctor_nothing", "doctor_one"], ["doctor_gain"]),
        helper.make_node("Mul", [out + "_raw", "doctor_gain"], [out]),
    ])
    return model


def _decoder_mixes_time(model: onnx.ModelProto) -> onnx.ModelProto:
    """The audio scaled by its own peak over the whole sentence: it runs and it
    splits, but a window's output depends on frames beyond any receptive field."""
    graph = model.graph
    out = graph.output[0].name
    graph.node[-1].output[0] = out + "_raw"
    graph.node.extend([
        helper.make_node("Abs", [out + "_raw"], ["doctor_abs"]),
        helper.make_node("ReduceMax", ["doctor_abs"], ["doctor_peak"], keepdims=1),
        helper.make_node("Mul", [out + "_raw", "doctor_peak"], [out]),
    ])
    return model


@pytest.mark.parametrize(
    "doctor, why",
    [(_decoder_reads_the_text, "depends on input_lengths"), (_decoder_mixes_time, "not local in time")],
)
def test_a_graph_that_cannot_be_split_falls_back_to_whole_units_and_says_why(tmp_path, caplog, monkeypatch, doctor, why):
    path = _copy_voice(tmp_path, doctor(onnx.load(str(embedded_voice_path()))))
    engine = PiperEngine(voice=str(path), threads=1)
    quantized = []  # which graphs got an int8 prior: whole ones (with the decoder), or a split prior
    original = LoadedVoice._quantized

    def spy(self, model):
        quantized.append(any(n.op_type == "ConvTranspose" for n in model.graph.node))
        return original(self, model)

    monkeypatch.setattr(LoadedVoice, "_quantized", spy)
    with caplog.at_level(logging.WARNING, logger="voxgate.engine.piper.piper_engine"):
        engine.load()
    assert quantized[-1], "the whole graph that is served got no int8 prior of its own"
    assert not engine.info()["streaming"]
    record = next(r for r in caplog.records if "whole-unit synthesis" in r.getMessage())
    assert why in record.getMessage() and str(path) in record.getMessage()
    # Whole units keep the int8 prior, whether the split failed or its windows did.
    assert engine._voice(None).int8_convs == 54 and engine.info()["prior_precision"] == "int8"
    chunks = list(engine.synthesize(SENTENCES[1], SynthesisOptions()))
    assert len(chunks) == 1 and chunks[0].duration > 2.0  # whole units still speak
    assert [w.text for w in chunks[0].words] == SENTENCES[1].split()


def test_any_voice_by_path_streams(tmp_path):
    path = _copy_voice(tmp_path, onnx.load(str(embedded_voice_path())))
    engine = PiperEngine(voice=str(path), threads=1)
    engine.load()
    assert engine.info()["streaming"]
    assert len(list(engine.synthesize(SENTENCES[1], SynthesisOptions()))) > 1
    # Nothing was written beside the model.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doctored.onnx", "doctored.onnx.json"]


def _flow_segments(
    engine: PiperEngine, load: float, slack_s: float, text: str = SENTENCES[2], schedule: WindowSchedule | None = None
) -> tuple[int, int]:
    """Flow frames run and kept for `text` (by default the long sentence, windows of 12 frames), at `load`."""
    kept, engine.schedule = engine.schedule, schedule or WindowSchedule(first=12, largest=12)
    try:
        job = engine.start(text, SynthesisOptions(noise_w_scale=0.0))  # the same durations each time
        job.load, job.slack_s = load, slack_s
        before = dict(engine.counters)
        while not job.done:
            engine.step([job])
        return tuple(engine.counters[f"flow_frames_{k}"] - before[f"flow_frames_{k}"] for k in ("run", "kept"))
    finally:
        engine.schedule = kept


def test_the_flow_runs_ahead_under_load_once_the_listener_has_audio(engine):
    # Idle worker: the first two windows each flow only what they need, so their
    # seams pay the flow's context (32 frames each side) again.
    run_idle, kept = _flow_segments(engine, load=1.0, slack_s=0.5)
    # Under load with audio buffered, the rest of the sentence flows in one segment
    # from the first window on: no flow seam at all in a sentence under 512 frames.
    run_loaded, kept_loaded = _flow_segments(engine, load=4.0, slack_s=0.5)
    assert kept == kept_loaded and kept < FLOW_AHEAD_FRAMES  # one segment can hold it
    assert run_loaded == kept_loaded
    assert run_idle >= kept + 2 * 32
    # A listener with nothing buffered, or too little to cover the longer step,
    # still gets the short first segment.
    for slack_s in (0.0, 0.01):
        run_waiting, _ = _flow_segments(engine, load=4.0, slack_s=slack_s)
        assert run_waiting > kept


def test_a_hurried_flow_takes_a_short_sentence_whole(engine):
    # The first window of 12 frames needs the flow up to 24 frames (the
    # decoder's 12 of context), and the flow computes 32 more of its own context:
    # 56 frames. "Hello there." is 69 frames: a second segment would start over
    # from frame 0 (24 flowed, less 32 of context) to keep 45, so the first
    # segment runs the 13 left instead.
    run, kept = _flow_segments(engine, load=1.0, slack_s=0.0, text="Hello there.", schedule=WindowSchedule())
    assert 56 < kept <= 56 + 32  # (the premise: the sentence's length)
    assert run == kept
    # 109 frames leave 53 after the first segment, more than its context: the
    # first audio does not wait for them, and the seam runs context again.
    run, kept = _flow_segments(engine, load=1.0, slack_s=0.0, text="It should arrive tomorrow.", schedule=WindowSchedule())
    assert kept > 56 + 32  # (the premise)
    assert run > kept
