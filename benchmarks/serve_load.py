"""Throughput of `python -m jaxsim serve` under concurrent clients, with and without batching.

Two real server processes run over the same index on free localhost ports: one batching, one
started with `--no-batching` (the same server serving one request per device call). The load
comes from this process alone, an asyncio client (no threads, no HTTP library: pre-encoded
requests on --clients raw keep-alive sockets to 127.0.0.1), which costs the shared CPUs far less
than the servers do; its own CPU time per request is reported. Each client sends one-query
`POST /search` requests (top 10) back to back.

Each mode first gets --warmup seconds (uncounted), then the counted time, --duration seconds per
mode, runs in --rounds alternating slices (batched, unbatched, batched, ...), each after one
uncounted second of ramp-up: both modes see the same background load of a shared machine, and a
load that changes during the run does not favour the mode that happened to run first. Reported
per mode: requests answered per second, p50/p99 latency, errors, mean batch (requests per
device call, from /health), and the server's CPU time per request (all its threads, from
/proc: the cost a request puts on the machine, whatever share of the CPUs the server got).
Finally each server gets SIGTERM while its clients are still sending, and every client must end
(an answer, a 503 or a closed connection, never a hang).

"ratio" (top level) = batched q/s / unbatched q/s.

    python benchmarks/serve_load.py --json serve_load.json
        [--clients 32] [--duration 20] [--rounds 4] [--warmup 15]
        [--index DIR | --corpus-size 5000] [--warm-up-tokens N] [--max-query-words N]

A short check (the test suite's): a small --index, a few seconds per mode, and queries of at
most --max-query-words words under a --warm-up-tokens that covers them, so the servers compile
a few shapes at start-up and none while counted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import load_average, setup_process, write_json  # noqa: E402
from jaxsim.storage.paths import SENTEVAL_ROOT  # noqa: E402

HOST = "127.0.0.1"
# A client waits this long for one answer before it counts the server as hung.
ANSWER_TIMEOUT_S = 120.0


def sentences(name: str, limit: Optional[int]) -> list[str]:
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


def start_server(index: Path, workdir: Path, batching: bool,
                 warm_up_tokens: Optional[int] = None) -> tuple[subprocess.Popen, Path]:
    """Starts a server process; it writes its port to the returned file once it serves."""
    port_file = workdir / f"port-{batching}"
    extra = [] if batching else ["--no-batching"]
    if warm_up_tokens is not None:
        extra += ["--warm-up-tokens", str(warm_up_tokens)]
    proc = subprocess.Popen([sys.executable, "-m", "jaxsim", "serve", "--index", str(index),
                             "--port", "0", "--port-file", str(port_file), *extra],
                            cwd=REPO, env=_env(), stdout=subprocess.DEVNULL)
    return proc, port_file


def wait_for_port(proc: subprocess.Popen, port_file: Path) -> int:
    while not port_file.exists():
        if proc.poll() is not None:
            raise SystemExit(f"error: the server exited with status {proc.returncode}")
        time.sleep(0.1)
    return int(port_file.read_text())


def cpu_seconds(pid: int) -> Optional[float]:
    """User + system CPU time of a process, all its threads (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def request_bytes(query: str) -> bytes:
    body = json.dumps({"queries": [query], "top_k": 10}).encode()
    return (b"POST /search HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (HOST.encode(), len(body))) + body


async def _answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 answer with a Content-Length (what uvicorn sends)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


class Window:
    """What the clients record while `counting`: answer latencies, errors, first error seen."""

    def __init__(self):
        self.stop = False
        self.counting = False
        self.since = float("inf")
        self.latencies: list[float] = []
        self.errors = 0
        self.first_error = ""


async def client(port: int, requests: list[bytes], seed: int, window: Window) -> str:
    """Sends searches on one keep-alive connection until window.stop; returns how it ended."""
    rng = np.random.default_rng(seed)
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as e:
        return type(e).__name__
    try:
        while not window.stop:
            start = time.perf_counter()
            writer.write(requests[rng.integers(len(requests))])
            try:
                status, body = await asyncio.wait_for(_answer(reader), ANSWER_TIMEOUT_S)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
                return type(e).__name__  # the server went away: stop, never hang
            took = time.perf_counter() - start
            ok = status == 200 and body.startswith(b'{"results":')
            if window.counting and start >= window.since:
                if ok:
                    window.latencies.append(took)
                else:
                    window.errors += 1
                    window.first_error = window.first_error or f"{status} {body[:200]!r}"
            if status == 503:
                return "503"
        return "stopped"
    finally:
        writer.close()


async def drive(port: int, requests: list[bytes], clients: int, seconds: float,
                counted: bool, ramp_s: float = 1.0) -> Window:
    """Runs `clients` clients for ramp_s + seconds; counts the last `seconds` if `counted`."""
    window = Window()
    tasks = [asyncio.create_task(client(port, requests, seed, window))
             for seed in range(clients)]
    await asyncio.sleep(ramp_s)
    window.since, window.counting = time.perf_counter(), counted
    await asyncio.sleep(seconds)
    window.counting, window.stop = False, True
    await asyncio.wait(tasks, timeout=ANSWER_TIMEOUT_S)
    return window


async def stop_under_load(proc: subprocess.Popen, port: int, requests: list[bytes],
                          clients: int) -> dict:
    """SIGTERM while `clients` are sending: every client must end within a minute."""
    window = Window()
    tasks = [asyncio.create_task(client(port, requests, seed, window))
             for seed in range(clients)]
    await asyncio.sleep(2.0)
    proc.terminate()
    _, pending = await asyncio.wait(tasks, timeout=60)
    for task in pending:
        task.cancel()
    status = await asyncio.to_thread(proc.wait, 60)
    ends = [t.result() for t in tasks if t.done() and not t.cancelled()]
    return {"clients_hung_after_stop": len(pending), "server_exit_status": status,
            "client_ends_after_stop": {e: ends.count(e) for e in sorted(set(ends))}}


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=30) as response:
        return json.load(response)


def queries(max_words: Optional[int] = None) -> list[str]:
    """The distinct SNLI test hypotheses clients send (the first 2000; of at most `max_words`
    words when given)."""
    found = sentences("s2.test", None)
    if max_words:
        found = [q for q in found if len(q.split()) <= max_words]
    if not found:
        raise SystemExit(f"error: no query of at most {max_words} words")
    return found[:2000]


async def run(index: Path, workdir: Path, args) -> dict:
    requests = [request_bytes(q) for q in queries(args.max_query_words)]
    modes = {"batched": True, "unbatched": False}
    started = {name: start_server(index, workdir, batching, args.warm_up_tokens)
               for name, batching in modes.items()}
    try:
        servers = {name: (proc, wait_for_port(proc, port_file))
                   for name, (proc, port_file) in started.items()}
        for name, (_, port) in servers.items():
            await drive(port, requests, args.clients, args.warmup, counted=False)
        windows = {name: [] for name in modes}
        cpu = {name: 0.0 for name in modes}
        own_cpu = 0.0
        for _ in range(args.rounds):
            for name, (proc, port) in servers.items():
                before, own_before = cpu_seconds(proc.pid), own_cpu_seconds()
                window = await drive(port, requests, args.clients, args.duration / args.rounds,
                                     counted=True)
                after = cpu_seconds(proc.pid)
                cpu[name] = None if None in (before, after, cpu[name]) else \
                    cpu[name] + after - before
                own_cpu += own_cpu_seconds() - own_before
                windows[name].append(window)
        served = {name: health(port)["served"] for name, (_, port) in servers.items()}
        # Both at once: each has its own clients, and the check need not wait twice.
        ends = await asyncio.gather(*(stop_under_load(proc, port, requests, args.clients)
                                      for proc, port in servers.values()))
        stopped = dict(zip(servers, ends))
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {}
    for name in modes:
        latencies = np.array([t for w in windows[name] for t in w.latencies])
        n = int(latencies.size)
        # The server's CPU includes the ramp-up seconds: per request, it is slightly high.
        results[name] = {
            "batching": modes[name], "requests": n, "qps": n / args.duration,
            "p50_ms": float(np.percentile(latencies, 50) * 1000) if n else None,
            "p99_ms": float(np.percentile(latencies, 99) * 1000) if n else None,
            "errors": sum(w.errors for w in windows[name]),
            "first_error": next((w.first_error for w in windows[name] if w.first_error), None),
            "qps_per_round": [len(w.latencies) / (args.duration / args.rounds)
                              for w in windows[name]],
            "mean_batch_requests": served[name]["requests"] / max(served[name]["batches"], 1),
            "largest_batch": served[name]["largest_batch"],
            "server_cpu_ms_per_request": (None if cpu[name] is None or not n
                                          else 1000 * cpu[name] / n),
            **stopped[name]}
    total = sum(r["requests"] for r in results.values())
    results["client_cpu_ms_per_request"] = 1000 * own_cpu / max(total, 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=20.0,
                        help="counted seconds per mode (split over --rounds)")
    parser.add_argument("--rounds", type=int, default=4,
                        help="alternating counted slices per mode")
    parser.add_argument("--warmup", type=float, default=15.0,
                        help="uncounted seconds per mode first")
    parser.add_argument("--index", type=Path, default=None,
                        help="index to serve (default: build one of --corpus-size sentences)")
    parser.add_argument("--corpus-size", type=int, default=5000)
    parser.add_argument("--warm-up-tokens", type=int, default=None,
                        help="the servers' --warm-up-tokens (default: theirs)")
    parser.add_argument("--max-query-words", type=int, default=None,
                        help="send only queries of at most this many words (default: all)")
    args = parser.parse_args()
    setup_process()
    if (args.clients < 1 or args.rounds < 1 or args.duration <= 0 or args.warmup < 0
            or (args.max_query_words is not None and args.max_query_words < 1)):
        parser.error("--clients, --rounds and --max-query-words must be positive, "
                     "--duration > 0, --warmup >= 0")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        index = args.index
        if index is None:
            build_index(tmp, args.corpus_size)
            index = tmp / "index"
        load_before = load_average()
        results = asyncio.run(run(index, tmp, args))
    modes = {name: results[name] for name in ("batched", "unbatched")}
    ratio = modes["batched"]["qps"] / max(modes["unbatched"]["qps"], 1e-9)
    record = {"benchmark": "serve_load", "clients": args.clients, "duration_s": args.duration,
              "rounds": args.rounds, "warmup_s": args.warmup,
              "max_query_words": args.max_query_words,
              "index": str(args.index or f"{args.corpus_size} SNLI test premises at most "
                                         f"(distinct), bundled model"),
              **modes, "client_cpu_ms_per_request": results["client_cpu_ms_per_request"],
              "ratio": ratio, "load_average_1min_before": load_before}
    for name, m in modes.items():
        p50, p99, cpu = (float("nan") if v is None else v
                         for v in (m["p50_ms"], m["p99_ms"], m["server_cpu_ms_per_request"]))
        print(f"{name:9s} {m['qps']:8.1f} q/s  p50 {p50:.1f} ms  p99 {p99:.1f} ms  "
              f"errors {m['errors']}  mean batch {m['mean_batch_requests']:.1f}  "
              f"server {cpu:.2f} CPU-ms/request  hung after stop "
              f"{m['clients_hung_after_stop']}")
    print(f"client {results['client_cpu_ms_per_request']:.2f} CPU-ms/request; load average "
          f"{load_before} before, {load_average()} after")
    print(f"ratio (batched / unbatched q/s): {ratio:.2f}")
    write_json(args.json, record)


if __name__ == "__main__":
    main()
