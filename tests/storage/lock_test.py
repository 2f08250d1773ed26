"""The workdir lock: live holder refused, dead holder taken over, racing runs: exactly one
wins."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest

from jaxsim.storage import lock as workdir_lock
from tests.conftest import HANG_GUARD_S


def test_lock_refuses_a_live_holder_and_names_it(tmp_path):
    with workdir_lock.WorkdirLock(tmp_path / "run"):
        holder = json.loads((tmp_path / "run" / workdir_lock.LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(workdir_lock.WorkdirLockedError, match=f"pid {os.getpid()}"):
            workdir_lock.WorkdirLock(tmp_path / "run").acquire()
    # Released: free for the next run, and nobody is named as holder any more.
    assert (tmp_path / "run" / workdir_lock.LOCK_FILE).read_text() == ""
    with workdir_lock.WorkdirLock(tmp_path / "run", say=pytest.fail):
        pass


def test_hold_workdir_locks_on_the_main_process_only(tmp_path):
    run = tmp_path / "run"
    with workdir_lock.hold_workdir(run, main=True, say=pytest.fail):
        with pytest.raises(workdir_lock.WorkdirLockedError, match=f"pid {os.getpid()}"):
            workdir_lock.WorkdirLock(run).acquire()
        # Another run is refused before it writes anything.
        with pytest.raises(workdir_lock.WorkdirLockedError, match="is in use by"):
            with workdir_lock.hold_workdir(run, main=True, say=pytest.fail):
                pytest.fail("entered a held workdir")
    with workdir_lock.hold_workdir(run, main=True, say=pytest.fail):
        pass  # released on the way out
    with workdir_lock.hold_workdir(tmp_path / "other", main=False, say=pytest.fail):
        assert not (tmp_path / "other").exists()  # not process 0: takes nothing


def test_lock_of_a_killed_run_is_taken_over_with_a_message(tmp_path):
    run = tmp_path / "run"
    code = ("import os, sys; from jaxsim.storage import lock; "
            "lock.WorkdirLock(sys.argv[1]).acquire(); os.kill(os.getpid(), 9)")
    killed = subprocess.run([sys.executable, "-c", code, str(run)])
    assert killed.returncode == -9
    holder = json.loads((run / workdir_lock.LOCK_FILE).read_text())
    said = []
    with workdir_lock.WorkdirLock(run, say=said.append):
        assert json.loads((run / workdir_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert len(said) == 1 and f"pid {holder['pid']}" in said[0] and "gone" in said[0]


def test_remote_lock_of_another_host_is_refused_and_a_dead_local_one_taken_over(tmp_path,
                                                                                monkeypatch):
    # The object-store path (no kernel locks) decides from the record alone.
    monkeypatch.setattr(workdir_lock, "is_remote", lambda p: True)
    run = tmp_path / "run"
    run.mkdir()
    (run / workdir_lock.LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1,
                                                  "since": "then"}))
    with pytest.raises(workdir_lock.WorkdirLockedError, match="remove .*\\.lock"):
        workdir_lock.WorkdirLock(run).acquire()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = workdir_lock.WorkdirLock(run)
    (run / workdir_lock.LOCK_FILE).write_text(json.dumps({**lock.record, "pid": dead.pid}))
    said = []
    with workdir_lock.WorkdirLock(run, say=said.append):
        assert json.loads((run / workdir_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"pid {dead.pid}" in said[0]
    assert not (run / workdir_lock.LOCK_FILE).exists()


def _try_lock(path, barrier, results):
    barrier.wait()
    try:
        lock = workdir_lock.WorkdirLock(path).acquire()
        results.put("won")
        barrier.wait()  # hold until every contender has tried
        lock.release()
    except workdir_lock.WorkdirLockedError:
        results.put("refused")
        barrier.wait()


def test_racing_runs_exactly_one_wins(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # no fork of a process running JAX threads
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_try_lock, args=(str(tmp_path / "run"), barrier, results))
             for _ in range(4)]
    for p in procs:
        p.start()
    # Generous bounds: spawned interpreters start slowly on a loaded machine; the barrier,
    # not the clock, orders the contenders.
    outcomes = sorted(results.get(timeout=HANG_GUARD_S) for _ in procs)
    for p in procs:
        p.join(HANG_GUARD_S)
    assert outcomes == ["refused"] * 3 + ["won"]
