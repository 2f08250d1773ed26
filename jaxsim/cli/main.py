"""`python -m jaxsim COMMAND [options]`: one module of this package a command (README.md lists
them, with their docs).

Every command reports a user error (bad file, bad option, unreadable model) as one line
`error: <message>` on stderr and exits 1, and SIGINT / SIGTERM as one line with exit 130 / 143
(start-up included: jaxsim/__init__.py holds them back until `main` installs its handlers);
anything else is a bug and keeps its traceback. Every output follows `jaxsim.storage.store`'s rule:
an existing target is refused without --overwrite, and it is written whole or not at all.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

from jaxsim.cli import analyze, cli_io, encode, environment, export, plan, prepare, search, serve

COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "encode": encode.encode_main,
    "export": export.export_main,
    "index": search.index_main,
    "search": search.search_main,
    "serve": serve.serve_main,
    "prepare": prepare.prepare_main,
    "analyze": analyze.analyze_main,
    "plan": plan.plan_main,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: python -m jaxsim {{{','.join(COMMANDS)}}} [options]"

    def command() -> int:
        if argv[:1] in (["-h"], ["--help"]):
            print(usage)
            return 0
        environment.setup()
        if not argv or argv[0] not in COMMANDS:
            got = f"unknown command {argv[0]!r}" if argv else "no command"
            raise cli_io.UsageError(f"{got}; {usage}")
        with cli_io.usage_errors_as_exceptions():
            return COMMANDS[argv[0]](argv[1:])

    return cli_io.run_command(command)

