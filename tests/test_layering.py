"""No import cycles between sibling modules, counting imports made only for the type checker.

scripts/lint.sh checks pyproject.toml's import contracts before the suite; this test checks the same
property in the suite, on the package laid out as installed (as lint.sh lays it out: voxgate/ with
signaling/, gateway/, engine/ and web/ inside), with grimp counting `if TYPE_CHECKING:` imports.

No exception: the acyclic contract ignores no import (the session's mixins, which named each other
for the type checker, became parts that meet through callbacks and Protocols; issue 55).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUBPACKAGES = ("signaling", "gateway", "engine", "web")

# Run in a child process, where `voxgate` resolves to the laid-out tree rather than the editable install.
CYCLES = """
import json, sys
import grimp
root, ignored = sys.argv[1], json.loads(sys.argv[2])
graph = grimp.build_graph(root, exclude_type_checking_imports=False, cache_dir=None)
for importer, imported in ignored:
    graph.remove_import(importer=importer, imported=imported)
packages = sorted(m for m in graph.modules if graph.find_children(m))
print(json.dumps({p: sorted(map(list, graph.nominate_cycle_breakers(p))) for p in packages}))
"""


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _acyclic_ignores() -> list[tuple[str, str]]:
    [contract] = [c for c in _config()["contracts"] if c["type"] == "acyclic_siblings"]
    pairs = [tuple(part.strip() for part in line.split("->")) for line in contract.get("ignore_imports", [])]
    return [(a, b) for a, b in pairs]


def _lay_out(dest: pathlib.Path) -> pathlib.Path:
    """The package as installed, under dest (hard links where the file system allows)."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "voxgate", dest / "voxgate", copy_function=link, ignore=ignore)
    for name in SUBPACKAGES:
        shutil.copytree(ROOT / name, dest / "voxgate" / name, copy_function=link, ignore=ignore)
    return dest


def sibling_cycles(tree: pathlib.Path, ignored: list[tuple[str, str]], root: str = "voxgate") -> dict[str, list]:
    """For each package, the imports whose removal would leave its children acyclic (empty: none needed)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CYCLES, root, json.dumps(ignored)], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return {package: breakers for package, breakers in json.loads(out).items() if breakers}


def test_the_contracts_count_type_checking_imports():
    assert _config()["exclude_type_checking_imports"] is False


def test_the_acyclic_contract_ignores_no_import():
    assert _acyclic_ignores() == []


def test_no_sibling_modules_import_each_other_round_a_loop(tmp_path):
    assert sibling_cycles(_lay_out(tmp_path), _acyclic_ignores()) == {}


def test_a_cycle_made_only_for_the_type_checker_is_found(tmp_path):
    package = tmp_path / "looped"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    assert set(sibling_cycles(tmp_path, [], root="looped")) == {"looped"}
    assert sibling_cycles(tmp_path, [("looped.b", "looped.a")], root="looped") == {}
