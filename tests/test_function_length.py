"""No function in the product over MAX_LINES lines (issue 55's shape of the code): a longer one is cut by
concept, as engine/runtime/scheduler.py's dispatch was (choose, begin, batch, launch)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("voxgate", "signaling", "gateway", "engine")
MAX_LINES = 80


def long_functions(files: dict[pathlib.Path, str], limit: int = MAX_LINES) -> list[str]:
    """'path:line name (n lines)' for each function or method longer than `limit`, from `def` to its last line."""
    found = []
    for path, text in sorted(files.items()):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append(f"{path}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_80_lines():
    files = {p.relative_to(ROOT): p.read_text() for folder in PRODUCT for p in (ROOT / folder).rglob("*.py")}
    assert len(files) > 100
    assert long_functions(files) == []


def test_the_count_runs_from_def_to_the_last_line():
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    assert long_functions({pathlib.Path("m.py"): f"def f():\n{body}"}, 80) == ["m.py:1 f (81 lines)"]
    assert long_functions({pathlib.Path("m.py"): f"def f():\n{body[:-len('    x79 = 79')-1]}"}, 80) == []
