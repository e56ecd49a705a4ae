"""No class in the product over MAX_METHODS methods, counting what it inherits from the product's own
classes (issue 55: mixins and base classes cut to pass a size bar are still one object), and no
module over MAX_MODULE_LINES lines but the torch port of the VITS model. Read from the source (ast),
so nothing is imported."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("voxgate", "signaling", "gateway", "engine")
MAX_METHODS = 30
MAX_MODULE_LINES = 600
LONG_MODULES = {
    # A port of a published model, kept whole so it can be compared with its original line by line.
    "engine/torch_voices/torch_vits.py",
    # One concept, the echo canceller: its delay estimate, guard, coherence check and when it may sleep share
    # one state. 612 lines; cut only by concept (the brief), not to pass this bar.
    "gateway/caller/echo.py",
}


def classes(files: dict[str, str]) -> dict[str, tuple[set[str], list[str]]]:
    """Class name -> (the names of its own methods and properties, its bases' names)."""
    found: dict[str, tuple[set[str], list[str]]] = {}
    for text in files.values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                own = {b.name for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))}
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute))]
                found[node.name] = (own | found.get(node.name, (set(), []))[0], bases)
    return found


def methods(name: str, table: dict[str, tuple[set[str], list[str]]], seen: frozenset = frozenset()) -> set[str]:
    """`name`'s methods with those of its bases that are the product's own classes (a name once)."""
    own, bases = table[name]
    inherited = set().union(*(methods(b, table, seen | {name}) for b in bases if b in table and b not in seen))
    return own | inherited


def product_files() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for folder in PRODUCT for p in (ROOT / folder).rglob("*.py")}


def test_no_class_is_over_30_methods_with_what_it_inherits():
    table = classes(product_files())
    assert len(table) > 100
    big = {name: len(methods(name, table)) for name in table if len(methods(name, table)) > MAX_METHODS}
    assert big == {}


def test_no_module_is_over_600_lines():
    long = {path: text.count("\n") for path, text in product_files().items()
            if text.count("\n") > MAX_MODULE_LINES and path not in LONG_MODULES}
    assert long == {}


def test_inherited_methods_count_once():
    table = classes({"m.py": "class A:\n    def f(self): ...\n    def g(self): ...\n"
                             "class B(A):\n    def g(self): ...\n    def h(self): ...\n"})
    assert methods("B", table) == {"f", "g", "h"}
