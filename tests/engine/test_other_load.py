"""engine.other_load: whether the rest of the machine is quiet, and the spin policy it drives."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from voxgate.engine.other_load import OtherLoad


class Readings:
    """Scripted CPU counters: total (every process) and own, in seconds, and a clock."""

    def __init__(self) -> None:
        self.now = self.total = self.own = 0.0

    def advance(self, seconds: float, others_cores: float, own_cores: float = 0.0) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.total += (others_cores + own_cores) * seconds


def scripted() -> tuple[OtherLoad, Readings]:
    r = Readings()
    load = OtherLoad(read_total=lambda: r.total, read_own=lambda: r.own, clock=lambda: r.now)
    return load, r


def test_busy_until_measured_then_other_processes_count_and_own_work_does_not():
    load, r = scripted()
    assert not load.quiet()  # one reading is no span
    r.advance(0.5, others_cores=0.1, own_cores=2.0)  # this process on every core: still quiet
    assert load.quiet() and load.others_cores() == pytest.approx(0.1)
    r.advance(0.5, others_cores=1.0)
    assert not load.quiet() and load.others_cores() == pytest.approx(1.0)


def test_readings_closer_than_the_window_reuse_the_last_answer():
    load, r = scripted()
    load.others_cores()
    r.advance(0.5, others_cores=0.0)
    assert load.quiet()
    r.advance(load.window_s / 2, others_cores=50.0)  # too short a span to read
    assert load.quiet()
    r.advance(load.window_s, others_cores=1.0)
    assert not load.quiet()


def test_without_proc_stat_the_machine_counts_as_busy():
    load = OtherLoad(read_total=lambda: None)
    assert not load.quiet()
    assert load.others_cores() == float("inf")


def test_a_real_busy_process_is_seen_on_this_machine():
    load = OtherLoad(window_s=0.05)
    load.others_cores()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        # Read until a span shows it (this loop's own CPU is not counted), with a generous bound.
        deadline = time.monotonic() + 30.0
        while load.others_cores() < 0.5:
            assert time.monotonic() < deadline, "a busy-looping process never showed in /proc/stat"
            busy.poll()
            assert busy.returncode is None
        assert not load.quiet()
    finally:
        busy.kill()
        busy.wait()


@pytest.fixture(scope="module")
def engines():
    from voxgate.engine.piper_engine import PiperEngine

    made = {}
    for policy in ("auto", "never"):
        e = PiperEngine(threads=2, spin=policy)
        e.load()
        made[policy] = e
    return made


def _config(session, key: str) -> str:
    return session.get_session_options().get_session_config_entry(key)


def test_every_core_sessions_spin_only_in_the_spinning_set_and_always_stop_after_a_run(engines):
    loaded = engines["auto"]._voice(None)
    quiet, busy, single = loaded.sessions_for(2, quiet=True), loaded.sessions_for(2), loaded.sessions_for(1, quiet=True)
    assert quiet is not busy and quiet.threads == busy.threads == 2 and single.threads == 1
    for sessions, spins in ((quiet, "1"), (busy, "0")):
        for stage in (sessions.prior, sessions.flow, sessions.decoder):
            assert _config(stage, "session.intra_op.allow_spinning") == spins
            assert _config(stage, "session.force_spinning_stop") == "1"
    never = engines["never"]._voice(None)
    assert never.spinning == {} and never.sessions_for(2, quiet=True) is never.sessions_for(2)


def test_the_engine_spins_on_a_quiet_machine_only(engines, monkeypatch):
    from voxgate.engine.base import SynthesisOptions

    engine = engines["auto"]
    loaded = engine._voice(None)
    asked = []
    real = loaded.sessions_for
    monkeypatch.setattr(loaded, "sessions_for", lambda threads, quiet=False: asked.append((threads, quiet)) or real(threads, quiet))
    for quiet in (True, False):
        monkeypatch.setattr(engine._other_load, "quiet", lambda q=quiet: q)
        asked.clear()
        job = engine.start("Hi.", SynthesisOptions())
        while not job.done:
            engine.step([job], 2)
        assert asked and all(a == (2, quiet) for a in asked)
    # One thread never asks about the machine: it has no pool to spin.
    monkeypatch.setattr(engine._other_load, "quiet", lambda: pytest.fail("asked on a one-thread step"))
    job = engine.start("Hi.", SynthesisOptions())
    while not job.done:
        engine.step([job], 1)


def test_an_unknown_spin_policy_is_refused_in_plain_words():
    from voxgate.engine.base import EngineError
    from voxgate.engine.piper_engine import PiperEngine

    with pytest.raises(EngineError, match="spin policy 'sometimes'"):
        PiperEngine(threads=2, spin="sometimes").load()


def test_engine_spin_is_a_setting_checked_at_start_and_handed_to_piper_only():
    from voxgate.config import ConfigError, Settings, settings_from
    from voxgate.gateway.gateway import _engine_client

    settings = settings_from(None, {"VOXGATE_ENGINE_SPIN": "never"})
    assert settings.engine_spin == "never"
    assert _engine_client(settings).config.engine_options == {"spin": "never"}
    assert _engine_client(Settings(engine="tone")).config.engine_options == {}
    with pytest.raises(ConfigError, match="--engine-spin 'sometimes'"):
        Settings(engine_spin="sometimes").check()
