"""A server stopped under load: every client gets an answer or an error (none hangs), the
index files are left as they were, and --no-batching really serves one request per call."""
from __future__ import annotations

import concurrent.futures
import hashlib
import threading
import time
import urllib.error

from tests.serve.conftest import Server, call


def _fingerprint(folder):
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.iterdir())}


def test_stopping_under_load_answers_every_client(served_index, tmp_path):
    index_dir, _, sentences = served_index
    before = _fingerprint(index_dir)
    server = Server(index_dir, tmp_path, "--no-batching")
    _, health = call(server.url, "/health")
    assert health["batching"] is False

    stop = threading.Event()

    def client(n):
        """Searches until the server goes; returns (answers, how the last request ended)."""
        answers = 0
        while True:
            try:
                status, body = call(server.url, "/search", {"queries": [sentences[n]],
                                                            "top_k": 2}, timeout=60)
            except (urllib.error.URLError, ConnectionError) as e:  # refused or reset
                return answers, type(e).__name__
            if status != 200:
                assert status == 503, body  # queue closing: a JSON error, not a hang
                return answers, "503"
            assert body["results"][0][0]["row"] == n
            answers += 1
            if stop.is_set() and answers > 100:
                return answers, "gave up"

    pool = concurrent.futures.ThreadPoolExecutor(8)
    try:
        futures = [pool.submit(client, n) for n in range(8)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # under load: some requests served, more coming
            _, health = call(server.url, "/health")
            if health["served"]["requests"] >= 16:
                break
            time.sleep(0.2)
        assert health["served"]["requests"] >= 16 and health["served"]["largest_batch"] == 1
    finally:
        assert server.stop() == 143  # SIGTERM, stopped gracefully (uncaught it is -15)
        stop.set()
        pool.shutdown(wait=False)
    outcomes = [f.result(timeout=90) for f in futures]  # no client hangs
    assert "stopped (SIGTERM)" in server.log.read_text()
    assert all(answers > 0 and how != "gave up" for answers, how in outcomes), outcomes
    assert _fingerprint(index_dir) == before
