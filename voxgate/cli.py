"""The `voxgate` command: serve, say, probe."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
import wave

if not __package__:
    # Run as a file (`python voxgate/cli.py`): the imports below are the package's own.
    sys.exit("voxgate: this is part of the voxgate package; run `pip install -e .` in the clone, then `voxgate ...`")

from .config import (
    DEVICES, ENGINES, RATE_RANGE, SECRETS, ConfigError, PoolSettings, Settings, add_arguments, check_ranges, settings_from,
)
from .config_fields import secrets_on_command_line


def _serve(args: argparse.Namespace) -> int:
    # Every setting is read and checked before anything loads (aiortc, the engine, the voice).
    try:
        settings = settings_from(args)
        settings.check()
    except ConfigError as exc:
        print(f"voxgate: {exc}", file=sys.stderr)
        return 2
    from .logs import setup_logging
    from .signaling.server import run

    from .engine.errors import EngineUnavailable
    from .gateway.media.priority import PriorityError

    setup_logging(settings.log_level, settings.log_json)
    shown = secrets_on_command_line(sys.argv[1:], SECRETS)
    if shown:
        logging.getLogger("voxgate").warning(
            "%s given on the command line, where any user of this machine can read it (ps); "
            "use the VOXGATE_* environment variable or the matching --...-file flag instead", ", ".join(shown)
        )
    try:
        run(settings)
    except EngineUnavailable as exc:
        print(f"voxgate: the {settings.engine} engine could not start: {exc}", file=sys.stderr)
        return 2
    except (PriorityError, ConfigError) as exc:  # ConfigError: what loads at start (--stt's recognizer) is missing
        print(f"voxgate: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"voxgate: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}. "
              "Choose another --port or stop what is using it.", file=sys.stderr)
        return 2
    return 0


async def _say_async(args: argparse.Namespace) -> int:
    # The rest of the engine's settings (threads, parallel steps, the engine's own) come from
    # VOXGATE_* variables, as for `serve`.
    try:
        settings = settings_from()
        settings.engine, settings.voice, settings.device = args.engine, args.voice, args.device
        check_ranges(settings)
        if not RATE_RANGE[0] <= args.rate <= RATE_RANGE[1]:
            raise ConfigError(f"--rate {args.rate:g}: give {RATE_RANGE[0]:g} to {RATE_RANGE[1]:g}")
        if not 0.5 <= args.tokens_per_s <= 1000:
            raise ConfigError(f"--tokens-per-s {args.tokens_per_s:g}: give 0.5 to 1000")
    except ConfigError as exc:
        print(f"voxgate: {exc}", file=sys.stderr)
        return 2
    import numpy as np

    from .engine.base import SynthesisOptions
    from .engine.runtime.client import EngineClient, EngineConfig
    from .engine.errors import EngineUnavailable

    client = EngineClient(
        EngineConfig(
            engine=args.engine, voice=args.voice, device=args.device, parallel=settings.parallel,
            threads=settings.threads, engine_options=settings.engine_options,
            log_level=settings.log_level, log_json=settings.log_json, ping_timeout=settings.engine_ping_timeout_s,
        )
    )
    t_start = time.perf_counter()
    try:
        await client.start()
    except EngineUnavailable as exc:
        print(f"voxgate: the {args.engine} engine could not start: {exc}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t_start
    stream = client.stream(SynthesisOptions(rate=args.rate))  # the worker's default voice: --voice
    chunks = []
    t0 = time.perf_counter()
    first = None

    async def feed() -> None:
        if args.stream:
            # Word by word, the way an LLM streams tokens.
            for word in args.text.split(" "):
                stream.push_text(word + " ")
                await asyncio.sleep(1.0 / args.tokens_per_s)
        else:
            stream.push_text(args.text)
        stream.end_input()

    feeder = asyncio.ensure_future(feed())
    rate = None
    try:
        async for chunk in stream:
            if first is None:
                first = time.perf_counter() - t0
            rate = chunk.sample_rate
            chunks.append(chunk.pcm)
    finally:
        await feeder
        await client.close()
    elapsed = time.perf_counter() - t0
    pcm = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)
    rate = rate or 22050
    with wave.open(args.output, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm.tobytes())
    audio_s = len(pcm) / rate
    print(f"wrote {args.output}: {audio_s:.2f} s at {rate} Hz")
    print(f"engine {args.engine}: worker ready in {load_s:.2f} s")
    if first is not None:
        print(f"time to first chunk: {first * 1000:.1f} ms")
    if audio_s > 0:
        print(f"real-time factor: {elapsed / audio_s:.3f} ({elapsed:.2f} s for {audio_s:.2f} s of audio)")
    return 0


def _engine_serve(args: argparse.Namespace) -> int:
    """A local engine pool on Ray Serve, for development; in production, deploy/k8s/rayservice.yaml."""
    try:
        settings = settings_from(args, kind=PoolSettings)
        settings.check()
    except ConfigError as exc:
        print(f"voxgate: {exc}", file=sys.stderr)
        return 2
    from .engine.cluster.pool import PoolConfig, serve_forever

    config = PoolConfig(
        engine=settings.engine, voice=settings.voice, voice_dir=settings.voice_dir, device=settings.device,
        num_cpus=settings.replica_cpus, num_gpus=settings.num_gpus, min_replicas=settings.min_replicas,
        max_replicas=settings.max_replicas, target_ongoing_requests=settings.target_ongoing_requests,
        max_ongoing_requests=settings.max_ongoing_requests, log_level=settings.log_level,
    )
    try:
        serve_forever(config, settings.host, settings.port, settings.ray_cpus or None, settings.direct_ingress)
    except RuntimeError as exc:  # no Ray: the message names the extra
        print(f"voxgate: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voxgate", description="Real-time WebRTC voice gateway")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway (HTTP signaling, WebRTC, the bundled page)")
    add_arguments(serve)
    serve.set_defaults(func=_serve)

    say = sub.add_parser(
        "say", help="synthesize text to a WAV file through the engine worker",
        description="Synthesize text to a WAV file through the engine worker, and print the time to the first "
        "chunk and the real-time factor. The engine's other settings come from VOXGATE_* variables, as for serve.",
    )
    say.add_argument("text", help="what to say")
    say.add_argument("-o", "--output", default="out.wav", metavar="FILE", help="the WAV file to write (default out.wav)")
    say.add_argument("--engine", default=Settings.engine, choices=ENGINES,
                     help=f"speech engine; tone is a test engine (default {Settings.engine})")
    say.add_argument("--voice", default=Settings.voice, metavar="NAME",
                     help="a voice of the engine, or a Piper .onnx path (default the engine's: joe for piper)")
    say.add_argument("--device", default=Settings.device, choices=DEVICES,
                     help=f"where the engine runs (default {Settings.device})")
    say.add_argument("--rate", type=float, default=1.0, metavar="X",
                     help=f"speaking rate, {RATE_RANGE[0]:g} to {RATE_RANGE[1]:g}; 2 is twice as fast (default 1)")
    say.add_argument("--stream", action="store_true", help="feed the text word by word, like LLM tokens")
    say.add_argument("--tokens-per-s", type=float, default=30.0, metavar="N",
                     help="with --stream: words per second, 0.5 to 1000 (default 30)")
    say.set_defaults(func=lambda a: asyncio.run(_say_async(a)))

    engine = sub.add_parser("engine", help='the engine pool on Ray Serve (needs pip install ".[scale]" in the clone)')
    engine_sub = engine.add_subparsers(dest="engine_command", required=True)
    pool = engine_sub.add_parser("serve", help="start a local engine pool; gateways use it with --engine-url")
    add_arguments(pool, PoolSettings)
    pool.set_defaults(func=_engine_serve)

    from . import probe as _probe  # light to import: aiortc loads only when a probe runs

    probe = sub.add_parser("probe", help="barge-in and load tester: N WebRTC sessions against a server, with reports")
    _probe.add_arguments(probe)
    probe.set_defaults(func=_probe.main)

    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
