"""engine.other_load: whether the rest of the machine is quiet, and the spin policy it drives."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from voxgate.engine.other_load import OtherLoad, usable_cores


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
    assert not load.quiet()  # nothing read yet
    load.sample()
    assert not load.quiet()  # one reading is no span
    r.advance(0.2, others_cores=0.1, own_cores=2.0)  # this process on every core: still quiet
    load.sample()
    assert load.quiet() and load.others_cores() == pytest.approx(0.1)
    r.advance(0.2, others_cores=1.0)
    load.sample()
    assert not load.quiet() and load.others_cores() == pytest.approx(1.0)


def test_the_answer_covers_the_last_span_only_however_long_the_machine_was_idle_before():
    load, r = scripted()
    load.sample()
    r.advance(3600.0, others_cores=0.0)  # an hour of quiet
    load.sample()
    r.advance(0.2, others_cores=1.0)  # then a busy process
    load.sample()
    assert not load.quiet()


def test_without_proc_stat_the_machine_counts_as_busy():
    load = OtherLoad(read_total=lambda: None)
    load.sample()
    load.sample()
    assert not load.quiet()
    assert load.others_cores() == float("inf")


def test_a_real_busy_process_is_seen_by_the_background_sampler_on_this_machine():
    assert os.path.exists("/proc/stat"), "this test reads Linux's /proc/stat"
    load = OtherLoad(window_s=0.05)
    seen = threading.Event()
    real_sample = load.sample

    def sample() -> None:
        real_sample()
        if 0.5 <= load.others_cores() < float("inf"):  # a measured span, not the unmeasured start
            seen.set()

    load.sample = sample  # type: ignore[method-assign]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        load.start()
        assert seen.wait(30.0), "a busy-looping process never showed in /proc/stat"
        assert not load.quiet()
    finally:
        load.close()
        busy.kill()
        busy.wait()


def test_usable_cores_is_at_most_the_affinity_mask():
    assert 0 < usable_cores() <= len(os.sched_getaffinity(0))


def test_usable_cores_takes_the_tightest_cgroup_quota_on_the_way_up(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    # cgroup v2: 1.5 cores on the service's parent, none on its own cgroup.
    (proc / "self" / "cgroup").write_text("0::/system.slice/voxgate.service\n")
    (root / "system.slice" / "voxgate.service").mkdir(parents=True)
    (root / "system.slice" / "voxgate.service" / "cpu.max").write_text("max 100000\n")
    (root / "system.slice" / "cpu.max").write_text("150000 100000\n")
    assert usable_cores(str(proc), str(root)) == pytest.approx(min(1.5, len(os.sched_getaffinity(0))))
    # cgroup v1: the cpu controller's quota, -1 meaning none.
    (proc / "self" / "cgroup").write_text("4:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc\n")
    v1 = root / "cpu,cpuacct" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(str(proc), str(root)) == pytest.approx(0.5)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cores(str(proc), str(root)) == len(os.sched_getaffinity(0))


def test_a_sampler_that_stopped_answers_busy():
    load, r = scripted()
    load.sample()
    r.advance(0.2, others_cores=0.0)
    load.sample()
    assert load.quiet()
    r.advance(10 * load.window_s, others_cores=0.0)  # no reading since
    assert not load.quiet()


@pytest.fixture(scope="module")
def engines():
    from voxgate.engine.piper.piper_engine import PiperEngine

    made = {}
    for policy in ("auto", "never"):
        e = PiperEngine(threads=2, spin=policy, device="cpu")
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


def test_the_engine_spins_on_a_quiet_machine_only_when_its_step_runs_alone(engines, monkeypatch):
    from voxgate.engine.base import SynthesisOptions

    engine = engines["auto"]
    loaded = engine._voice(None)
    asked = []
    real = loaded.sessions_for
    monkeypatch.setattr(loaded, "sessions_for", lambda threads, quiet=False: asked.append((threads, quiet)) or real(threads, quiet))
    monkeypatch.setattr(engine, "_usable_cores", 2.0)

    def speak(threads: int) -> None:
        job = engine.start("Hi there.", SynthesisOptions())
        while not job.done:
            engine.step([job], threads)

    for quiet in (True, False):
        monkeypatch.setattr(engine._other_load, "quiet", lambda q=quiet: q)
        asked.clear()
        before = engine.counters["spinning_runs"]
        speak(2)
        assert asked and all(a == (2, quiet) for a in asked)
        assert (engine.counters["spinning_runs"] > before) == quiet
    monkeypatch.setattr(engine._other_load, "quiet", lambda: True)
    # Another step in flight beside this one (a stream's first window on one thread): no spinning.
    engine._in_flight += 1
    try:
        asked.clear()
        speak(2)
        assert asked and all(a == (2, False) for a in asked)
    finally:
        engine._in_flight -= 1
    # More threads than the cores this process may use (a cgroup quota, a CPU mask): no spinning.
    monkeypatch.setattr(engine, "_usable_cores", 1.5)
    asked.clear()
    speak(2)
    assert asked and all(a == (2, False) for a in asked)
    # One thread never asks about the machine: it has no pool to spin.
    monkeypatch.setattr(engine._other_load, "quiet", lambda: pytest.fail("asked on a one-thread step"))
    speak(1)


def test_chunk_texts_of_streamed_piper_speech_join_exactly_as_the_input(engines):
    from voxgate.engine.base import SynthesisOptions

    text = "The weather today is sunny with a light breeze from the west, perfect for a long walk."
    for rate in (0.8, 1.0, 1.3):
        chunks = list(engines["never"].synthesize(text, SynthesisOptions(rate=rate)))
        assert len(chunks) > 2 and "".join(c.text for c in chunks) == text


def test_an_unknown_spin_policy_is_refused_in_plain_words():
    from voxgate.engine.base import EngineError
    from voxgate.engine.piper.piper_engine import PiperEngine

    with pytest.raises(EngineError, match="spin policy 'sometimes'"):
        PiperEngine(threads=2, spin="sometimes")


def test_engine_spin_is_a_setting_checked_at_start_and_handed_to_piper_only():
    from voxgate.config import ConfigError, Settings, settings_from
    from voxgate.gateway.gateway import _engine_client

    settings = settings_from(None, {"VOXGATE_ENGINE_SPIN": "never"})
    assert settings.engine_spin == "never"
    assert _engine_client(settings).config.engine_options == {"spin": "never", "prior_precision": "int8"}
    assert _engine_client(Settings(engine="tone")).config.engine_options == {}
    with pytest.raises(ConfigError, match="--engine-spin 'sometimes'"):
        Settings(engine_spin="sometimes").check()


def test_no_spinning_set_is_built_when_the_threads_exceed_the_usable_cores(monkeypatch):
    from voxgate.engine.piper import piper_engine

    monkeypatch.setattr(piper_engine, "usable_cores", lambda: 1.0)
    assert piper_engine.PiperEngine(threads=2, device="cpu")._spin_sets == "never"
    monkeypatch.setattr(piper_engine, "usable_cores", lambda: 2.0)
    assert piper_engine.PiperEngine(threads=2, device="cpu")._spin_sets == "auto"
    assert piper_engine.PiperEngine(threads=2, device="cpu", spin="always")._spin_sets == "always"
