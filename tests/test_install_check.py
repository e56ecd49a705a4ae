"""voxgate/__init__.py and cli.py: a clone that is not installed says to install it, instead of a bare import error.

The folders install as voxgate.signaling, voxgate.gateway, ... (pyproject's
package-dir mapping), so `voxgate/` alone, imported from a clone, is not the
package. The suite's own Python has the project installed (editable), so the
uninstalled case runs with `python -S` (no site-packages: nothing installed),
and the wrong-install case from a copy of `voxgate/` elsewhere, which this
Python's installed mapping does not point at.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

from tests.conftest import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HINT = "pip install -e ."


def run(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def test_module_run_from_an_uninstalled_clone_says_to_install():
    for args in (["-S", "-m", "voxgate", "--help"], ["-S", "-m", "voxgate.cli", "serve"]):
        proc = run(args, ROOT)
        assert proc.returncode != 0
        assert HINT in proc.stderr and "is not installed" in proc.stderr, proc.stderr[-800:]


def test_cli_run_as_a_file_says_to_install():
    proc = run(["-S", os.path.join("voxgate", "cli.py"), "serve"], ROOT)
    assert proc.returncode != 0
    assert HINT in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-800:]


def test_a_clone_other_than_the_installed_one_is_refused(tmp_path):
    shutil.copytree(os.path.join(ROOT, "voxgate"), tmp_path / "voxgate", ignore=shutil.ignore_patterns("__pycache__"))
    proc = run(["-m", "voxgate", "--help"], str(tmp_path))
    assert proc.returncode != 0
    assert "is not the installed one" in proc.stderr and HINT in proc.stderr, proc.stderr[-800:]


def test_the_installed_package_runs_from_anywhere(tmp_path):
    proc = run(["-m", "voxgate", "--help"], str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-800:]
    assert "serve" in proc.stdout


def test_every_package_folder_is_in_pyprojects_package_list():
    """A subpackage missing from `packages` imports from a clone (the editable install maps whole folders)
    but is left out of a wheel and of the containers' `pip install .`; so the list names every folder that
    holds an __init__.py, and nothing else."""
    setuptools = tomllib.loads((pathlib.Path(ROOT) / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {package: pathlib.Path(ROOT) / folder for package, folder in setuptools["package-dir"].items()}
    found = set()
    for package, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                found.add(".".join([package, *init.parent.relative_to(folder).parts]))
    assert {"voxgate.gateway.media", "voxgate.engine.runtime"} <= found
    assert sorted(setuptools["packages"]) == sorted(found)
