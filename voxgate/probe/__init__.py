"""`voxgate probe`: a barge-in and load tester for any Voxgate server.

Opens N WebRTC sessions (ramped up), has each speak scripted or random texts,
whole or streamed as tokens, interrupts some of them with `cancel` or by
talking into the microphone, and measures what a listener gets: time to first
audio (server- and client-side), cancel- and barge-in-to-silence, how well
`played_text` matches the audio that arrived, frame gaps and underruns, and
connection failures. Reports go to the terminal, JSON and a self-contained
HTML page with SVG plots. See docs/probe.md.

    voxgate probe http://127.0.0.1:8080 --sessions 8 --ramp-s 2 \
        --interrupt random --json probe.json --html probe.html

One module a concern: `config` (what a run does), `runner` (the WebRTC sessions
and `run_probe`), `progress` (counts and the terminal bar), `metrics` (the
server's Prometheus text), `results` (what is recorded), `analysis` (frames and
events to figures), `report` (figures, summary, JSON), `html_report` (the page
and its SVG plots) and `cli` (flags and the run).
"""

from .analysis import analyse, levenshtein
from .cli import add_arguments, config_from, main
from .config import ProbeConfig
from .html_report import nice_ticks, render_html, write_html
from .metrics import histogram_delta, parse_counter, parse_histogram
from .report import ProbeReport
from .results import ProbeProgress, SessionResult, UtteranceResult
from .runner import run_probe

__all__ = [
    "ProbeConfig", "ProbeProgress", "ProbeReport", "SessionResult", "UtteranceResult",
    "add_arguments", "analyse", "config_from", "histogram_delta", "levenshtein", "main",
    "nice_ticks", "parse_counter", "parse_histogram", "render_html", "run_probe", "write_html",
]
