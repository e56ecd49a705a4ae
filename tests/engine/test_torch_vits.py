"""The torch port of Piper's VITS: parity with onnxruntime, streaming seams, batching."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason='torch is an optional extra (pip install ".[gpu]" in the clone)')

from voxgate.engine.base import EngineError, SynthesisOptions  # noqa: E402
from voxgate.engine.piper.piper_engine import embedded_voice_path  # noqa: E402
from voxgate.engine.torch_voices.torch_engine import TorchEngine  # noqa: E402
from voxgate.engine.torch_voices.torch_vits import Vits  # noqa: E402
from voxgate.engine.torch_voices.torch_vits_load import _name_flow_convs_by_position, read_onnx_voice  # noqa: E402

LONG = "The weather today is sunny with a light breeze from the west, perfect for a long walk."
QUIET = SynthesisOptions(noise_scale=0.0, noise_w_scale=0.0)


def snr_db(ref: np.ndarray, test: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    err = ref - test.astype(np.float64)
    return float(10 * np.log10((ref**2).sum() / max((err**2).sum(), 1e-20)))


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    e = TorchEngine(device="cpu", threads=2)
    e.load()
    return e


@pytest.fixture(scope="module")
def model(engine: TorchEngine) -> Vits:
    return engine._voice(None).model


def ids_for(engine: TorchEngine, text: str) -> list[int]:
    job = engine.start(text, QUIET)
    assert len(job.pending) == 1
    return job.pending[0].ids


def whole_pcm(model: Vits, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        audio = model.synthesize(ids, noise_scale=0.0, length_scale=1.0, noise_w=0.0)
    return (audio.clamp(-1, 1) * 32767).to(torch.int16).numpy()


def test_every_weight_is_named_from_the_onnx_graph(model: Vits) -> None:
    voice = read_onnx_voice(embedded_voice_path())
    assert not [k for k in voice.weights if k.startswith("onnx::")]
    # The model loaded strictly, so every parameter came from an initializer.
    names = set(dict(model.named_parameters()))
    assert any(n.startswith("flow.flows.6.enc.in_layers.0") for n in names)
    assert "enc_p.emb.weight" in names


def test_folded_flow_weights_map_by_graph_position_too() -> None:
    import onnx

    path = embedded_voice_path()
    by_name = read_onnx_voice(path).weights
    graph = onnx.load(str(path)).graph
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    unnamed = [n.input[1] for n in graph.node if n.op_type == "Conv" and n.input[1].startswith("onnx::Conv")]
    assert len(unnamed) == 32
    weights = {k: v for k, v in by_name.items() if not (k.startswith("flow.") and ".enc." in k and k.endswith(".weight"))}
    _name_flow_convs_by_position(weights, unnamed, inits)
    for k, v in by_name.items():
        np.testing.assert_array_equal(weights[k], v, err_msg=k)


def test_parity_with_onnxruntime(engine: TorchEngine, model: Vits) -> None:
    import onnxruntime

    ids = ids_for(engine, "Parity matters: the quick brown fox jumps over the lazy dog.")
    session = onnxruntime.InferenceSession(str(embedded_voice_path()), providers=["CPUExecutionProvider"])
    ref = session.run(
        None,
        {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array([0.0, 1.0, 0.0], dtype=np.float32),  # noise, length, noise_w
        },
    )[0].reshape(-1)
    with torch.inference_mode():
        out = model.synthesize(ids, noise_scale=0.0, length_scale=1.0, noise_w=0.0).numpy()
    assert out.shape == ref.shape  # same durations, frame for frame
    assert snr_db(ref, out) > 40.0


def test_streamed_windows_match_whole_sentence(engine: TorchEngine, model: Vits) -> None:
    chunks = list(engine.synthesize(LONG, QUIET))
    assert len(chunks) >= 4
    assert [c.unit_end for c in chunks] == [False] * (len(chunks) - 1) + [True]
    # The first window is the small one: early audio.
    assert len(chunks[0].pcm) < len(chunks[1].pcm)

    whole = whole_pcm(model, ids_for(engine, LONG))
    stream = np.concatenate([c.pcm for c in chunks])
    assert len(stream) == len(whole)
    assert snr_db(whole, stream) > 30.0

    # No clicks: around each seam the streamed samples equal the whole decode,
    # and the step across the seam is no bigger than the signal's own steps.
    seams = np.cumsum([len(c.pcm) for c in chunks])[:-1]
    steps = np.abs(np.diff(whole.astype(np.int32)))
    for seam in seams:
        near = slice(seam - 64, seam + 64)
        assert np.abs(stream[near].astype(np.int32) - whole[near].astype(np.int32)).max() <= 8
        assert abs(int(stream[seam]) - int(stream[seam - 1])) <= steps.max()


def test_first_chunk_is_yielded_before_later_windows_are_computed(engine: TorchEngine, model: Vits,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []
    flowed: list[int] = []
    real_decode, real_flow = model.decode, model.flow_windows

    def decode(windows):
        decoded.append(sum(w.shape[1] for w in windows))
        return real_decode(windows)

    def flow(windows):
        flowed.append(sum(w.shape[1] for w in windows))
        return real_flow(windows)

    monkeypatch.setattr(model, "decode", decode)
    monkeypatch.setattr(model, "flow_windows", flow)
    job = engine.start(LONG + " " + LONG, QUIET)
    first = engine.step([job])[0]
    sentence = job.current
    assert first is not None and not first.unit_end
    assert len(decoded) == 1 and len(flowed) == 1
    # Only the first window went through the vocoder, and the flow ran on a
    # prefix of the sentence, not all of it.
    assert decoded[0] < sentence.frames / 4
    assert sentence.flowed < sentence.frames
    rest = []
    while (chunk := engine.step([job])[0]) is not None:
        rest.append(chunk)
    assert len(decoded) == 1 + len(rest)
    assert rest[-1].unit_end


def test_word_timings_come_from_durations(engine: TorchEngine) -> None:
    chunks = list(engine.synthesize(LONG, QUIET))
    words = [w.text for c in chunks for w in c.words]
    assert words == LONG.split()
    assert "".join(c.text for c in chunks) == LONG
    offset = 0.0
    starts = []
    for c in chunks:
        for w in c.words:
            assert 0.0 <= w.start < c.duration and w.end > w.start
            starts.append(offset + w.start)
        offset += c.duration
    assert starts == sorted(starts)
    assert starts[-1] < offset


def test_batched_step_equals_one_stream_at_a_time(engine: TorchEngine) -> None:
    texts = [LONG, "Hello there.", "A short clause, then a longer one that keeps on going."]
    single = [np.concatenate([c.pcm for c in engine.synthesize(t, QUIET)]) for t in texts]
    batched = engine.synthesize_batch([(t, QUIET) for t in texts])
    for one, many in zip(single, batched):
        pcm = np.concatenate([c.pcm for c in many])
        assert len(pcm) == len(one)
        assert np.abs(pcm.astype(np.int32) - one.astype(np.int32)).max() <= 2
        assert many[-1].unit_end


def test_batched_noise_is_per_stream(engine: TorchEngine) -> None:
    # With noise on, a seeded stream sounds the same alone or batched with others.
    opts = SynthesisOptions()
    job = engine.start("Noise is drawn per stream.", opts, seed=7)
    alone = []
    while (c := engine.step([job])[0]) is not None:
        alone.append(c.pcm)
    batched = engine.synthesize_batch([("Something else first.", opts), ("Noise is drawn per stream.", opts)], seeds=[1, 7])
    a = np.concatenate(alone).astype(np.int32)
    b = np.concatenate([c.pcm for c in batched[1]]).astype(np.int32)
    assert len(a) == len(b) and np.abs(a - b).max() <= 2


def test_decoder_batch_masks_padding(model: Vits) -> None:
    gen = torch.Generator().manual_seed(0)
    windows = [torch.randn(model.channels, n, generator=gen) for n in (5, 40, 23)]
    with torch.inference_mode():
        together = model.decode(windows)
        apart = [model.decode([w])[0] for w in windows]
        flows_together = model.flow_windows(windows)
        flows_apart = [model.flow_windows([w])[0] for w in windows]
    for a, b in zip(together, apart):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=1e-4)
    for a, b in zip(flows_together, flows_apart):
        assert torch.allclose(a, b, atol=1e-4)


def test_cuda_unavailable_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineError, match=r"--device cuda .*no CUDA device.*--device cpu"):
        TorchEngine(device="cuda").load()


def test_empty_unit_yields_nothing(engine: TorchEngine) -> None:
    assert list(engine.synthesize("", QUIET)) == []


def test_default_engine_does_not_import_torch() -> None:
    code = (
        "import sys; from voxgate.engine.registry import create_engine; "
        "create_engine('piper'); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
