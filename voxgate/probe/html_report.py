"""The probe's HTML page: summary cards, three SVG plots (time to first audio, latency over the run, a timeline per session) and a table."""

from __future__ import annotations

import html
import json
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from .results import format_ms, percentile

if TYPE_CHECKING:
    from .report import ProbeReport

# HTML and SVG
COLORS = {
    "server": "#7a869a",
    "client": "#1f6feb",
    "cancel": "#d1242f",
    "voice": "#bf3989",
    "speech": "#2da44e",
    "waiting": "#e3b341",
    "tail": "#d1242f",
    "connecting": "#afb8c1",
    "silence": "#eaeef2",
}


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks = []
    v = start
    while v <= hi + step * 1e-9:
        ticks.append(round(v, 10))
        v += step
    if ticks[-1] < hi:
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 10 or v == int(v) else f"{v:.1f}"


class _Plot:
    """An SVG canvas with a plot area and labelled axes."""

    def __init__(self, width: int, height: int, left: int = 70, right: int = 20, top: int = 40, bottom: int = 55) -> None:
        self.w, self.h = width, height
        self.left, self.right, self.top, self.bottom = left, right, top, bottom
        self.parts: list[str] = []

    @property
    def pw(self) -> float:
        return self.w - self.left - self.right

    @property
    def ph(self) -> float:
        return self.h - self.top - self.bottom

    def add(self, s: str) -> None:
        self.parts.append(s)

    def title(self, text: str) -> None:
        self.add(f'<text x="{self.left}" y="22" class="title">{html.escape(text)}</text>')

    def axes(self, xticks, xmap, xlabel, yticks, ymap, ylabel) -> None:
        x0, y0, x1, y1 = self.left, self.top + self.ph, self.left + self.pw, self.top
        for t in yticks:
            y = ymap(t)
            self.add(f'<line x1="{x0}" y1="{y:.1f}" x2="{x1}" y2="{y:.1f}" class="grid"/>')
            self.add(f'<text x="{x0 - 8}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_fmt(t)}</text>')
        for t in xticks:
            x = xmap(t)
            self.add(f'<line x1="{x:.1f}" y1="{y0}" x2="{x:.1f}" y2="{y0 + 5}" class="axis"/>')
            self.add(f'<text x="{x:.1f}" y="{y0 + 19}" class="tick" text-anchor="middle">{_fmt(t)}</text>')
        self.add(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" class="axis"/>')
        self.add(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" class="axis"/>')
        self.add(f'<text x="{x0 + self.pw / 2:.1f}" y="{self.h - 12}" class="label" text-anchor="middle">{html.escape(xlabel)}</text>')
        if ylabel:
            cy = self.top + self.ph / 2
            self.add(f'<text x="16" y="{cy:.1f}" class="label" text-anchor="middle" transform="rotate(-90 16 {cy:.1f})">{html.escape(ylabel)}</text>')

    def legend(self, items: list[tuple[str, str, str]], y: float = 18) -> None:
        """(label, color, shape) right-aligned at height y; shape is 'box', 'dot' or 'line'."""
        x: float = self.w - self.right
        for label, color, shape in reversed(items):
            width = 7.2 * len(label) + 22
            x -= width
            if shape == "dot":
                mark = f'<circle cx="{x + 6}" cy="{y}" r="5" fill="{color}"/>'
            elif shape == "line":
                mark = f'<line x1="{x + 5}" y1="{y - 7}" x2="{x + 5}" y2="{y + 7}" stroke="{color}" stroke-width="3"/>'
            else:
                mark = f'<rect x="{x}" y="{y - 6}" width="12" height="12" fill="{color}" rx="2"/>'
            self.add(mark + f'<text x="{x + 16}" y="{y + 4}" class="legend">{html.escape(label)}</text>')

    def svg(self, label: str) -> str:
        body = "\n".join(self.parts)
        return f'<svg xmlns="http://www.w3.org/2000/svg" class="plot" viewBox="0 0 {self.w} {self.h}" width="{self.w}" height="{self.h}" role="img" aria-label="{html.escape(label)}">\n{body}\n</svg>'

    def empty(self, message: str) -> None:
        self.add(f'<text x="{self.left + self.pw / 2}" y="{self.top + self.ph / 2}" class="label" text-anchor="middle">{html.escape(message)}</text>')


def svg_ttfa_histogram(report: ProbeReport, width: int = 1080, height: int = 320) -> str:
    utts = report.utterances
    series = {
        "client (send → first sound)": ([u.client_ttfa_ms for u in utts if u.client_ttfa_ms is not None], COLORS["client"]),
        "server (audio.started ttfa_ms)": ([u.server_ttfa_ms for u in utts if u.server_ttfa_ms is not None], COLORS["server"]),
    }
    plot = _Plot(width, height)
    plot.title("Time to first audio")
    values = [v for vs, _ in series.values() for v in vs]
    if not values:
        plot.empty("no utterance produced audio")
        return plot.svg("TTFA histogram")
    hi = max(values)
    edges = nice_ticks(0.0, hi * 1.05 if hi > 0 else 1.0, 14)
    if edges[-1] <= hi:
        edges.append(edges[-1] + (edges[1] - edges[0]))
    counts = {name: np.histogram(vs, bins=edges)[0] for name, (vs, _) in series.items()}
    top = max(1, max(int(c.max()) for c in counts.values()))
    yticks = [t for t in nice_ticks(0, top, 5) if t == int(t)]
    ymax = max(yticks[-1], top)
    xmap = lambda v: plot.left + (v - edges[0]) / (edges[-1] - edges[0]) * plot.pw
    ymap = lambda v: plot.top + plot.ph - v / ymax * plot.ph
    plot.axes(edges[:: max(1, len(edges) // 10)], xmap, "time to first audio (ms)", yticks, ymap, "utterances")
    names = list(series)
    for b in range(len(edges) - 1):
        bw = (xmap(edges[b + 1]) - xmap(edges[b])) / len(names)
        for j, name in enumerate(names):
            n = int(counts[name][b])
            if n:
                x = xmap(edges[b]) + j * bw
                y = ymap(n)
                plot.add(
                    f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{max(1.0, bw - 2):.1f}" height="{plot.top + plot.ph - y:.1f}" '
                    f'fill="{series[name][1]}"><title>{html.escape(name)}: {n} in {_fmt(edges[b])}–{_fmt(edges[b + 1])} ms</title></rect>'
                )
    for j, (name, (vs, color)) in enumerate(series.items()):
        if vs:
            p50 = percentile(vs, 50)
            x = xmap(p50)
            plot.add(f'<line x1="{x:.1f}" y1="{plot.top - 4}" x2="{x:.1f}" y2="{plot.top + plot.ph}" stroke="#1f2328" stroke-dasharray="5 4" stroke-width="1.5"/>')
            label = f"{name.split()[0]} p50 {p50:.0f} ms"
            plot.add(f'<text x="{x + 5:.1f}" y="{plot.top + 12 + 15 * j}" class="legend" fill="{color}" style="fill:{color};font-weight:600">{html.escape(label)}</text>')
    plot.legend([(f"{name}" , color, "box") for name, (_, color) in series.items()] + [("median", "#1f2328", "line")])
    return plot.svg("TTFA histogram")


def svg_latency_over_time(report: ProbeReport, width: int = 1080, height: int = 320) -> str:
    utts = report.utterances
    points: list[tuple[str, str, list[tuple[float, float]]]] = [
        ("client ttfa", COLORS["client"], [(u.sent_at, u.client_ttfa_ms) for u in utts if u.client_ttfa_ms is not None]),
        ("server ttfa", COLORS["server"], [(u.sent_at, u.server_ttfa_ms) for u in utts if u.server_ttfa_ms is not None]),
        ("cancel → silence", COLORS["cancel"], [(u.interrupt_at, u.interrupt_to_silence_ms) for u in utts
                                                if u.interrupt_kind == "cancel" and u.interrupt_at is not None and u.interrupt_to_silence_ms is not None]),
        ("voice → silence", COLORS["voice"], [(u.interrupt_at, u.interrupt_to_silence_ms) for u in utts
                                              if u.interrupt_kind == "voice" and u.interrupt_at is not None and u.interrupt_to_silence_ms is not None]),
    ]
    points = [p for p in points if p[2]]
    plot = _Plot(width, height)
    plot.title("Latency over the run")
    if not points:
        plot.empty("no latencies measured")
        return plot.svg("latency over time")
    xmax = max(report.duration_s, max(x for _, _, ps in points for x, _ in ps)) or 1.0
    ymax_raw = max(y for _, _, ps in points for _, y in ps) or 1.0
    xticks = nice_ticks(0, xmax, 10)
    yticks = nice_ticks(0, ymax_raw * 1.05, 5)
    xmap = lambda v: plot.left + v / xticks[-1] * plot.pw
    ymap = lambda v: plot.top + plot.ph - v / yticks[-1] * plot.ph
    plot.axes(xticks, xmap, "time since the run started (s): when the text was sent, or when the interruption began", yticks, ymap, "latency (ms)")
    for name, color, ps in points:
        for x, y in ps:
            plot.add(f'<circle cx="{xmap(x):.1f}" cy="{ymap(y):.1f}" r="4.5" fill="{color}" fill-opacity="0.8"><title>{html.escape(name)}: {y:.1f} ms at {x:.2f} s</title></circle>')
    plot.legend([(name, color, "dot") for name, color, _ in points])
    return plot.svg("latency over time")


def svg_timeline(report: ProbeReport, width: int = 1080) -> str:
    sessions = report.sessions
    row = 26
    plot = _Plot(width, 64 + 55 + row * max(1, len(sessions)), left=90, top=64)
    plot.title("Sessions: speech, interruptions and silence")
    end = max([report.duration_s] + [s.closed_at or 0 for s in sessions]) or 1.0
    xticks = nice_ticks(0, end, 10)
    xmap = lambda v: plot.left + v / xticks[-1] * plot.pw
    y0 = plot.top
    plot.axes(xticks, xmap, "time since the run started (s)", [], lambda v: 0, "")
    for i, s in enumerate(sessions):
        y = y0 + i * row + 4
        h = row - 8
        plot.add(f'<text x="{plot.left - 8}" y="{y + h - 4}" class="tick" text-anchor="end">session {s.index}</text>')
        if s.connected_at is None:
            plot.add(f'<rect x="{xmap(s.started_at):.1f}" y="{y}" width="{max(2.0, xmap(s.closed_at or end) - xmap(s.started_at)):.1f}" height="{h}" fill="none" stroke="{COLORS["cancel"]}" stroke-dasharray="4 3"/>')
            plot.add(f'<text x="{xmap(s.started_at) + 6:.1f}" y="{y + h - 5}" class="fail">connection failed: {html.escape((s.failure or "")[:80])}</text>')
            continue
        plot.add(_bar(xmap, s.started_at, s.connected_at, y + h / 2 - 2, 4, COLORS["connecting"], "connecting"))
        plot.add(_bar(xmap, s.connected_at, s.closed_at or end, y, h, COLORS["silence"], "silence"))
        for u in s.utterances:
            if u.first_sound_at is not None:
                plot.add(_bar(xmap, u.sent_at, u.first_sound_at, y + h / 2 - 2, 4, COLORS["waiting"], f"{u.id}: waiting for first audio {u.client_ttfa_ms or 0:.0f} ms"))
                speech_end = u.last_sound_at or u.first_sound_at
                interrupt_at = u.interrupt_at if u.outcome == "interrupted" else None
                cut = min(speech_end, interrupt_at) if interrupt_at is not None else speech_end
                plot.add(_bar(xmap, u.first_sound_at, cut, y, h, COLORS["speech"], f"{u.id}: speech ({u.outcome})"))
                if interrupt_at is not None and speech_end > interrupt_at:
                    plot.add(_bar(xmap, interrupt_at, speech_end, y, h, COLORS["tail"], f"{u.id}: still audible after the interruption {u.interrupt_to_silence_ms or 0:.0f} ms"))
            if u.interrupt_at is not None:
                x = xmap(u.interrupt_at)
                color = COLORS["voice"] if u.interrupt_kind == "voice" else COLORS["cancel"]
                plot.add(f'<line x1="{x:.1f}" y1="{y - 3}" x2="{x:.1f}" y2="{y + h + 3}" stroke="{color}" stroke-width="2.5"><title>{u.id}: {u.interrupt_kind} at {u.interrupt_at:.2f} s</title></line>')
    plot.legend([
        ("connecting", COLORS["connecting"], "box"),
        ("waiting for audio", COLORS["waiting"], "box"),
        ("speech", COLORS["speech"], "box"),
        ("audible after interrupt", COLORS["tail"], "box"),
        ("silence", COLORS["silence"], "box"),
        ("cancel", COLORS["cancel"], "line"),
        ("voice barge-in", COLORS["voice"], "line"),
    ], y=46)
    return plot.svg("session timeline")


def _bar(xmap, t0: float, t1: float, y: float, h: float, color: str, title: str) -> str:
    x0, x1 = xmap(t0), xmap(max(t0, t1))
    return f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(1.5, x1 - x0):.1f}" height="{h:.1f}" fill="{color}" rx="2"><title>{html.escape(title)}</title></rect>'


_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; margin: 24px auto; max-width: 1100px; padding: 0 12px; }
h1 { font-size: 22px; margin: 0 0 4px; } .sub { color: #57606a; margin-bottom: 16px; }
.cards { display: grid; grid-template-columns: repeat(4, 1fr); gap: 10px; margin: 16px 0; }
.card { border: 1px solid #d0d7de; border-radius: 8px; padding: 10px 12px; }
.card .k { color: #57606a; font-size: 12px; text-transform: uppercase; letter-spacing: .04em; }
.card .v { font-size: 22px; font-weight: 600; } .card .d { color: #57606a; font-size: 12px; }
.bad .v { color: #d1242f; }
section { margin: 22px 0; } svg.plot { width: 100%; height: auto; border: 1px solid #d0d7de; border-radius: 8px; background: #fff; }
svg .title { font-size: 16px; font-weight: 600; fill: #1f2328; } svg .tick { font-size: 12px; fill: #57606a; }
svg .label { font-size: 13px; fill: #1f2328; } svg .legend { font-size: 12px; fill: #1f2328; }
svg .grid { stroke: #eaeef2; } svg .axis { stroke: #8c959f; } svg .fail { font-size: 12px; fill: #d1242f; }
table { border-collapse: collapse; width: 100%; font-size: 13px; } th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #eaeef2; }
th { color: #57606a; font-weight: 600; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
"""


def write_html(report: ProbeReport, path: str) -> None:
    """The page for `report`, written to `path` (the page reads the report; the report knows nothing of pages)."""
    with open(path, "w") as f:
        f.write(render_html(report))


def render_html(report: ProbeReport) -> str:
    f = report.figures()
    cfg = report.config

    def card(key: str, value: str, detail: str = "", bad: bool = False) -> str:
        return f'<div class="card{" bad" if bad else ""}"><div class="k">{html.escape(key)}</div><div class="v">{html.escape(value)}</div><div class="d">{html.escape(detail)}</div></div>'

    def p(stats: dict, key: str) -> str:
        v = stats.get(key) if stats else None
        return "-" if v is None else f"{v:.0f} ms"

    cards = [
        card("sessions", f"{f['sessions']['connected']}/{f['sessions']['total']}", f"{f['sessions']['failed']} connection failures", f["sessions"]["failed"] > 0),
        card("ttfa client p50", p(f["ttfa_client_ms"], "p50"), f"p95 {p(f['ttfa_client_ms'], 'p95')}, max {p(f['ttfa_client_ms'], 'max')}"),
        card("ttfa server p50", p(f["ttfa_server_ms"], "p50"), f"p95 {p(f['ttfa_server_ms'], 'p95')}, max {p(f['ttfa_server_ms'], 'max')}"),
    ]
    for kind, stats in f["interrupt_to_silence_ms"].items():
        cards.append(card(f"{kind} → silence p50", p(stats, "p50"), f"p95 {p(stats, 'p95')}, max {p(stats, 'max')}"))
    acc = f["played_text"]
    if "tone" in acc:
        t = acc["tone"]
        cards.append(card("played_text exact", f"{t['exact']}/{t['checked']}", f"{t['off_by_one']} off by one, {t['mismatch']} mismatched", t["mismatch"] > 0))
    if "voice" in acc:
        v = acc["voice"]
        cards.append(card("played_text (voice)", f"±{v['mean_abs_word_error']:.1f} words", f"{v['within_2_words']}/{v['checked']} within 2 words"))
    fr = f["frames"]
    cards.append(card("frame gaps", f"max {fr['max_gap_ms']:.0f} ms" if fr["max_gap_ms"] is not None else "-", f"p99 {format_ms(fr['p99_gap_ms'])}, {fr['underruns']} underruns", fr["underruns"] > 0))

    rows = []
    for s in report.sessions:
        for u in s.utterances or [None]:  # type: ignore[list-item]  # None: a row for a session without utterances
            if u is None:
                rows.append(f"<tr><td>{s.index}</td><td colspan=8>{html.escape(s.failure or 'no utterances')}</td></tr>")
                continue
            rows.append(
                "<tr>" + "".join([
                    f"<td>{s.index}</td><td>{html.escape(u.id)}</td><td>{html.escape(u.outcome)}</td>",
                    f'<td class="num">{_num(u.server_ttfa_ms)}</td><td class="num">{_num(u.client_ttfa_ms)}</td>',
                    f"<td>{html.escape(u.interrupt_kind or '')}</td><td class=\"num\">{_num(u.interrupt_to_silence_ms)}</td>",
                    f"<td>{html.escape(u.accuracy or '')}</td><td>{html.escape((u.played_text or '')[:80])}</td>",
                ]) + "</tr>"
            )
    mode = "streamed tokens" if cfg.stream else "whole texts"
    interrupt = "no interruptions"
    if cfg.interrupting:
        at = "random offsets" if cfg.interrupt_random else f"{cfg.interrupt_at_ms:.0f} ms"
        interrupt = f"{cfg.barge_in} interruptions at {at} into the audio, {round(cfg.interrupt_share * cfg.sessions)} of {cfg.sessions} sessions"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>voxgate probe report</title><style>{_CSS}</style></head>
<body>
<h1>Voxgate probe report</h1>
<div class="sub">{html.escape(cfg.url)} · {cfg.sessions} sessions ramped over {cfg.ramp_s:g} s · {mode} · {html.escape(interrupt)} · {report.duration_s:.1f} s · {html.escape(time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.started)))}</div>
<div class="cards">{"".join(cards)}</div>
<section>{svg_ttfa_histogram(report)}</section>
<section>{svg_latency_over_time(report)}</section>
<section>{svg_timeline(report)}</section>
<section><h2>Utterances</h2><table><tr><th>session</th><th>id</th><th>outcome</th><th>ttfa server</th><th>ttfa client</th><th>interrupt</th><th>→ silence</th><th>played_text check</th><th>played_text</th></tr>
{"".join(rows)}</table></section>
<section><h2>Figures</h2><pre>{html.escape(json.dumps(f, indent=2))}</pre></section>
</body></html>
"""


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.0f} ms"
