"""Throughput of `python -m jaxsim serve` under concurrent clients, with and without batching.

For each mode (batching on, then `--no-batching`) a real server process is started on a free
localhost port over the same index; --clients threads, each on its own keep-alive connection,
send one-query `POST /search` requests (top 10) back to back, first for --warmup seconds (shape
compilations happen here and are not counted), then for --duration seconds (counted). Reported
per mode: requests answered per second, p50/p99 latency, errors. Finally each server gets
SIGTERM while its clients are still sending, and the clients must all finish (an answer or an
error, never a hang).

"ratio" (top level) = batched q/s / unbatched q/s.

    python benchmarks/serve_load.py --json serve_load.json
        [--clients 32] [--duration 20] [--warmup 20] [--index DIR | --corpus-size 5000]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import load_average, write_json  # noqa: E402
from jaxsim.paths import SENTEVAL_ROOT  # noqa: E402


def sentences(name: str, limit: int) -> list[str]:
    lines = (SENTEVAL_ROOT / "SNLI" / name).read_text(encoding="utf-8").splitlines()
    return list(dict.fromkeys(s.strip() for s in lines if s.strip()))[:limit]


def build_index(folder: Path, size: int) -> None:
    """An index of `size` SNLI test premises with the bundled model (the command line's)."""
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(sentences("s1.test", size)) + "\n", encoding="utf-8")
    subprocess.run([sys.executable, "-m", "jaxsim", "index", "--input", str(corpus), "--out",
                    str(folder / "index")], check=True, cwd=REPO, env=_env())


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def start_server(index: Path, workdir: Path, batching: bool) -> tuple[subprocess.Popen, int]:
    port_file = workdir / f"port-{batching}"
    extra = [] if batching else ["--no-batching"]
    proc = subprocess.Popen([sys.executable, "-m", "jaxsim", "serve", "--index", str(index),
                             "--port", "0", "--port-file", str(port_file), *extra],
                            cwd=REPO, env=_env(), stdout=subprocess.DEVNULL)
    while not port_file.exists():
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with status {proc.returncode}")
        time.sleep(0.1)
    return proc, int(port_file.read_text())


class Client(threading.Thread):
    """Sends one-query searches on one connection until told to stop; records latencies."""

    def __init__(self, port: int, queries: list[str], seed: int, phase: dict):
        super().__init__(daemon=True)
        self.port, self.queries, self.phase = port, queries, phase
        self.rng = np.random.default_rng(seed)
        self.latencies: list[float] = []  # counted phase only, seconds
        self.errors = 0
        self.ended = ""

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        while not self.phase["stop"]:
            body = json.dumps({"queries": [self.queries[self.rng.integers(len(self.queries))]],
                               "top_k": 10}).encode()
            start = time.perf_counter()
            try:
                conn.request("POST", "/search", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
            except (OSError, http.client.HTTPException) as e:
                self.ended = type(e).__name__  # the server went away: stop, never hang
                return
            took = time.perf_counter() - start
            counted = self.phase["counting"]
            if response.status != 200:
                self.errors += counted
                if response.status == 503:
                    self.ended = "503"
                    return
            elif counted and start >= self.phase["since"]:
                self.latencies.append(took)
        self.ended = "stopped"


def run_mode(index: Path, workdir: Path, batching: bool, queries: list[str], args) -> dict:
    proc, port = start_server(index, workdir, batching)
    phase = {"stop": False, "counting": False, "since": float("inf")}
    clients = [Client(port, queries, seed, phase) for seed in range(args.clients)]
    for c in clients:
        c.start()
    time.sleep(args.warmup)
    phase["since"] = time.perf_counter()
    phase["counting"] = True
    time.sleep(args.duration)
    phase["counting"] = False
    elapsed = time.perf_counter() - phase["since"]
    # Stop the server under load: every client must end (answer, 503 or connection error).
    proc.terminate()
    status = proc.wait(60)
    for c in clients:
        c.join(60)
    hung = sum(c.is_alive() for c in clients)
    phase["stop"] = True
    latencies = np.array([t for c in clients for t in c.latencies])
    return {"batching": batching, "requests": int(latencies.size),
            "qps": latencies.size / elapsed,
            "p50_ms": float(np.percentile(latencies, 50) * 1000) if latencies.size else None,
            "p99_ms": float(np.percentile(latencies, 99) * 1000) if latencies.size else None,
            "errors": sum(c.errors for c in clients), "clients_hung_after_stop": hung,
            "server_exit_status": status}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=20.0, help="counted seconds per mode")
    parser.add_argument("--warmup", type=float, default=20.0, help="uncounted seconds first")
    parser.add_argument("--index", type=Path, default=None,
                        help="index to serve (default: build one of --corpus-size sentences)")
    parser.add_argument("--corpus-size", type=int, default=5000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        index = args.index
        if index is None:
            build_index(tmp, args.corpus_size)
            index = tmp / "index"
        queries = sentences("s2.test", 2000)
        load_before = load_average()
        modes = {name: run_mode(index, tmp, batching, queries, args)
                 for name, batching in (("batched", True), ("unbatched", False))}
    ratio = modes["batched"]["qps"] / max(modes["unbatched"]["qps"], 1e-9)
    record = {"benchmark": "serve_load", "clients": args.clients, "duration_s": args.duration,
              "warmup_s": args.warmup,
              "index": str(args.index or f"{args.corpus_size} SNLI test premises at most "
                                         f"(distinct), bundled model"),
              **modes, "ratio": ratio, "load_average_1min_before": load_before}
    for name, m in modes.items():
        p50, p99 = (float("nan") if v is None else v for v in (m["p50_ms"], m["p99_ms"]))
        print(f"{name:9s} {m['qps']:8.1f} q/s  p50 {p50:.1f} ms  p99 {p99:.1f} ms"
              f"  errors {m['errors']}  hung after stop {m['clients_hung_after_stop']}")
    print(f"ratio (batched / unbatched q/s): {ratio:.2f}")
    write_json(args.json, record)


if __name__ == "__main__":
    main()
