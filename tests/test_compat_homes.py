"""The dependencies whose internals the product reaches, other than aiortc's (gateway/media/rtc_internals.py and
tests/gateway/test_rtc_internals.py): each reach lives in one module for its dependency, pinned where a pin
can hold it, checked at start and said in the start-up line.

- Ray: engine/cluster/ray_internals.py (Serve's controller, `ray.serve._private`);
- PyAV: gateway/media/av_internals.py (the wheel's `av.libs` folder, where its libopus ships);
- asyncio: gateway/media/loop_internals.py (the loop's `_ready` queue);
- prometheus-client: none; its metrics are read through their public API, and admission keeps its own counts.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import pathlib
import sys

import pytest
from packaging.requirements import Requirement

from tests.conftest import in_process_gateway
from voxgate.engine.cluster import ray_internals
from voxgate.gateway.media import av_internals, loop_internals, opus

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRODUCT = ("voxgate", "signaling", "gateway", "engine", "bench")
RAY_HOME = pathlib.Path("engine/cluster/ray_internals.py")
AV_HOME = pathlib.Path("gateway/media/av_internals.py")
LOOP_HOME = pathlib.Path("gateway/media/loop_internals.py")
RAY_HINT = 'Ray is the engine pool\'s: pip install ".[scale]" in the clone (as tests/pool/ need)'


def _pins() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"]) + list(project["optional-dependencies"]["scale"])
    return {req.name: req for req in map(Requirement, lines)}


@pytest.mark.parametrize("name, version", [("av", av_internals.version), ("ray", ray_internals.version)])
def test_each_dependency_reached_into_is_pinned_both_ways_around_the_installed_version(name, version):
    if name == "ray":
        pytest.importorskip("ray.serve", reason=RAY_HINT)
    spec = _pins()[name].specifier
    # An upper bound: an upgrade is a decision, checked by this file, not an accident.
    assert any(s.operator == "<" for s in spec), (name, str(spec))
    assert spec.contains(version()), (name, version(), str(spec))


def test_the_ray_names_the_replica_listing_uses_are_there():
    pytest.importorskip("ray.serve", reason=RAY_HINT)
    assert ray_internals.check()
    assert ray_internals.summary(True).startswith("replicas listed from Serve's controller (Ray 2.")


def test_the_libopus_in_use_is_the_one_pyav_bundles():
    bundled = av_internals.bundled("libopus")
    assert bundled, "PyAV's wheel ships no libopus where av_internals looks"
    path, version = opus.library()
    assert path == bundled[0] and version.startswith("libopus ")
    assert av_internals.summary(path, version) == f"{version} from PyAV {av_internals.version()}'s wheel"
    assert "the system" in av_internals.summary("/usr/lib/libopus.so.0", version)


async def test_asyncio_loops_show_their_waiting_callbacks():
    loop = asyncio.get_running_loop()
    assert loop_internals.check()
    loop.call_soon(lambda: None)
    assert loop_internals.callbacks_waiting(loop)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not loop_internals.callbacks_waiting(loop)


async def test_the_start_up_line_says_each_check():
    from voxgate.gateway.media_startup import fast_paths_line

    async with in_process_gateway() as (app, _):
        gw = app["gateway"]
        line = fast_paths_line(gw.settings, gw.engine.info, gw.fast_paths, gw.compat)
    assert f"from PyAV {av_internals.version()}'s wheel" in line, line
    assert "the event loop's waiting callbacks read" in line, line


# -- the scan: no other module names these internals ---------------------------------------------

def private_reaches(files: dict[pathlib.Path, str]) -> list[str]:
    found = []
    for path, text in sorted(files.items()):
        for node in ast.walk(ast.parse(text)):
            where = f"{path}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray.serve._private") \
                    and path != RAY_HOME:
                found.append(f"{where}: from {node.module} import ...")
            elif isinstance(node, ast.Import) and path != RAY_HOME:
                found += [f"{where}: import {a.name}" for a in node.names if a.name.startswith("ray.serve._private")]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if path != AV_HOME and node.value in ("av.libs", ".dylibs"):
                    found.append(f"{where}: {node.value!r}")
                elif path != LOOP_HOME and node.value == "_ready":
                    found.append(f"{where}: {node.value!r}")
            elif isinstance(node, ast.Attribute):
                own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if own:
                    continue  # the product's own attributes may share these names
                if node.attr == "_ready" and path != LOOP_HOME:
                    found.append(f"{where}: ._ready")
                # prometheus_client's metric state (a Counter's or Gauge's _value, a Histogram's _buckets and _sum).
                elif node.attr in ("_value", "_buckets", "_sum"):
                    found.append(f"{where}: .{node.attr}")
                elif node.attr == "_private" and path != RAY_HOME:
                    found.append(f"{where}: ._private")
    # engine/cluster/remote_stream.py uses RemoteEngineClient's public interface (remote_stream.PoolClient).
    stream = pathlib.Path("engine/cluster/remote_stream.py")
    if stream in files:
        for node in ast.walk(ast.parse(files[stream])):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and "client" in ast.unparse(node.value):
                found.append(f"{stream}:{node.lineno}: {ast.unparse(node)}")
    return found


def product_files() -> dict[pathlib.Path, str]:
    return {path.relative_to(ROOT): path.read_text() for folder in PRODUCT for path in (ROOT / folder).rglob("*.py")}


def test_each_dependency_s_internals_are_named_in_its_one_module():
    files = product_files()
    assert {RAY_HOME, AV_HOME, LOOP_HOME} <= set(files)
    assert private_reaches(files) == []


def test_the_scan_finds_each_kind_of_reach():
    reaching = inspect.cleandoc('''
        from ray.serve._private.common import RequestProtocol
        import ray.serve._private.constants

        def f(loop, metric, histogram, site, client):
            os.path.join(site, "av.libs")
            getattr(loop, "_ready")
            loop._ready
            metric._value.get()
            histogram._buckets
            self._value = 1  # its own: fine
            return client._streams
    ''')
    found = private_reaches({pathlib.Path("engine/cluster/remote_stream.py"): reaching})
    assert sorted(line.split(": ", 1)[1] for line in found) == sorted([
        "from ray.serve._private.common import ...", "import ray.serve._private.constants", "'av.libs'",
        "'_ready'", "._ready", "._value", "._buckets", "client._streams",
    ]), found
