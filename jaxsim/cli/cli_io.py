"""What the command lines share: reading sentence inputs (a file or `-` for stdin), seed lists,
declaring and checking output targets before any work, the `--import` flag, and running a
command with the one error / interrupt report.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

from jaxsim import plugins
from jaxsim.cli import interrupts
from jaxsim.data.readers import DataError, decode_text, read_text
from jaxsim.data.tokenize import token_ids
from jaxsim.errors import USER_ERROR_EXIT, USER_ERRORS, JaxsimError
from jaxsim.storage import store

STDIN = "-"

# The largest seed every consumer takes (np.random.RandomState, jax.random.key).
MAX_SEED = 2**32 - 1


class UsageError(JaxsimError):
    """A bad command line (unknown option, missing argument, a value that cannot be used); the
    message names the option."""


@contextlib.contextmanager
def usage_errors_as_exceptions() -> Iterator[None]:
    """argparse prints usage and exits 2 on a bad option; here every command's parser raises
    UsageError instead, so all errors share the one `error: ...` line and exit status."""

    def error(parser: argparse.ArgumentParser, message: str):
        raise UsageError(f"{message} (see {parser.prog} --help)")

    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2]; anything but comma-separated non-negative integers is an error."""
    seeds = []
    for part in str(text).split(","):
        part = part.strip()
        if not (part.isascii() and part.isdigit()):
            raise UsageError(f"--seeds {text!r}: {part!r} is not a non-negative integer "
                             "(expected e.g. --seeds 0,1,2)")
        if int(part) > MAX_SEED:
            raise UsageError(f"--seeds {text!r}: {part} is larger than {MAX_SEED} (seeds are "
                             "32-bit: NumPy and JAX keys take no more)")
        seeds.append(int(part))
    if len(set(seeds)) != len(seeds):
        raise UsageError(f"--seeds {text!r}: a seed is listed twice")
    return seeds


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the command lines' one error format: a single `error: ...` line and exit 1,
    not argparse's usage block and exit 2."""

    def error(self, message):
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)


def add_import_flag(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declares `--import MODULE` on a command's parser. Parsing then loads the plugins
    (`plugins.load_plugins`) before the rest of the command line is read, whatever the flags'
    order. A module that fails is a PluginError: this module's ArgumentParser prints it as the
    one error line and exits 1, any other parser raises it (to `run_command`)."""
    parser.add_argument(plugins.FLAG, dest="imports", action="append", default=[],
                        metavar="MODULE",
                        help="a module of your own that registers objectives, poolers, "
                             "calibrations or flow layers: a dotted name, a .py file or a "
                             "package folder; "
                             f"repeatable (also ${plugins.ENV_VAR}, comma-separated)")
    parse = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        try:
            plugins.load_plugins(plugins.imports_in(sys.argv[1:] if args is None else args))
            parsed = parse(args, namespace)
            # An abbreviated flag (`--imp M`) escapes the scan above; loaded now, once.
            plugins.load_plugins(parsed[0].imports, environ={}, entry_points=False)
        except plugins.PluginError as e:
            # The user's module is at fault, not the command line: no "(see --help)" usage hint.
            if isinstance(parser, ArgumentParser):  # parsed outside run_command (train.py)
                sys.exit(report_error(e))
            raise
        return parsed

    parser.parse_known_args = parse_known_args
    return parser


def config_overrides(parser: argparse.ArgumentParser, rest: Sequence[str]) -> list[str]:
    """The `--config.KEY=VALUE` arguments `parse_known_args` left over, as `KEY=VALUE`; any other
    leftover is a usage error naming it."""
    for item in rest:
        if not item.startswith('--config.'):
            parser.error(f'unrecognized argument {item}')
    return [item.removeprefix('--config.') for item in rest]


def input_sentences(path: Union[str, Path]) -> tuple[list[str], int, str]:
    """(sentences, blank lines skipped, name) of a sentence input (a file, or standard input
    for `-`) by the sentence-file rule of every command: lines split at '\\n', stripped, blank
    ones skipped."""
    if str(path) != STDIN:
        text, name = read_text(path, "sentence file"), str(path)
    elif sys.stdin is None or sys.stdin.isatty():
        raise DataError("--input -: reads sentences from standard input, but none is "
                        "piped in (e.g. `cat sentences.txt | python -m jaxsim ...`)")
    else:
        text, name = decode_text(sys.stdin.buffer.read(), "<stdin>"), "<stdin>"
    lines = [line.strip() for line in text.split("\n")]
    if lines and lines[-1] == "":
        lines.pop()  # a final newline ends the last line rather than starting one
    sentences = [s for s in lines if s]
    if not sentences:
        raise DataError(f"{name}: no sentences (the input is empty or blank)")
    return sentences, len(lines) - len(sentences), name


def warn_truncated(tokenizer, sentences: Sequence[str], limit: int, what: str = "") -> None:
    """One warning counting the sentences longer than `limit` tokens (special tokens included):
    they are encoded by their first tokens only, which a search would otherwise not reveal."""
    over = sum(len(ids) > limit for ids in token_ids(tokenizer, sentences, limit + 1))
    if over:
        print(f"warning: {what + ': ' if what else ''}{over} of {len(sentences)} sentences are "
              f"longer than {limit} tokens and are truncated to {limit}", file=sys.stderr)


def add_output_flags(parser: argparse.ArgumentParser, option: str, help: str,
                     overwrite_help: str, required: bool = False) -> None:
    """Declares a command's output target (`--json`, `--out`, `--output`) and `--overwrite`,
    which every command that writes takes (the target is checked by `check_output_file` /
    `check_output_dir`, before any work)."""
    parser.add_argument(option, required=required, default=None, help=help)
    parser.add_argument("--overwrite", action="store_true", help=overwrite_help)


def refuse_inputs(target, option: str, inputs: Sequence[tuple[str, object]]) -> None:
    """Refuses an existing output that is one of the command's inputs, or lies inside an input
    folder (a model, a data root): --overwrite would destroy it.

    Args:
      target: the output's epath.
      option: its flag, for the message.
      inputs: (flag, path) of each input; None, '-' (stdin) and remote paths are skipped.
    """
    if store.is_remote(target) or not target.exists():
        return
    out = Path(os.fspath(target)).resolve()
    for flag, value in inputs:
        if value is None or str(value) == STDIN or store.is_remote(value):
            continue
        source = Path(value).expanduser().resolve()
        if source.exists() and (source in out.parents or os.path.samefile(out, source)):
            raise store.StorageError(f"{option} {target} would overwrite an input ({flag} "
                                     f"{value}); name another file")


def check_output_file(path, overwrite: bool, option: str,
                      inputs: Sequence[tuple[str, object]] = ()):
    """An output file the command writes at the end: not a folder, not one of `inputs` ((flag,
    path) pairs, see `refuse_inputs`), absent unless `overwrite`, in a writable place; checked
    before a model loads. Returns its epath."""
    target = store.as_path(path, option)
    if str(path).endswith("/") or target.is_dir():
        raise store.StorageError(f"{option} {path} is a folder; name a file, e.g. "
                                 f"{target / 'out'}")
    refuse_inputs(target, option, inputs)
    store.refuse_existing(target, overwrite, option)
    # The file is written as a sibling and renamed: its folder must be writable.
    store.check_reachable(target.parent if target.exists() else target, option)
    return target


def check_output_dir(path, overwrite: bool, option: str, keep: Optional[Callable] = None):
    """An output folder written at the end: absent or empty unless `overwrite`, writable."""
    target = store.as_path(path, option)
    if target.exists() and not target.is_dir():
        raise store.StorageError(f"{option} {path} is a file, not a folder")
    store.refuse_existing(target, overwrite, option)
    if target.exists() and keep is not None and any(target.iterdir()):
        keep(target)
    store.check_reachable(target, option)
    return target


def report_error(error: Exception) -> int:
    """A user error as the one `error:` line on stderr (its whitespace folded); the exit
    status for it."""
    print("error: " + " ".join(str(error).split()), file=sys.stderr)
    return USER_ERROR_EXIT


def run_command(command: Callable[[], int]) -> int:
    """Runs a command: a user error is one `error:` line and exit 1, an interrupt one line
    and 130 / 143; both without a traceback. Installs the signal handlers first, which
    delivers a signal held back during start-up (`interrupts.block`)."""
    try:
        interrupts.install()
        return command() or 0
    except USER_ERRORS as e:
        return report_error(e)
    except KeyboardInterrupt as e:
        return interrupts.report(e)
