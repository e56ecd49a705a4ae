"""`voxgate probe`'s command line: its flags, the configuration they make, and the run with its reports."""

from __future__ import annotations

import argparse
import asyncio

from .config import ProbeConfig
from .html_report import write_html
from .progress import TerminalProgress
from .runner import run_probe


# Command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", nargs="?", default="http://127.0.0.1:8080", help="the Voxgate server (default http://127.0.0.1:8080)")
    parser.add_argument("--sessions", type=int, default=1, help="WebRTC sessions to open")
    parser.add_argument("--ramp-s", type=float, default=0.0, help="spread the session starts over this many seconds")
    parser.add_argument("--text", action="append", default=None, help="a text to speak (repeatable; default: random texts)")
    parser.add_argument("--texts-file", default=None, help="texts to speak, one a line")
    parser.add_argument("--utterances", type=int, default=1, help="utterances per session")
    parser.add_argument("--stream", action="store_true", help="stream each text as text.delta tokens, then text.end")
    parser.add_argument("--tokens-per-s", type=float, default=20.0, help="token rate with --stream")
    parser.add_argument("--interrupt-at-ms", type=float, default=None, help="interrupt this long after the first audible audio")
    parser.add_argument("--interrupt", choices=["random"], default=None, help="interrupt at a random offset (0.3-1.5 s into the audio)")
    parser.add_argument("--interrupt-share", type=float, default=1.0, help="share of the sessions that interrupt (0-1)")
    parser.add_argument("--barge-in", choices=["cancel", "voice"], default="cancel", help="interrupt with a cancel message, or by talking into the microphone")
    parser.add_argument("--voice", default=None, help="server voice to ask for")
    parser.add_argument("--seed", type=int, default=1, help="seed for random texts and offsets")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="give up on an utterance after this long")
    parser.add_argument("--json", dest="json_path", default=None, help="write the JSON report here")
    parser.add_argument("--html", dest="html_path", default=None, help="write the HTML report here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def config_from(args: argparse.Namespace) -> ProbeConfig:
    texts = list(args.text or [])
    if args.texts_file:
        with open(args.texts_file, encoding="utf-8") as f:
            texts.extend(line.strip() for line in f if line.strip())
    if args.sessions < 1:
        raise SystemExit("voxgate probe: --sessions must be at least 1")
    if not 0.0 <= args.interrupt_share <= 1.0:
        raise SystemExit("voxgate probe: --interrupt-share must be from 0 to 1")
    return ProbeConfig(
        url=args.url,
        sessions=args.sessions,
        ramp_s=args.ramp_s,
        texts=texts,
        utterances=max(args.utterances, 1),
        stream=args.stream,
        tokens_per_s=args.tokens_per_s,
        interrupt_at_ms=args.interrupt_at_ms,
        interrupt_random=args.interrupt == "random",
        interrupt_share=args.interrupt_share,
        barge_in=args.barge_in,
        voice=args.voice,
        seed=args.seed,
        timeout_s=args.timeout_s,
    )


def main(args: argparse.Namespace) -> int:
    config = config_from(args)
    bar = TerminalProgress()
    report = asyncio.run(run_probe(config, None if args.quiet else bar))
    bar.end()
    print(report.summary_text())
    if args.json_path:
        report.write_json(args.json_path)
        print(f"  JSON report: {args.json_path}")
    if args.html_path:
        write_html(report, args.html_path)
        print(f"  HTML report: {args.html_path}")
    figures = report.figures()
    return 1 if figures["sessions"]["failed"] else 0
