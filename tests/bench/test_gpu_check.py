"""bench/gpu_check.sh, the GPU worker's one-run check, end to end on this CPU with small counts.

Real components: the torch engine and the ONNX engine with the joe voice, the
engine worker process, a local Ray Serve replica with two client processes,
pocketsphinx. What a CPU cannot show (CUDA, the GPU's figures) is the device
run's; here the run's shape, its arithmetic and its time budgets are checked.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_bundle  # noqa: E402
from bench_engine import frame_underruns  # noqa: E402


def test_frame_underruns_counts_late_frames_once_per_stall() -> None:
    # 20 ms frames from the first chunk's arrival at t=1.0.
    on_time = [(1.0, 0.1), (1.05, 0.1), (1.19, 0.1)]
    assert frame_underruns(on_time) == 0
    # The second chunk's first frame is due at 1.1 and arrives at 1.15: one underrun; the
    # pacer's ticks then run 60 ms late, so the third chunk (due 1.2 + 0.06) is on time.
    late = [(1.0, 0.1), (1.15, 0.1), (1.25, 0.1)]
    assert frame_underruns(late) == 1
    # Two separate stalls count twice.
    assert frame_underruns([(1.0, 0.1), (1.15, 0.1), (1.4, 0.1)]) == 2
    # A chunk that starts inside a frame is needed at that frame's tick, before the
    # previous chunk's audio has fully played: 0.09 s played, frame 4 (1.08) needs it.
    assert frame_underruns([(1.0, 0.09), (1.085, 0.1)]) == 1
    assert frame_underruns([(1.0, 0.09), (1.075, 0.1)]) == 0


def test_bundle_unpacks_byte_for_byte_and_refuses_a_damaged_one(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "voice" / "data").mkdir(parents=True)
    weights = np.random.default_rng(1).standard_normal(40_001).astype(np.float32).tobytes() + b"xyz"
    (site / "voice" / "data" / "v.onnx").write_bytes(weights)
    (site / "voice" / "__init__.py").write_text("NAME = 'v'\n")
    (site / "voice-1.0.dist-info").mkdir()
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    manifest = gpu_bundle.pack(site, tmp_path / "part", "core", here, preset=1)
    assert manifest["shuffled"] == ["voice/data/v.onnx"] and manifest["packages"] == ["voice-1.0"]
    out = tmp_path / "out"
    gpu_bundle.unpack(tmp_path / "part", out)
    assert (out / "voice" / "data" / "v.onnx").read_bytes() == weights
    assert not list(out.rglob("*" + gpu_bundle.SHUFFLED))
    # A bundle for another Python is refused: its compiled parts would shadow working ones.
    path = tmp_path / "part" / "manifest.json"
    path.write_text(json.dumps(dict(manifest, python="3.9")))
    with pytest.raises(SystemExit, match="made for Python 3.9"):
        gpu_bundle.unpack(tmp_path / "part", tmp_path / "elsewhere")
    path.write_text(json.dumps(manifest))
    archive = tmp_path / "part" / "core.tar.xz"
    archive.write_bytes(archive.read_bytes()[:-1] + b"\0")
    with pytest.raises(SystemExit, match="SHA-256"):
        gpu_bundle.unpack(tmp_path / "part", tmp_path / "other")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_gpu_check_sh_on_cpu_with_small_counts(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("OUT", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    first = proc.stdout.splitlines()[:4]
    assert first[0].startswith("gpu: ") and first[1].startswith("cuda: ") and first[2].startswith("torch: 2."), first
    data = json.loads((tmp_path / "gpu-check.json").read_text())
    # Everything imports here: nothing was installed or downloaded.
    assert any("missing: nothing" in line for line in data["setup"]), data["setup"]
    assert not any("installing" in line for line in data["setup"])
    s = data["sections"]
    assert {k: v["status"] for k, v in s.items()} == {k: "ok" for k in ("env", "first_chunk", "fp16", "throughput", "ray")}
    assert s["env"]["device"] == "cpu" and s["env"]["cuda_available"] is False

    fc = s["first_chunk"]
    assert fc["torch_engine"]["device"] == "cpu" and fc["onnx_engine"]["device"] == "cpu"
    assert len(fc["runs"]) == 2  # "Hello." and --quick's 1 of the 8 sentences
    for text, run in fc["runs"].items():
        assert len(run["torch_s"]) == len(run["onnx_s"]) == 1 and run["audio_s"] > 0.3, text
    for label, n in (("hello", 1), ("sentences", 1)):
        t, o = fc[label]["torch_ms"], fc[label]["onnx_cpu_ms"]
        assert t["n"] == o["n"] == n and 0 < t["p50"] <= t["max"] < 5000 and 0 < o["p50"] <= o["max"] < 5000
        assert fc[label]["torch_over_onnx_p50"] == pytest.approx(t["p50"] / o["p50"], rel=0.01)

    fp = s["fp16"]
    assert fp["dtypes"] == {"fp32": "float32", "fp16": "float16"}
    assert fp["parity_db"]["all_same_length"] and 15.0 < fp["parity_db"]["min"] < 120.0  # 44 dB seen on this CPU
    assert all(0.0 <= w <= 1.0 for kind in ("fp32", "fp16") for w in fp["wer"]["per_sentence"][kind])
    audio = np.load(tmp_path / fp["audio_file"])
    assert audio["fp32_0"].size == audio["fp16_0"].size == fp["sentences"][0]["samples"]

    rows = s["throughput"]["rows"]
    assert [r["streams"] for r in rows] == [1, 2]
    for r in rows:
        assert len(r["underruns_20ms_per_stream"]) == len(r["first_chunk_s_per_stream"]) == r["streams"]
        assert r["throughput_audio_s_per_s"] > 1.0 and 0 < r["max_rtf"] < 1.0
    assert s["throughput"]["worker"]["engine"]["device"] == "cpu"

    ray = s["ray"]
    assert ray["pool"]["num_gpus"] == 0.0 and ray["replica_stats"]["requests"] >= 2
    (row,) = ray["rows"]
    assert row["streams"] == 2 and row["gateways"] == 2 and row["replica_device"] == "cpu"
    assert row["remote_ttfa_ms"]["n"] == 2 and 0 < row["remote_ttfa_ms"]["p50"] < 10_000
    assert all(r["direct"] >= 1 for r in row["routes"])  # each client reached the replica itself
    assert row["throughput_audio_s_per_s"] > 1.0 and _finite(row["vs_local_worker"]["throughput_ratio"])

    targets = data["targets"]
    assert targets["device"] == "cpu" and "note" in targets
    assert targets["fp16_parity_db"]["min"] == fp["parity_db"]["min"]


def test_a_section_out_of_its_time_is_reported_and_the_run_goes_on(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--quick", "--sections", "env,first_chunk",
         "--section-budget", "env=1", "--section-budget", "first_chunk=1", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    s = json.loads((tmp_path / "gpu-check.json").read_text())["sections"]
    # env out of its second (importing torch alone takes longer), and the run went on to the next.
    assert s["env"]["status"] == "timed_out" and s["env"]["elapsed_s"] < 30
    assert s["first_chunk"]["status"] == "timed_out" and s["first_chunk"]["elapsed_s"] < 30
