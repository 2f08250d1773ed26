"""A tiny index and a real `python -m jaxsim serve` process on a free localhost port."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

import pytest

import jaxsim
from jaxsim.search import build_index
from jaxsim.storage.paths import SENTEVAL_ROOT
from tests.conftest import HANG_GUARD_S, REPO, wait_until, write_tiny_model

CORPUS_SIZE = 40


def corpus() -> list[str]:
    """The first distinct premises of the shipped SNLI dev set."""
    lines = (SENTEVAL_ROOT / "SNLI" / "s1.dev").read_text(encoding="utf-8").splitlines()
    return list(dict.fromkeys(s for s in lines if s.strip()))[:CORPUS_SIZE]


@pytest.fixture(scope="session")
def served_index(tmp_path_factory):
    """(index folder, model folder, corpus): a tiny random BERT's index of CORPUS_SIZE rows."""
    root = tmp_path_factory.mktemp("serve")
    write_tiny_model(root / "model")
    model = jaxsim.load_pretrained(root / "model")
    sentences = corpus()
    build_index(model, sentences).save(root / "index")
    return root / "index", root / "model", sentences


class Server:
    """A `python -m jaxsim serve` subprocess; `url` once started."""

    def __init__(self, index_dir: Path, workdir: Path, *extra: str):
        port_file = workdir / "port"
        self.log = workdir / "server.log"
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH",
                                                                                  ""))
        # --port 0: the server binds a free port itself and writes which; nothing to race.
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jaxsim", "serve", "--index", str(index_dir),
                 "--port", "0", "--port-file", str(port_file), "--warm-up-tokens", "12",
                 *extra],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(port_file.exists, self.proc, "server did not start")
        except AssertionError as e:
            self.stop()
            raise AssertionError(f"{e}:\n{self.log.read_text()[-3000:]}") from None
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(HANG_GUARD_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(served_index, tmp_path_factory):
    index_dir, _, _ = served_index
    srv = Server(index_dir, tmp_path_factory.mktemp("server"), "--host", "127.0.0.1")
    yield srv
    srv.stop()


def call(url: str, path: str, body: Optional[object] = None, *, raw: Optional[bytes] = None,
         content_type: str = "application/json",
         method: Optional[str] = None) -> tuple[int, object]:
    """(status, decoded JSON or text) of one HTTP request; error statuses are returned."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method,
                                     headers={"Content-Type": content_type} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=HANG_GUARD_S) as response:
            status, payload, kind = response.status, response.read(), response.headers
    except urllib.error.HTTPError as e:
        status, payload, kind = e.code, e.read(), e.headers
    if "json" in kind.get("content-type", ""):
        return status, json.loads(payload)
    return status, payload.decode()
