"""aiortc's, aioice's and pylibsrtp's internals: reached from one module, checked against the pinned versions."""

import ast
import inspect
import logging
import pathlib
import re
import sys

import aiohttp
import aioice
import aiortc
import pylibsrtp
from packaging.requirements import Requirement

from tests.conftest import in_process_gateway
from voxgate.gateway.media import rtc_internals

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRODUCT = ("voxgate", "signaling", "gateway", "engine")
THE_MODULE = pathlib.Path("gateway/media/rtc_internals.py")
# Methods of aioice's objects that the fast paths replace on an instance: public names, private use.
PATCHED = {"datagram_received", "data_received", "send_stun", "get_host_addresses"}


def test_the_installed_versions_are_the_pinned_ones():
    pins = {}
    for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(line)
        pins[req.name] = req.specifier
    installed = rtc_internals.versions()
    for name in ("aiortc", "aioice", "pylibsrtp"):
        assert name in pins and pins[name].contains(installed[name]), (name, installed[name], str(pins.get(name)))
        # An upper bound: an upgrade is a decision, checked by this test, not an accident.
        assert any(spec.operator == "<" for spec in pins[name]), (name, str(pins[name]))


async def test_every_fast_path_applies_on_the_pinned_versions():
    # In a loop, as at the server's start: aiortc's transports make futures.
    paths = rtc_internals.fast_paths()
    assert set(paths) == set(rtc_internals.FAST_PATHS)
    assert [name for name, on in paths.items() if not on] == []


def _private_names() -> set[str]:
    """The underscore names aiortc's, aioice's and pylibsrtp's own code defines or assigns."""
    names: set[str] = set()
    for package in (aiortc, aioice, pylibsrtp):
        for path in pathlib.Path(package.__file__).parent.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    names.add(node.attr)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_") \
                        and not node.name.endswith("__"):
                    names.add(node.name)
    return names


def _own_names(trees) -> set[str]:
    """Every name the product defines itself: its own privates may share a name with aiortc's."""
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
    return own


def private_reaches(files: dict[pathlib.Path, str]) -> list[str]:
    trees = {path: ast.parse(text) for path, text in files.items()}
    theirs = _private_names()
    own = _own_names(tree for path, tree in trees.items() if path != THE_MODULE)
    mangled = re.compile(r"^_(RTC\w+|HeaderExtensionsMap|Connection|StunProtocol|Session|Policy)__\w+")
    public = set(aiortc.__all__)
    found = []
    for path, tree in sorted(trees.items()):
        if path == THE_MODULE:
            continue
        for node in ast.walk(tree):
            where = f"{path}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in ("aioice", "pylibsrtp")]
            elif isinstance(node, ast.ImportFrom) and node.module:
                top = node.module.split(".")[0]
                if top in ("aioice", "pylibsrtp"):
                    found.append(f"{where}: from {node.module} import ...")
                elif top == "aiortc":
                    found += [f"{where}: from {node.module} import {a.name}" for a in node.names if a.name not in public]
            elif isinstance(node, ast.Attribute):
                self_access = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if mangled.match(node.attr) or (not self_access and node.attr in theirs and node.attr not in own):
                    found.append(f"{where}: .{node.attr}")
                elif isinstance(node.ctx, ast.Store) and not self_access and node.attr in PATCHED:
                    found.append(f"{where}: .{node.attr} = ...")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if mangled.match(node.value) or (node.value in theirs and node.value not in own):
                    found.append(f"{where}: {node.value!r}")
    return found


def product_files() -> dict[pathlib.Path, str]:
    return {
        path.relative_to(ROOT): path.read_text()
        for folder in PRODUCT for path in (ROOT / folder).rglob("*.py")
    }


def test_private_aiortc_names_appear_in_one_product_module():
    files = product_files()
    assert THE_MODULE in files
    assert private_reaches(files) == []


def test_the_scan_finds_each_kind_of_reach():
    """The scan itself, on a module that reaches in each way it looks for."""
    reaching = inspect.cleandoc('''
        import aioice.ice
        from pylibsrtp import Error
        from aiortc.rtp import RtcpRrPacket
        from aiortc import RTCRtpSender

        def f(sender, dtls, protocol):
            sender._handle_rtcp_packet = None
            dtls._RTCDtlsTransport__tx_bytes += 1
            protocol.datagram_received = print
            return getattr(sender, "_ssrc"), getattr(sender, "_RTCRtpSender__mid")
    ''')
    found = private_reaches({pathlib.Path("gateway/reaching.py"): reaching})
    assert sorted(line.split(": ", 1)[1] for line in found) == sorted([
        "import aioice.ice", "from pylibsrtp import ...", "from aiortc.rtp import RtcpRrPacket",
        "._handle_rtcp_packet", "._RTCDtlsTransport__tx_bytes", ".datagram_received = ...",
        "'_ssrc'", "'_RTCRtpSender__mid'",
    ]), found


async def test_the_server_logs_and_exposes_which_fast_paths_apply(caplog):
    caplog.set_level(logging.DEBUG, logger=rtc_internals.log.name)
    async with in_process_gateway() as (app, url):
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
            text = await resp.text()
    lines = [r for r in caplog.records if r.name == rtc_internals.log.name and "fast paths" in r.getMessage()]
    # One line, at debug: the server's start-up "fast paths:" line carries the count (summary()).
    assert len(lines) == 1 and lines[0].levelno == logging.DEBUG, [r.getMessage() for r in lines]
    assert rtc_internals.summary(app["gateway"].fast_paths).startswith(f"{len(rtc_internals.FAST_PATHS)} of "
                                                                        f"{len(rtc_internals.FAST_PATHS)} aiortc")
    for path in rtc_internals.FAST_PATHS:
        assert f'voxgate_fast_path_active{{path="{path}"}} 1.0' in text, path
        assert path in lines[0].getMessage()
