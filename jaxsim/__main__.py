"""Command line: `python -m jaxsim {encode,export,index,search,serve,prepare} [options]`.

    python -m jaxsim encode --input sentences.txt --output vectors.npy [--model M]
    python -m jaxsim export --checkpoint WORKDIR_OR_FOLDER --out DIR
        [--format hf|sentence-transformers] [--post whitening[:K]|sn|natsv:K --fit-data FILE]
    python -m jaxsim index / search   (see jaxsim/search/cli.py)
    python -m jaxsim serve --index DIR  (see docs/serve.md)
    python -m jaxsim prepare FILE... [--format text|csv|snli]  (index training data; docs/pod.md)

Every command reports a user error (bad file, bad option, unreadable model) as one line
`error: <message>` on stderr and exits 1; anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jaxsim import runtime
from jaxsim.data.readers import read_text, read_sentences, text_lines
from jaxsim.data.sources import prepare_main
from jaxsim.data.tokenize import token_ids
from jaxsim.encode import encode
from jaxsim.errors import USER_ERROR_EXIT, USER_ERRORS, JaxsimError
from jaxsim.io.export import FORMATS, export_source, exportable_calibrations
from jaxsim.io.pretrained import bundled_model_path, load_pretrained
from jaxsim.models.poolers import POOLERS
from jaxsim.search.cli import index_main, search_main
from jaxsim.serve.cli import serve_main


class UsageError(JaxsimError):
    """A bad command line (unknown option, missing argument, bad value)."""


@contextlib.contextmanager
def _usage_errors_as_exceptions() -> Iterator[None]:
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


# ----------------------------------------------------------------------------------- encode
def _check_output_file(path: Path, overwrite: bool) -> Path:
    """Refuses an output that exists (without --overwrite), is a folder, or cannot be written;
    checked before the model is loaded, so no encoding time is wasted."""
    if path.is_dir():
        raise UsageError(f"--output {path} is a folder; name a file, e.g. {path / 'vectors.npy'}")
    if path.exists() and not overwrite:
        raise UsageError(f"--output {path} exists; pass --overwrite to replace it")
    folder = path.absolute().parent
    if not folder.is_dir():
        raise UsageError(f"--output {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"--output {path}: the folder {folder} is not writable")
    return path


def _write_npy(path: Path, array: np.ndarray) -> None:
    """Writes exactly `path` (np.save on a name would append '.npy' to e.g. 'vecs.bin'), via a
    sibling temporary file renamed into place, so a failure never leaves half a file. The file
    is created by open(), so its mode follows the umask (0644 under 022)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "xb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _count_over_limit(tokenizer, sentences: Sequence[str], limit: int) -> int:
    """Sentences longer than `limit` tokens (special tokens included), i.e. truncated."""
    ids = token_ids(tokenizer, sentences, max_length=limit + 1)
    return sum(len(s) > limit for s in ids)


def encode_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxsim encode",
        description="Encode sentences (one a line) into a float32 .npy matrix, one row a "
                    "sentence. Blank lines are skipped (the same rule as every jaxsim command "
                    "reading sentence files): row i is the i-th non-blank line, and the "
                    "number skipped is reported.")
    p.add_argument("--model", default=None,
                   help="HF folder, hub id or train workdir (default: the bundled "
                        "all-MiniLM-L6-v2)")
    p.add_argument("--input", required=True, type=Path, help="UTF-8 text, one sentence a line")
    p.add_argument("--output", required=True, type=Path,
                   help="the .npy file to write (written under exactly this name)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--pooler", choices=POOLERS.names(), default=None,
                   help="default: the model's own")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None,
                   help="token limit, special tokens included (default: the model's); longer "
                        "sentences are truncated, with a warning")
    p.add_argument("--normalize", action="store_true", help="L2-normalize the vectors")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype (the output is float32 either way)")
    return p


def encode_main(argv: Sequence[str]) -> int:
    args = encode_parser().parse_args(argv)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {args.batch_size}")
    output = _check_output_file(args.output, args.overwrite)
    sentences = read_sentences(args.input)
    skipped = len(text_lines(read_text(args.input))) - len(sentences)
    if skipped:
        print(f"note: {args.input}: skipped {skipped} blank line{'s' * (skipped > 1)}; row i "
              f"of the output is the i-th non-blank line", file=sys.stderr)
    model = load_pretrained(args.model or bundled_model_path(), pooler=args.pooler)
    limit = model.max_length() if args.max_length is None else args.max_length
    if not 2 <= limit <= model.config.max_length:
        raise UsageError(f"--max-length must be in [2, {model.config.max_length}] for "
                         f"{model.path}, got {limit}")
    over = _count_over_limit(model.tokenizer, sentences, limit)
    if over:
        print(f"warning: {over} of {len(sentences)} sentences are longer than {limit} tokens "
              f"and are truncated to {limit}", file=sys.stderr)
    vectors = encode(model, sentences, batch_size=args.batch_size, max_length=limit,
                     normalize=args.normalize, dtype=getattr(jnp, args.dtype))
    _write_npy(output, vectors)
    print(f"wrote {vectors.shape[0]} x {vectors.shape[1]} vectors to {output}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------- export
def export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jaxsim export",
        description="Export a train workdir, a Hugging Face / sentence-transformers folder or "
                    "a hub model as a Hugging Face or sentence-transformers folder.")
    p.add_argument("--checkpoint", "--model", dest="source", required=True,
                   help="train workdir (model.json + checkpoints/), model folder or hub id")
    p.add_argument("--out", required=True, type=Path,
                   help="output folder: absent, empty, or a previous export with --overwrite")
    p.add_argument("--format", default="hf", choices=FORMATS)
    p.add_argument("--pooler", default=None, choices=POOLERS.names(),
                   help="default: the source's own (a workdir refuses another one)")
    p.add_argument("--step", default="best", help="workdir checkpoint: best | latest | N")
    p.add_argument("--post", default="none",
                   help="affine calibration baked in as a Dense module (sentence-transformers "
                        f"format): {' | '.join(exportable_calibrations())}")
    p.add_argument("--fit-data", type=Path, default=None,
                   help="sentences (one a line, blank lines skipped) to fit --post on")
    p.add_argument("--calibration", type=Path, default=None,
                   help="a saved affine calibration folder to bake in instead of --post")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="append Normalize (default: as the source sentence-transformers "
                        "folder, else off)")
    p.add_argument("--max-length", type=int, default=None,
                   help="token limit (sentence-transformers max_seq_length)")
    p.add_argument("--batch-size", type=int, default=64, help="encoding batch for --post")
    p.add_argument("--overwrite", action="store_true", help="replace a previous export")
    return p


def export_main(argv: Sequence[str]) -> int:
    args = export_parser().parse_args(argv)
    step = int(args.step) if args.step.isdigit() else args.step
    if step not in ("best", "latest") and not isinstance(step, int):
        raise UsageError(f"--step must be best, latest or a step number, got {args.step!r}")
    out = export_source(args.source, args.out, args.format, pooler=args.pooler, step=step,
                        post=args.post, fit_data=args.fit_data,
                        calibration=args.calibration, normalize=args.normalize,
                        max_length=args.max_length, batch_size=args.batch_size,
                        overwrite=args.overwrite)
    print(f"exported {args.source} -> {out} ({args.format})", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------- main
COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "encode": encode_main,
    "export": export_main,
    "index": index_main,
    "search": search_main,
    "serve": serve_main,
    "prepare": prepare_main,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: python -m jaxsim {{{','.join(COMMANDS)}}} [options]"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    runtime.setup()
    try:
        if not argv or argv[0] not in COMMANDS:
            got = f"unknown command {argv[0]!r}" if argv else "no command"
            raise UsageError(f"{got}; {usage}")
        with _usage_errors_as_exceptions():
            return COMMANDS[argv[0]](argv[1:]) or 0
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
