"""The HTTP server: uvicorn running the app on a socket the command line bound.

Needs the [serve] extra (fastapi, uvicorn, httptools, orjson); `jaxsim.cli.serve` reports a
missing one in one line.
"""
from __future__ import annotations

import socket

import uvicorn

from jaxsim.serve.app import create_app
from jaxsim.serve.service import SearchService

__all__ = ["create_app", "run"]


class _Server(uvicorn.Server):
    """uvicorn, but on a stop request the requests still queued are answered 503 at once
    (the batch being computed finishes) instead of waiting out the graceful-shutdown time."""

    def __init__(self, config: uvicorn.Config, service: SearchService):
        super().__init__(config)
        self.service = service

    async def shutdown(self, sockets=None) -> None:
        self.service.batcher.close(timeout=0)
        await super().shutdown(sockets)


def run(app, service: SearchService, sock: socket.socket, log_level: str = "warning") -> None:
    """Serves `app` on the listening `sock` until a stop request (SIGINT / SIGTERM through the
    handlers the caller installed) or the server exits."""
    # httptools parses HTTP; no access log: a line per request costs the event loop more than
    # routing the request does.
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                            lifespan="on", http="httptools", access_log=False)
    _Server(config, service).run(sockets=[sock])
