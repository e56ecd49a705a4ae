"""voxgate/config.py: every setting in its range before anything loads, each default written once,
`--help` one line per flag in groups, the README agreeing with it, and configuration a leaf."""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest

from voxgate.config import ConfigError, PoolSettings, Settings, threads_or_every_core
from voxgate.config_fields import allowed_values, default_of, flag_of, shown_default

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANGED = [
    pytest.param(kind, f, id=f"{kind.__name__}{flag_of(f.name)}")
    for kind in (Settings, PoolSettings)
    for f in fields(kind)
    if f.metadata.get("low") is not None or f.metadata.get("choices")
]


def out_of_range(f) -> list:
    """Values just outside a setting's range, and junk of the right type."""
    m, default = f.metadata, default_of(f)
    if m.get("low") is None:
        return ["nonsense", default.lower() + "x" if isinstance(default, str) else "x"]
    step = 1 if isinstance(default, (int, str)) and not isinstance(default, float) else 0.001
    below = m["low"] - step
    if below == 0 and m.get("zero"):
        below = -1
    bad = [below, m["high"] + step]
    if isinstance(default, float):
        bad += [math.nan, math.inf]
    if isinstance(default, str):  # a word or a number (--encode-threads)
        bad = [str(v) for v in bad] + ["nonsense", "1.5"]
    return bad


def test_every_flag_with_a_range_is_listed():
    # The four, among the rest.
    names = {p.values[1].name for p in RANGED if p.values[0] is Settings}
    assert {"port", "vad_aggressiveness", "opus_bitrate", "max_sessions", "engine", "log_level"} <= names
    numbers = {f.name for f in fields(Settings) if type(default_of(f)) in (int, float)}
    assert numbers <= names, numbers - names


@pytest.mark.parametrize(("kind", "f"), RANGED)
def test_each_flag_refuses_values_outside_its_range_naming_the_flag_and_the_range(kind, f):
    kind().check()  # the default is inside
    for bad in out_of_range(f):
        with pytest.raises(ConfigError) as caught:
            kind(**{f.name: bad}).check()
        message = str(caught.value)
        assert message.startswith(flag_of(f.name) + " "), message
        assert allowed_values(f) in message or ", ".join(f.metadata["choices"]) in message, message


# The examples, and the environment's way in: refused by the command itself, with status 2,
# before aiortc, the engine or the voice is imported.
COMMANDS = [
    (["serve", "--port", "70000"], {}, "--port 70000: give 0 (a free one), or 1 to 65535"),
    (["serve", "--vad-aggressiveness", "7"], {}, "--vad-aggressiveness 7: give 0 to 3"),
    (["serve", "--opus-bitrate", "-5"], {}, "--opus-bitrate -5: give 6000 to 510000"),
    (["serve", "--max-sessions", "-1"], {}, "--max-sessions -1: give 1 to 100000"),
    (["serve"], {"VOXGATE_OPUS_COMPLEXITY": "11"}, "--opus-complexity 11: give 0 to 10"),
    (["serve"], {"VOXGATE_PORT": "eighty"}, "VOXGATE_PORT='eighty': not a whole number"),
    (["serve", "--engine", "espeak"], {}, "--engine 'espeak': choose one of piper, tone, torch, cosyvoice2"),
    (["engine", "serve", "--max-replicas", "0"], {}, "--max-replicas 0: give 1 to 1000"),
    (["say", "hi", "--rate", "9"], {}, "--rate 9: give 0.25 to 4"),
]


def test_bad_values_stop_the_command_with_status_2_before_anything_loads():
    script = """
import contextlib, io, json, os, sys
from voxgate.cli import main
out = []
for argv, env, _ in json.loads(sys.argv[1]):
    os.environ.update(env)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    for name in env:
        del os.environ[name]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("aiortc", "onnxruntime", "ray")
                    or m.startswith(("voxgate.engine", "voxgate.gateway", "voxgate.signaling")))
    out.append([code, err.getvalue(), loaded])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VOXGATE_")}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(COMMANDS)], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    for (argv, environ, expected), (code, stderr, loaded) in zip(COMMANDS, json.loads(done.stdout)):
        assert code == 2, (argv, environ, stderr)
        assert stderr.strip() == f"voxgate: {expected}", (argv, environ, stderr)
        assert loaded == [], (argv, loaded)


def test_defaults_are_written_once():
    """The gateway's and the engine's dataclasses take their defaults from the settings."""
    from voxgate.engine.runtime.client import EngineConfig
    from voxgate.engine.cluster.pool import PoolConfig
    from voxgate.engine.text.text_pipeline import FIRST_UNIT_TIMEOUT_S
    from voxgate.gateway.media.encoder import OpusSettings
    from voxgate.gateway.sessions.protocol import Limits
    from voxgate.gateway.sessions.session import SessionOptions
    from voxgate.gateway.caller.vad import VadSettings

    s, opus, vad, limits = Settings(), OpusSettings(), VadSettings(), Limits()
    assert (opus.bitrate, opus.fec, opus.dtx, opus.dtx_when_asked, opus.complexity, opus.signal) == (
        s.opus_bitrate, s.opus_fec, s.opus_dtx, s.opus_dtx_when_asked, s.opus_complexity, s.opus_signal)
    assert (vad.enabled, vad.aggressiveness, vad.min_speech_ms) == (s.vad, s.vad_aggressiveness, s.vad_min_speech_ms)
    assert (limits.max_message_bytes, limits.max_text_chars, limits.max_messages_per_s) == (
        s.max_message_bytes, s.max_text_chars, s.max_messages_per_s)
    options = SessionOptions()
    assert (options.max_utterance_chars, options.max_queued_utterances) == (s.max_utterance_chars, s.max_queued_utterances)
    engine = EngineConfig()
    assert (engine.engine, engine.voice, engine.device, engine.log_level) == (s.engine, s.voice, s.device, s.log_level)
    assert FIRST_UNIT_TIMEOUT_S * 1000 == s.first_unit_timeout_ms
    pool, pool_settings = PoolConfig(), PoolSettings()
    assert (pool.engine, pool.num_cpus, pool.max_ongoing_requests) == (
        pool_settings.engine, pool_settings.replica_cpus, pool_settings.max_ongoing_requests)

    # ... and write no literal of their own for a setting's default.
    owners = {"gateway/media/encoder.py": "OpusSettings", "gateway/caller/vad.py": "VadSettings", "gateway/sessions/protocol.py": "Limits",
              "gateway/sessions/session.py": "SessionOptions", "engine/runtime/client.py": "EngineConfig", "engine/cluster/pool_host.py": "PoolConfig"}
    setting_names = {f.name for kind in (Settings, PoolSettings) for f in fields(kind)}
    for path, name in owners.items():
        tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        for item in cls.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.value, ast.Constant):
                field_name = item.target.id
                assert not ({field_name, f"opus_{field_name}", f"vad_{field_name}", f"engine_{field_name}"} & setting_names) or \
                    field_name in ("parallel", "threads"), f"{path}: {name}.{field_name} repeats a setting's default"


def test_zero_threads_means_every_core_in_one_place():
    assert threads_or_every_core(0) == threads_or_every_core(None) == (os.cpu_count() or 1)
    assert threads_or_every_core(3) == 3 and Settings(engine_threads=2).threads == 2
    # Nowhere else in the product does `or os.cpu_count()` resolve a setting.
    for folder in ("engine", "gateway", "signaling", "voxgate"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py") and name != "config.py":
                    text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                    assert not re.search(r"or \(?os\.cpu_count\(\)", text), os.path.join(dirpath, name)


def test_configuration_is_a_leaf_and_the_only_reader_of_the_environment():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, voxgate.config; print(sorted(m for m in sys.modules if m.startswith('voxgate')))"],
        capture_output=True, text=True, timeout=30,
    )
    assert done.stdout.strip() == "['voxgate', 'voxgate.config', 'voxgate.config_fields']", done.stdout + done.stderr
    # config.py imports the standard library and config_fields.py (how a setting is declared), which imports
    # the standard library alone.
    for name in ("config.py", "config_fields.py"):
        tree = ast.parse(open(os.path.join(ROOT, "voxgate", name), encoding="utf-8").read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                own = name == "config.py" and node.level == 1 and node.module == "config_fields"
                assert own or (node.level == 0 and node.module.split(".")[0] in sys.stdlib_module_names), ast.dump(node)
    # The environment: read in config alone (the engine worker and the pool used to read VOXGATE_LOG_LEVEL).
    for folder in ("engine", "gateway", "signaling"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith(".py"):
                    text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                    assert not re.search(r"os\.environ\.get|os\.getenv|environ\[\"VOXGATE", text), os.path.join(dirpath, name)


def test_help_is_grouped_one_line_per_flag_without_figures():
    env = {**os.environ, "COLUMNS": "120"}
    for command, kind in ((["serve"], Settings), (["engine", "serve"], PoolSettings)):
        done = subprocess.run([sys.executable, "-m", "voxgate.cli", *command, "--help"], capture_output=True, text=True,
                              timeout=30, env=env)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert max(map(len, lines)) <= 120
        headings = [line.split(" (")[0] for line in lines if line and not line.startswith(" ") and line.endswith("):")]
        if kind is Settings:
            assert headings == ["listening", "access", "voice", "media", "recognition", "relay", "limits", "fleet", "tuning", "logging"], headings
        for f in fields(kind):
            starts = (flag_of(f.name) + " ", "--[no-]" + flag_of(f.name)[2:] + " ")
            [line] = [line for line in lines if line.lstrip().startswith(starts)]
            following = (lines + [""])[lines.index(line) + 1]
            assert not following.startswith(" " * 10), f"{flag_of(f.name)} takes more than one line:\n{line}\n{following}"
            assert f"default {shown_default(f)}" in line, line
            # Figures belong in docs/benchmarks.md, not in help.
            assert not re.search(r"\d\s?(ms|µs|%|x slower|x faster)\b", f.metadata["help"]), line
        assert len(lines) <= len(fields(kind)) + 3 * 8 + 10


def test_the_readme_table_shows_the_defaults_help_shows():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = readme.split("## Settings", 1)[1].split("\n## ", 1)[0]
    by_name = {f.name: f for f in fields(Settings)}
    checked = 0
    for row in re.findall(r"^\| (`.+?) \| (.+?) \|", section, flags=re.M):
        names = re.findall(r"`(--[a-z0-9-]+|VOXGATE_[A-Z0-9_]+)", row[0])
        keys = []
        for name in names:
            key = name.removeprefix("VOXGATE_").lower() if name.startswith("VOXGATE_") else name[2:].replace("-", "_")
            key = key.removeprefix("no_") if key.removeprefix("no_") in by_name and key not in by_name else key
            if key not in keys:
                keys.append(key)
        shown = row[1].replace("`", "")
        values = [shown] * len(keys) if len(keys) == 1 or ", " not in shown else shown.split(", ")
        if len(values) == 1:
            values *= len(keys)
        assert len(values) == len(keys), row
        for key, value in zip(keys, values):
            assert key in by_name, f"the README names {key}, which is no setting"
            assert value.startswith(shown_default(by_name[key])), f"README: {flag_of(key)} defaults to {value!r}; --help: {shown_default(by_name[key])!r}"
            checked += 1
    assert checked >= 12


def test_every_flag_has_its_details_in_docs_settings():
    doc = open(os.path.join(ROOT, "docs", "settings.md"), encoding="utf-8").read()
    missing = [flag_of(f.name) for kind in (Settings, PoolSettings) for f in fields(kind) if f"`{flag_of(f.name)}" not in doc]
    assert missing == []


def test_every_option_of_say_and_probe_says_what_it_does():
    """`voxgate say --help` once listed --engine, --voice and --device with no text (issue 38, bug 8)."""
    env = {**os.environ, "COLUMNS": "120"}
    for command in (["say"], ["probe"]):
        done = subprocess.run([sys.executable, "-m", "voxgate.cli", *command, "--help"], capture_output=True, text=True,
                              timeout=30, env=env)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.split("options:", 1)[1].splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("  -"):
                continue
            described = re.match(r"  \S.*?\s{2,}\S", line) or (lines + [""])[i + 1].startswith(" " * 10)
            assert described, f"voxgate {' '.join(command)}: {line.strip()} has no help text"
        if command == ["say"]:
            [voice] = [line for line in lines if line.lstrip().startswith("--voice")]
            assert "joe" in voice + lines[lines.index(voice) + 1], voice
