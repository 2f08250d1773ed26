"""Checks a command line runs before any work: outputs it can write, well-formed seed lists.

An evaluation can take minutes; a typo in `--json` or an unwritable `--plots` folder must fail
in the first second, not after it.
"""
from __future__ import annotations

import logging
import os
import pathlib

from jaxsim.errors import JaxsimError


class OptionError(JaxsimError):
    """A command-line value that cannot be used; the message names the option."""


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; anything but comma-separated non-negative integers is an error."""
    seeds = []
    for part in str(text).split(','):
        part = part.strip()
        if not part.isdigit():
            raise OptionError(f'--seeds {text!r}: {part!r} is not a non-negative integer '
                              '(expected e.g. --seeds 0,1,2)')
        seeds.append(int(part))
    if len(set(seeds)) != len(seeds):
        raise OptionError(f'--seeds {text!r}: a seed is listed twice')
    return seeds


def _writable_ancestor(path: pathlib.Path, option: str) -> None:
    """The nearest existing ancestor of `path` (which does not exist) must be a writable
    folder."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OptionError(f'{option} {path}: {parent} is a file, not a folder')
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OptionError(f'{option} {path}: cannot write in {parent} (permission denied)')


def check_output_file(path, option: str = '--json') -> pathlib.Path:
    """A file the command will write later: not a folder, and creatable or writable now."""
    path = pathlib.Path(path)
    if path.is_dir() or str(path).endswith(os.sep):
        raise OptionError(f'{option} {path}: is a folder; give a file path such as '
                          f'{path / "results.json"}')
    if path.exists():
        if not os.access(path, os.W_OK):
            raise OptionError(f'{option} {path}: the file is not writable')
    else:
        _writable_ancestor(path, option)
    return path


def check_output_dir(path, option: str = '--plots') -> pathlib.Path:
    """A folder the command will write into later: a folder (or creatable), writable."""
    path = pathlib.Path(path)
    if path.exists():
        if not path.is_dir():
            raise OptionError(f'{option} {path}: is a file, not a folder')
        if not os.access(path, os.W_OK | os.X_OK):
            raise OptionError(f'{option} {path}: the folder is not writable')
    else:
        _writable_ancestor(path, option)
    return path


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_library_logs() -> None:
    """Drops library log lines that are not news to a user loading a saved model.

    orbax logs 'Given directory is read only' every time a train workdir is opened for
    reading (through absl's logger).
    """
    logging.getLogger('absl').addFilter(_DropMessage('Given directory is read only'))
