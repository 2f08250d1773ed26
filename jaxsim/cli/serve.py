"""Command line `python -m jaxsim serve`: the search service over HTTP (see docs/serve.md).

    python -m jaxsim serve --index DIR [--model M] [--host 127.0.0.1] [--port 8000]

The model and index load (and the one-query shapes compile) before the port is bound; then one
line `serving http://HOST:PORT` goes to stdout. `--port 0` binds a free port chosen by the
system, and that line (or `--port-file`) says which: a test or a script needs no guessing and
no bind-then-release race.
"""
from __future__ import annotations

import argparse
import signal
import socket
import sys
from pathlib import Path
from typing import Sequence

from jaxsim.cli import cli_io
from jaxsim.cli.cli_io import check_output_file
from jaxsim.serve.service import ServeLimits, open_service
from jaxsim.storage.store import write_atomic

# The HTTP stack is the [serve] extra (pip install 'jaxsim[serve]'), not the core install: a
# process without it runs every other command, and this one says what to install.
SERVE_EXTRA = ("fastapi", "starlette", "pydantic", "uvicorn", "httptools", "orjson")
MISSING = None
try:
    from jaxsim.serve import server
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in SERVE_EXTRA:
        raise
    server, MISSING = None, e.name


def serve_parser() -> argparse.ArgumentParser:
    defaults = ServeLimits()
    p = argparse.ArgumentParser(
        prog="python -m jaxsim serve",
        description="Serve a search index over HTTP: a JSON API (/search, /encode, "
                    "/similarity, /health) and a search page at /.")
    p.add_argument("--index", required=True, type=Path, help="folder from `jaxsim index`")
    p.add_argument("--model", default=None,
                   help="model to encode with (default: the one the index records; checked)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, default=None,
                   help="write the bound port here (a decimal number and a newline)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --port-file")
    p.add_argument("--no-batching", dest="batching", action="store_false",
                   help="one device call per request (for comparison)")
    p.add_argument("--batch-window-ms", type=float, default=defaults.window_ms,
                   help="how long a batch keeps collecting requests")
    p.add_argument("--max-batch", type=int, default=defaults.max_batch,
                   help="sentences in one merged encode")
    p.add_argument("--max-queue", type=int, default=defaults.max_queue,
                   help="requests waiting; more are answered 503")
    p.add_argument("--max-sentences", type=int, default=defaults.max_sentences,
                   help="sentences in one request")
    p.add_argument("--max-top-k", type=int, default=defaults.max_top_k)
    p.add_argument("--warm-up-tokens", type=int, default=64,
                   help="compile the encode shapes for sentences up to this many tokens "
                        "before serving (0: only the one-query shape)")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    return cli_io.add_import_flag(p)


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, handed to the server (which then never binds itself)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        raise cli_io.UsageError(f"--host {host} --port {port}: cannot bind ({e.strerror or e})") \
            from None
    return sock


def serve_main(argv: Sequence[str]) -> int:
    args = serve_parser().parse_args(argv)
    if server is None:
        raise cli_io.UsageError(f"python -m jaxsim serve needs the serve extra (no module named "
                                f"{MISSING!r}): pip install 'jaxsim[serve]'")
    if not 0 <= args.port <= 65535:
        raise cli_io.UsageError(f"--port must be in [0, 65535], got {args.port}")
    # A bad limit is a ValueError, reported as the one error line like any user error.
    limits = ServeLimits(max_sentences=args.max_sentences, max_top_k=args.max_top_k,
                         max_batch=args.max_batch, max_queue=args.max_queue,
                         window_ms=args.batch_window_ms)
    if args.port_file is not None:  # before the model loads
        check_output_file(args.port_file, args.overwrite, "--port-file")
    service = open_service(args.index, args.model, limits=limits, batching=args.batching)
    # Compiling takes up to a minute on a CPU: say so, not a silence before the port opens.
    print(f"loaded {len(service.index)} sentences and model {service.describe()['model']}; "
          f"compiling the encode shapes (--warm-up-tokens {args.warm_up_tokens}) before the "
          f"port opens ...", file=sys.stderr, flush=True)
    service.warm_up(args.warm_up_tokens)
    app = server.create_app(service)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    if args.port_file is not None:
        write_atomic(args.port_file, f"{port}\n", overwrite=args.overwrite, what="--port-file")
    shown = f"[{host}]" if ":" in host else host
    print(f"serving http://{shown}:{port} ({len(service.index)} sentences, model "
          f"{service.describe()['model']}, batching {'on' if args.batching else 'off'})",
          flush=True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM (requests in flight finish, queued ones
    # get 503), then re-raises the signal to the handler it found: this one, so a requested
    # stop ends with one line and the shell's status (130 / 143) rather than death by signal.
    received = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: received.append(signum))
    server.run(app, service, sock, log_level=args.log_level)
    stats = service.batcher.stats
    reason = signal.Signals(received[0]).name if received else "server exited"
    print(f"stopped ({reason}) after {stats.requests} requests in {stats.batches} batches",
          flush=True)
    return 128 + received[0] if received else 0
