"""`python -m jaxsim serve` refuses bad input in one line, before any port is opened."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import HANG_GUARD_S, REPO


def _serve(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "jaxsim", "serve", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)


@pytest.mark.parametrize("args, message", [
    (["--index", "{tmp}/missing"], "not a search index"),
    (["--index", "{tmp}", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["--index", "{tmp}", "--max-sentences", "300"], "must not exceed max_batch"),
    (["--index", "{tmp}", "--max-queue", "0"], "max_queue must be positive"),
    # A NaN or infinite window would leave the batcher waiting forever: every request hangs.
    (["--index", "{tmp}", "--batch-window-ms", "nan"], "window_ms must be a finite number"),
    (["--index", "{tmp}", "--batch-window-ms", "inf"], "window_ms must be a finite number"),
])
def test_bad_options_are_one_line_errors(tmp_path, args, message):
    proc = _serve(*[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert proc.stdout == ""  # never got as far as serving


def test_a_moved_model_is_named_as_the_one_the_index_records(served_index, tmp_path):
    index_dir, model_dir, _ = served_index
    shutil.copytree(index_dir, tmp_path / "index")
    meta = json.loads((tmp_path / "index" / "index.json").read_text())
    meta["model"] = str(tmp_path / "moved-away")  # index.json is outside the checksum
    (tmp_path / "index" / "index.json").write_text(json.dumps(meta))
    proc = _serve("--index", str(tmp_path / "index"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "moved-away: no such model folder" in lines[0] and "pass --model" in lines[0], lines


def test_an_existing_port_file_needs_overwrite(tmp_path):
    port_file = tmp_path / "notes.txt"
    port_file.write_text("the user's notes\n")
    proc = _serve("--index", str(tmp_path / "missing"), "--port-file", str(port_file))
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (f"error: --port-file {port_file} exists; pass --overwrite to "
                           f"replace it\n")
    # With --overwrite the file passes the check (the missing index is refused next).
    proc = _serve("--index", str(tmp_path / "missing"), "--port-file", str(port_file),
                  "--overwrite")
    assert proc.returncode == 1 and "not a search index" in proc.stderr, proc.stderr
    assert port_file.read_text() == "the user's notes\n"



_BLOCK_SERVE_EXTRA = ("import sys\n"
                      "for name in ('fastapi', 'uvicorn', 'orjson', 'httptools'):\n"
                      # `import fastapi` then fails as when it is not installed
                      "    sys.modules[name] = None\n")


def _run_code(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=HANG_GUARD_S)


def test_without_the_serve_extra_serve_says_what_to_install(tmp_path):
    proc = _run_code(_BLOCK_SERVE_EXTRA + "import runpy\n"
                     f"sys.argv = ['jaxsim', 'serve', '--index', {str(tmp_path)!r}]\n"
                     "runpy.run_module('jaxsim', run_name='__main__', alter_sys=True)\n")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: python -m jaxsim serve needs the serve extra"), lines
    assert "pip install 'jaxsim[serve]'" in lines[0], lines
    assert any(f"no module named {name!r}" in lines[0]
               for name in ("fastapi", "uvicorn", "orjson", "httptools")), lines
    assert proc.stdout == ""


def test_without_the_serve_extra_every_other_command_runs():
    # Each command's parser built and run (`--help` exits 0 after printing it).
    proc = _run_code(_BLOCK_SERVE_EXTRA +
                     "import contextlib, io\n"
                     "from jaxsim.cli.main import COMMANDS, main\n"
                     "for name in COMMANDS:\n"
                     "    if name == 'serve':\n"
                     "        continue\n"
                     "    out = io.StringIO()\n"
                     "    with contextlib.redirect_stdout(out):\n"
                     "        try:\n"
                     "            main([name, '--help'])\n"
                     "        except SystemExit as e:\n"
                     "            assert e.code == 0, (name, e.code)\n"
                     "    assert f'python -m jaxsim {name}' in out.getvalue(), name\n"
                     "    print(name)\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["encode", "export", "index", "search", "prepare", "analyze",
                                   "plan"]
