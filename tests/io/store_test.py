"""The storage layer: the overwrite rule, atomic writes that survive interrupts, the workdir
lock (live holder refused, dead holder taken over, racing runs: exactly one wins)."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest

from jaxsim.io import store


def test_empty_path_is_refused_not_taken_for_the_current_folder():
    with pytest.raises(store.StorageError, match="--workdir is empty"):
        store.as_path("", "--workdir")
    with pytest.raises(store.StorageError, match="is empty"):
        store.as_path("   ")


def test_unknown_backend_is_one_line_before_any_work():
    # s3fs may be installed (tests use it); an azure scheme's adlfs is not.
    with pytest.raises(store.StorageError, match="needs the 'adlfs' package"):
        store.as_path("az://container/run", "--workdir")


def test_existing_target_refused_unless_overwrite(tmp_path):
    target = tmp_path / "vectors.npy"
    target.write_bytes(b"user data")
    with pytest.raises(store.OutputExistsError, match="pass --overwrite"):
        store.write_atomic(target, b"new", overwrite=False, what="--output")
    assert target.read_bytes() == b"user data"
    store.write_atomic(target, b"new", overwrite=True)
    assert target.read_bytes() == b"new"


def test_empty_folder_counts_as_absent(tmp_path):
    (tmp_path / "out").mkdir()
    assert store.refuse_existing(tmp_path / "out", overwrite=False) == tmp_path / "out"
    (tmp_path / "out" / "f").write_text("x")
    with pytest.raises(store.OutputExistsError):
        store.refuse_existing(tmp_path / "out", overwrite=False)


def test_interrupted_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "result.json"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with store.open_atomic(target, "w") as f:
            f.write("half of the new")
            raise KeyboardInterrupt
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_replace_dir_swaps_in_whole_or_not_at_all(tmp_path):
    out = tmp_path / "index"
    with store.replace_dir(out) as d:
        (d / "a").write_text("1")
    assert (out / "a").read_text() == "1"
    with pytest.raises(RuntimeError):
        with store.replace_dir(out, overwrite=True) as d:
            (d / "b").write_text("2")
            raise RuntimeError("killed")
    assert sorted(p.name for p in out.iterdir()) == ["a"]
    with store.replace_dir(out, overwrite=True) as d:
        (d / "b").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~store._umask())


def test_replace_dir_runs_the_keep_check_on_what_it_would_replace(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "precious").write_text("1")

    def refuse(p):
        raise store.StorageError(f"{p} is not ours")

    with pytest.raises(store.StorageError, match="not ours"):
        with store.replace_dir(tmp_path / "x", overwrite=True, keep=refuse):
            pass
    assert (tmp_path / "x" / "precious").read_text() == "1"


def test_lock_refuses_a_live_holder_and_names_it(tmp_path):
    with store.WorkdirLock(tmp_path / "run"):
        holder = json.loads((tmp_path / "run" / store.LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(store.WorkdirLockedError, match=f"pid {os.getpid()}"):
            store.WorkdirLock(tmp_path / "run").acquire()
    # Released: free for the next run, and nobody is named as holder any more.
    assert (tmp_path / "run" / store.LOCK_FILE).read_text() == ""
    with store.WorkdirLock(tmp_path / "run", say=pytest.fail):
        pass


def test_lock_of_a_killed_run_is_taken_over_with_a_message(tmp_path):
    run = tmp_path / "run"
    code = ("import os, sys; from jaxsim.io import store; store.WorkdirLock(sys.argv[1]).acquire();"
            " os.kill(os.getpid(), 9)")
    killed = subprocess.run([sys.executable, "-c", code, str(run)])
    assert killed.returncode == -9
    holder = json.loads((run / store.LOCK_FILE).read_text())
    said = []
    with store.WorkdirLock(run, say=said.append):
        assert json.loads((run / store.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert len(said) == 1 and f"pid {holder['pid']}" in said[0] and "gone" in said[0]


def test_remote_lock_of_another_host_is_refused_and_a_dead_local_one_taken_over(tmp_path,
                                                                                monkeypatch):
    # The object-store path (no kernel locks) decides from the record alone.
    monkeypatch.setattr(store, "is_remote", lambda p: True)
    run = tmp_path / "run"
    run.mkdir()
    (run / store.LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1,
                                                  "since": "then"}))
    with pytest.raises(store.WorkdirLockedError, match="remove .*\\.lock"):
        store.WorkdirLock(run).acquire()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = store.WorkdirLock(run)
    (run / store.LOCK_FILE).write_text(json.dumps({**lock.record, "pid": dead.pid}))
    said = []
    with store.WorkdirLock(run, say=said.append):
        assert json.loads((run / store.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"pid {dead.pid}" in said[0]
    assert not (run / store.LOCK_FILE).exists()


def _try_lock(path, barrier, results):
    barrier.wait()
    try:
        lock = store.WorkdirLock(path).acquire()
        results.put("won")
        barrier.wait()  # hold until every contender has tried
        lock.release()
    except store.WorkdirLockedError:
        results.put("refused")
        barrier.wait()


def test_racing_runs_exactly_one_wins(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # no fork of a process running JAX threads
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_try_lock, args=(str(tmp_path / "run"), barrier, results))
             for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    outcomes = sorted(results.get(timeout=5) for _ in procs)
    assert outcomes == ["refused"] * 3 + ["won"]
