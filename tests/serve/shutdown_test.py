"""A server stopped under load: every client gets an answer or an error (none hangs), the
index files are left as they were, and --no-batching really serves one request per call; the
load benchmark (benchmarks/serve_load.py), which checks the same, on the same tiny index."""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import subprocess
import sys
import threading
import urllib.error

import pytest

from tests.conftest import HANG_GUARD_S, REPO, wait_until
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
                                                            "top_k": 2})
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
        # Under load: some requests served, more coming (the clients search until it goes).
        wait_until(lambda: call(server.url, "/health")[1]["served"]["requests"] >= 16,
                   server.proc, "the server served fewer than 16 requests")
        _, health = call(server.url, "/health")
        assert health["served"]["largest_batch"] == 1
    finally:
        assert server.stop() == 143  # SIGTERM, stopped gracefully (uncaught it is -15)
        stop.set()
        pool.shutdown(wait=False)
    outcomes = [f.result(timeout=HANG_GUARD_S) for f in futures]  # no client hangs
    assert "stopped (SIGTERM)" in server.log.read_text()
    assert all(answers > 0 and how != "gave up" for answers, how in outcomes), outcomes
    assert _fingerprint(index_dir) == before


def test_load_benchmark_short_form_writes_a_consistent_record(served_index, tmp_path):
    """benchmarks/serve_load.py in its short form (short queries the servers' warm-up covers, a
    second per mode): the record's rates follow from its counts, the unbatched server never
    batches, and every client ends when the servers are stopped under load."""
    index_dir, _, _ = served_index
    out, clients, duration, rounds = tmp_path / "serve_load.json", 4, 1.0, 2
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "serve_load.py"), "--index",
         str(index_dir), "--clients", str(clients), "--duration", str(duration),
         "--rounds", str(rounds), "--warmup", "0", "--warm-up-tokens", "12",
         "--max-query-words", "5", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert (record["clients"], record["duration_s"], record["rounds"],
            record["max_query_words"]) == (clients, duration, rounds, 5)
    for name in ("batched", "unbatched"):
        mode = record[name]
        assert mode["batching"] == (name == "batched")
        assert mode["requests"] > 0 and mode["errors"] == 0 and mode["first_error"] is None
        assert mode["qps"] == pytest.approx(mode["requests"] / duration)
        assert len(mode["qps_per_round"]) == rounds
        assert sum(mode["qps_per_round"]) * duration / rounds == pytest.approx(mode["requests"])
        assert 0 < mode["p50_ms"] <= mode["p99_ms"]
        assert mode["mean_batch_requests"] >= 1 and mode["largest_batch"] >= 1
        # SIGTERM under load: the server stops gracefully and no client hangs.
        assert mode["clients_hung_after_stop"] == 0 and mode["server_exit_status"] == 143
        assert sum(mode["client_ends_after_stop"].values()) == clients
    # --no-batching: one request per device call.
    assert record["unbatched"]["largest_batch"] == 1
    assert record["unbatched"]["mean_batch_requests"] == 1
    assert record["ratio"] == pytest.approx(record["batched"]["qps"] / record["unbatched"]["qps"])
    assert "ratio (batched / unbatched q/s)" in proc.stdout
