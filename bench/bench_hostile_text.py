"""Gateway-side text work on hostile input, against plain text of the same length.

Measures, in this process, what the gateway does on the event loop with one
utterance's text: the segmenter, speakable() and the speech-tag rules. Each
hostile input (the ones that froze the loop before the linear-time rules, see
docs/security.md) is timed beside plain sentences of the same length, in the
same run; the ratio is the figure. `--label` names the run in the JSON (the
run on the code before the linear-time rules is in git: bench/results/
hostile-text-before.json at d7f8ed7).

    python bench/bench_hostile_text.py [--quick] [--label after]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import ROOT, arg_parser, machine, print_machine  # noqa: E402

from voxgate.engine.text.segmenter import Segmenter, speakable  # noqa: E402
from voxgate.engine.text.tags import TagState  # noqa: E402

HOSTILE = {
    "email_pattern": "<" + "a." * 9500,
    "tag_name_pattern": "<a" + " " * 19000 + "x>",
    "attribute_pattern": "<b " + "a" * 19000 + ">",
    "many_open_brackets": "<" * 19000,
    "markdown_link": "[a](" * 4000,
}


def process(text: str) -> float:
    t0 = time.perf_counter()
    seg = Segmenter()
    units = seg.push(text) + seg.end()
    tags = TagState()
    for unit in units:
        tags.pieces(unit.raw)
        speakable(unit.raw)
    return time.perf_counter() - t0


def main() -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--label", default="after")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    repeat = 3 if args.quick else args.repeat
    info = machine()
    print_machine(info, "machine")
    rows = {}
    for name, hostile in HOSTILE.items():
        plain = ("Plain words and sentences. " * 1000)[: len(hostile)]
        process(plain)
        plain_s = statistics.median(process(plain) for _ in range(repeat))
        hostile_s = statistics.median(process(hostile) for _ in range(repeat))
        rows[name] = {"chars": len(hostile), "plain_ms": round(plain_s * 1000, 2), "hostile_ms": round(hostile_s * 1000, 2),
                      "ratio": round(hostile_s / plain_s, 2)}
        print(f"{name:20s} {len(hostile):6d} chars  plain {plain_s * 1000:8.2f} ms  hostile {hostile_s * 1000:9.2f} ms  "
              f"ratio {hostile_s / plain_s:8.2f}", flush=True)
    data = {"label": args.label, "what": "gateway-side text work per utterance, in-process (median of runs)",
            "repeat": repeat, "rows": rows, "machine": info, "machine_end": machine()}
    out_dir = os.path.join(ROOT, "bench", "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "hostile-text.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
