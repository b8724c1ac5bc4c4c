"""The engine's thread count (llminfer.core.threads): fixed, from OMP_NUM_THREADS, or adapted to idle cores."""

from __future__ import annotations

import pytest
import torch

from llminfer.config import EngineConfig
from llminfer.core.model_thread import ModelThread, ModelThreadLease
from llminfer.core.threads import ThreadGovernor, own_cpu_seconds, read_busy_seconds
from llminfer.errors import ConfigError


class FakeMachine:
    """An injected clock and /proc/stat: ``others`` cores busy with other processes, ``own`` with ours."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = 0.0
        self.own_s = 0.0

    def advance(self, seconds: float, others: float, own: float = 1.0) -> None:
        self.t += seconds
        self.busy += seconds * (others + own)
        self.own_s += seconds * own

    def governor(self, **kwargs) -> ThreadGovernor:
        return ThreadGovernor(clock=lambda: self.t, busy_reader=lambda cpus: self.busy, own_reader=lambda: self.own_s,
                              cpus=[0, 1, 2, 3], sleep=self.sleep, **kwargs)

    def sleep(self, seconds: float) -> None:
        self.advance(seconds, others=self.others_now, own=0.0)

    others_now = 0.0


@pytest.fixture(autouse=True)
def _no_omp_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_auto_drops_at_once_when_a_neighbour_takes_cores_and_grows_back_after_two_windows():
    m = FakeMachine()
    g = m.governor(max_threads=4)
    assert g.mode == "auto" and g.threads == 4
    m.advance(0.5, others=2.0)
    assert g.update() == 2
    assert g.describe()["threads_other_processes_busy_cores"] == pytest.approx(2.0)
    m.advance(0.6, others=0.0)
    assert g.update() == 2  # one quiet window is not enough to grow
    m.advance(0.6, others=0.0)
    assert g.update() == 4
    m.advance(0.6, others=3.9)
    assert g.update() == 1  # never below one
    assert g.changes == 3


def test_the_first_call_waits_for_a_short_first_window():
    m = FakeMachine()
    m.others_now = 3.0
    g = m.governor(max_threads=4)
    m.advance(0.02, others=3.0)
    assert g.update() == 1 and m.t == pytest.approx(0.1)  # slept the rest of the 0.1 s window
    m.advance(0.2, others=0.0)
    assert g.update() == 1  # later windows are 0.5 s: no new measurement yet, and no sleep
    assert m.t == pytest.approx(0.3)


def test_auto_counts_a_core_used_70_percent_or_more_as_busy():
    m = FakeMachine()
    g = m.governor(max_threads=4)
    m.advance(1.0, others=0.6)
    assert g.update() == 3  # floor(4 - 0.6 + 0.3)
    m.advance(1.0, others=0.8)
    assert g.update() == 3  # floor(3.5)
    m.advance(1.0, others=1.0)
    assert g.update() == 3  # floor(3.3)
    m.advance(1.0, others=1.75)
    assert g.update() == 2


def test_compiled_graphs_keep_one_count():
    """adapt=False (the compiled backend): the count stays, whatever the neighbours do; an explicit count wins."""
    m = FakeMachine()
    g = m.governor(max_threads=4, adapt=False)
    assert g.mode == "fixed (compiled graphs)" and g.threads == 4
    m.advance(0.6, others=3.0)
    assert g.update() == 4 and g.changes == 0
    assert m.governor(num_threads=2, adapt=False).threads == 2
    engine = __import__("llminfer").InferenceEngine(EngineConfig(backend="compiled"))
    assert engine.threads.mode == "fixed (compiled graphs)"
    assert __import__("llminfer").InferenceEngine(EngineConfig()).threads.mode == "auto"


def test_fixed_and_environment_counts_never_change(monkeypatch):
    m = FakeMachine()
    g = m.governor(num_threads=3)
    m.advance(1.0, others=4.0)
    assert (g.mode, g.update()) == ("fixed", 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    g = m.governor()
    m.advance(1.0, others=0.0)
    assert g.mode == "OMP_NUM_THREADS" and g.update() == torch.get_num_threads()
    with pytest.raises(ValueError, match="num_threads"):
        ThreadGovernor(0)


def test_auto_keeps_the_default_where_proc_stat_cannot_be_read(tmp_path):
    g = ThreadGovernor(busy_reader=lambda cpus: None, max_threads=2)
    assert g.update() == 2 and g.mode.startswith("auto (no /proc/stat")
    assert read_busy_seconds([0], str(tmp_path / "missing")) is None
    (tmp_path / "stat").write_text("cpu  1 2 3 4 5 6 7 8 0 0\ncpu0 100 0 100 900 5 0 0 50 0 0\n")
    import os

    # user 100 + system 100; idle, iowait and steal (50) are not busy
    assert read_busy_seconds([0], str(tmp_path / "stat")) == pytest.approx(200 / os.sysconf("SC_CLK_TCK"))
    assert read_busy_seconds([1], str(tmp_path / "stat")) is None


def test_engines_sharing_the_model_thread_each_run_with_their_own_count():
    thread = ModelThread(name="llminfer-test-threads")
    try:
        one = ModelThreadLease(thread, ThreadGovernor(1))
        three = ModelThreadLease(thread, ThreadGovernor(3))
        plain = ModelThreadLease(thread)
        assert one.call(torch.get_num_threads) == 1
        assert three.call(torch.get_num_threads) == 3
        assert plain.call(torch.get_num_threads) == 3  # no governor: whatever the thread has
        assert one.submit(torch.get_num_threads).result() == 1
        for lease in (one, three, plain):
            lease.close()
    finally:
        thread.close()


def test_config_and_engine_info_say_the_count():
    with pytest.raises(ConfigError, match="num_threads"):
        EngineConfig(num_threads=0)
    assert EngineConfig(num_threads=2).to_dict()["num_threads"] == 2
    assert EngineConfig.from_dict(EngineConfig().to_dict()).num_threads is None


def test_own_cpu_seconds_counts_living_child_processes():
    """A child process's CPU time is this engine's own work (compile workers), not a neighbour's."""
    import subprocess
    import sys

    before = own_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.6\n"
                              "while time.process_time() < end: pass\nimport sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        import psutil

        proc = psutil.Process(child.pid)
        while proc.cpu_times().user + proc.cpu_times().system < 0.6:  # the child's own clock, not a sleep
            proc.cpu_times()
        alive = own_cpu_seconds()
    finally:
        child.communicate(b"")
    assert alive - before >= 0.5  # the living child's 0.6 s, in clock ticks
    assert own_cpu_seconds() >= alive  # reaped, it stays counted (getrusage's children)


def test_own_cpu_seconds_keeps_what_a_child_waited_for():
    """A child that forks a worker and waits for it (the grammar compile process does, per job): the worker's
    time stays counted after it ends (in the child's children times), so the count never goes backwards."""
    import subprocess
    import sys

    code = ("import os, time, sys\npid = os.fork()\nif pid == 0:\n    end = time.process_time() + 0.6\n"
            "    while time.process_time() < end: pass\n    os._exit(0)\nos.waitpid(pid, 0)\nprint('reaped', flush=True)\n"
            "sys.stdin.read()")
    before = own_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "reaped"
        after = own_cpu_seconds()
    finally:
        child.communicate("")
    assert after - before >= 0.5  # the worker's 0.6 s, in clock ticks
