"""Every flag the documentation's command lines use is exercised by some test, not only parsed
(docs_test.py checks that the documented lines parse)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.docs_test import documented_commands

TESTS = Path(__file__).resolve().parent


def documented_flags():
    """(page, command, flag) of every `--flag` in a documented `python ...` line."""
    for page, command in documented_commands():
        args = shlex.split(re.sub(r'\[([^\]]*)\]', r'\1', command))[1:]
        if args[0].startswith('benchmarks/'):
            continue  # benchmark scripts have their own tests
        name = ' '.join(args[:3]) if args[0] == '-m' else args[0]
        for arg in args:
            if arg.startswith('--'):
                yield page, name, arg.split('=')[0]


def test_every_documented_flag_is_used_by_a_test():
    sources = [p.read_text() for p in TESTS.rglob('*.py')
               if p.name not in ('docs_test.py', Path(__file__).name)]
    unused = sorted({(page, name, flag) for page, name, flag in documented_flags()
                     if not any(f'"{flag}"' in s or f"'{flag}'" in s or f'{flag}=' in s
                                for s in sources)})
    assert len(list(documented_flags())) > 30
    assert not unused, unused
