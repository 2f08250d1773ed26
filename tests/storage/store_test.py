"""The storage layer: the overwrite rule, atomic writes that survive interrupts."""
from __future__ import annotations

import json
import math

import pytest

from jaxsim.storage import store


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


def test_json_files_are_strict(tmp_path):
    store.write_json(tmp_path / 'r.json', {'a': math.inf, 'b': [1.0, math.nan], 'c': 'x'})
    assert json.loads((tmp_path / 'r.json').read_text(),
                      parse_constant=lambda name: pytest.fail(name)) == {
        'a': None, 'b': [1.0, None], 'c': 'x'}
    assert [p.name for p in tmp_path.iterdir()] == ['r.json']  # no temporary file left


@pytest.mark.parametrize('content, message', [
    (None, r'r\.json: record not found'),
    (b'{"a": 1,\n}', r'r\.json:2: malformed JSON: '),
    (b'{"a": "\xff"}', r'r\.json: not valid UTF-8'),
    (b'[1, 2]', r'r\.json: expected a JSON object'),
])
def test_read_json_errors_name_the_file_in_the_callers_type(tmp_path, content, message):
    class RecordError(ValueError):
        pass

    if content is not None:
        (tmp_path / 'r.json').write_bytes(content)
    with pytest.raises(RecordError, match=message):
        store.read_json(tmp_path / 'r.json', RecordError, 'record')


_KILLED_MID_WRITE = """
import sys
from jaxsim.storage import store
with store.open_atomic(sys.argv[1], "w") as f:
    f.write("half")
    f.flush()
    print("writing", flush=True)
    sys.stdin.read()  # until killed
"""


def test_what_a_killed_writer_left_is_removed_by_the_next_write(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out.txt"
    repo = Path(__file__).resolve().parents[2]
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_MID_WRITE, str(out)], cwd=repo,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(repo)))
    assert writer.stdout.readline() == "writing\n"
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".out.txt.tmp-"), left
    # A live writer's temporary file, and a moved-aside copy whose target is gone, stay.
    live = tmp_path / f".out.txt.tmp-{os.getpid()}-0123abcd"
    live.write_text("in progress")
    aside = tmp_path / f".ix.old-{writer.pid}-0123abcd"
    aside.mkdir()
    store.write_atomic(out, "whole")
    assert out.read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([aside.name, live.name,
                                                                "out.txt"])
    store.write_atomic(tmp_path / "ix", "1")
    assert aside.exists()
    store.write_atomic(tmp_path / "ix", "2")  # ix exists again: the copy aside is stale now
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "ix", "out.txt"])
