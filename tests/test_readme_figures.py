"""The README's headline figures against the committed JSON each one names.

Each row of the README's "Measured" table gives its figures in bold and, in its last column, a JSON
pointer (RFC 6901) for each, in the same order: the first names its file in bench/results/
(`gateway.json#/cancel/wire_ms/p50`), the others may name only a pointer into the same file
(`#/cancel/client_ms/p50`). A figure must equal the value it points at, rounded to the decimals it shows.
Each row also links to its row in docs/benchmarks.md, which must exist and cite the same JSON."""

from __future__ import annotations

import json
import os
import re

from tests.conftest import ROOT

RESULTS = os.path.join(ROOT, "bench", "results")


def read(*path: str) -> str:
    return open(os.path.join(ROOT, *path), encoding="utf-8").read()


def headline_rows() -> list[str]:
    section = read("README.md").split("\n## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return rows[1:]  # after the header row


def resolve(document: object, pointer: str) -> object:
    """RFC 6901: /a/b~1c/0 is document["a"]["b/c"][0]."""
    assert pointer.startswith("/"), pointer
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        document = document[int(token)] if isinstance(document, list) else document[token]  # type: ignore[index]
    return document


def figures_and_sources(row: str) -> tuple[list[str], list[tuple[str, str]]]:
    cells = [cell.strip() for cell in row.strip().strip("|").split(" | ")]
    figures = [re.match(r"[+−-]?\d[\d,]*(?:\.\d+)?", bold).group() for bold in re.findall(r"\*\*(.+?)\*\*", cells[1])]
    sources = []
    name = None
    for span in re.findall(r"`([^`]*#/[^`]*)`", cells[-1]):
        file, pointer = span.split("#", 1)
        name = file or name
        assert name, f"the first pointer of a row names its JSON: {row}"
        sources.append((name, pointer))
    return figures, sources


def test_the_readme_has_about_six_headline_figures():
    assert 5 <= len(headline_rows()) <= 8, headline_rows()


def test_each_headline_figure_matches_the_json_it_names():
    checked = 0
    for row in headline_rows():
        figures, sources = figures_and_sources(row)
        assert figures and len(figures) == len(sources), f"each bold figure needs its JSON pointer: {row}"
        for shown, (name, pointer) in zip(figures, sources):
            path = os.path.join(RESULTS, name)
            assert os.path.isfile(path), f"the README cites bench/results/{name}, which is not committed"
            value = resolve(json.load(open(path, encoding="utf-8")), pointer)
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (name, pointer, value)
            number = float(shown.replace(",", "").replace("−", "-"))
            decimals = len(shown.split(".", 1)[1]) if "." in shown else 0
            assert abs(number - value) <= 0.5 * 10 ** -decimals + 1e-9, (
                f"README shows {shown} for {name}#{pointer}, the JSON holds {value}")
            checked += 1
    assert checked >= 6


def test_each_headline_links_to_its_row_in_benchmarks_md_which_cites_the_same_json():
    benchmarks = read("docs", "benchmarks.md")
    for row in headline_rows():
        [anchor] = re.findall(r"\(docs/benchmarks\.md#([a-z0-9-]+)\)", row)
        rows = [line for line in benchmarks.splitlines() if f'<a id="{anchor}"></a>' in line]
        assert len(rows) == 1, f"docs/benchmarks.md has no single row with the anchor {anchor!r}"
        _, sources = figures_and_sources(row)
        assert f"bench/results/{sources[0][0]}" in rows[0], f"benchmarks.md#{anchor} does not cite {sources[0][0]}"



def test_every_result_file_is_cited_and_every_citation_is_a_file() -> None:
    """bench/results holds one current JSON per benchmark: each is cited by a row of docs/benchmarks.md,
    and each file that table or the README cites is there, but for those the table places in git
    history (`... at commit abc1234`) or says are still to come (`... once it runs`)."""
    files = {name for name in os.listdir(RESULTS) if name.endswith(".json")}
    table = read("docs", "benchmarks.md")
    assert sorted(name for name in files if f"bench/results/{name}" not in table) == []
    cited = set()
    for text in (table, read("README.md")):
        for m in re.finditer(r"bench/results/([\w.-]+\.json)(`? (at commit [0-9a-f]{7}|once it runs))?", text):
            if not m.group(2) and not text[max(0, m.start() - 7):m.start()].endswith("--out "):
                cited.add(m.group(1))
    assert sorted(cited - files) == []
