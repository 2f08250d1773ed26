"""Command line: `python -m jaxsim {encode,export,index,search,serve,prepare,analyze} [options]`.

    python -m jaxsim encode --input sentences.txt --output vectors.npy [--model M]
    python -m jaxsim export --checkpoint WORKDIR_OR_FOLDER --out DIR
        [--format hf|sentence-transformers] [--post whitening[:K]|sn|natsv:K --fit-data FILE]
    python -m jaxsim index / search   (see jaxsim/search/cli.py)
    python -m jaxsim serve --index DIR  (see docs/serve.md)
    python -m jaxsim prepare FILE... [--format text|csv|snli]  (index training data; docs/pod.md)
    python -m jaxsim analyze --corpus FILE --out DIR  (jaxsim/eval/frequency_cli.py)
    python -m jaxsim plan --config C --topology v5e:4x4  (a TPU plan on any machine; docs/pod.md)

Every command reports a user error (bad file, bad option, unreadable model) as one line
`error: <message>` on stderr and exits 1, and SIGINT / SIGTERM as one line with exit 130 / 143
(start-up included: jaxsim/__init__.py holds them back until `main` installs its handlers);
anything else is a bug and keeps its traceback. Every output follows `jaxsim.io.store`'s rule:
an existing target is refused without --overwrite, and it is written whole or not at all.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jaxsim import cli_io, distributed, runtime
from jaxsim import plugins
from jaxsim.data.sources import prepare_main
from jaxsim.data.tokenize import token_ids
from jaxsim.encode import encode
from jaxsim.errors import JaxsimError
from jaxsim.io import store
from jaxsim.io.export import FORMATS, RECORD_FILE, export_source, exportable_calibrations
from jaxsim.io.pretrained import bundled_model_path, describe_provenance, load_pretrained
from jaxsim.models.poolers import POOLERS
from jaxsim.search.cli import index_main, search_main
from jaxsim.serve.cli import serve_main
from jaxsim.eval.frequency_cli import analyze_main
from jaxsim.plan.cli import plan_main
from jaxsim.plan.figures import exit_process


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
    p.add_argument("--input", required=True,
                   help="UTF-8 text, one sentence a line; - reads standard input")
    cli_io.add_output_flags(p, "--output", "the .npy file to write (written under exactly this "
                            "name)", overwrite_help="replace an existing --output", required=True)
    p.add_argument("--pooler", choices=POOLERS, default=None,
                   help="default: the model's own")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-length", type=int, default=None,
                   help="token limit, special tokens included (default: the model's); longer "
                        "sentences are truncated, with a warning")
    p.add_argument("--normalize", action="store_true", help="L2-normalize the vectors")
    distributed.add_launch_flags(p)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="compute dtype (the output is float32 either way)")
    return plugins.add_import_flag(p)


def encode_main(argv: Sequence[str]) -> int:
    args = encode_parser().parse_args(argv)
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be positive, got {args.batch_size}")
    output = cli_io.check_output_file(args.output, args.overwrite, "--output",
                                      inputs=[("--input", args.input), ("--model", args.model)])
    # Every process of a multi-process run encodes its devices' rows of each batch; the
    # vectors are gathered on all, and process 0 writes them.
    distributed.initialize_from_flags(args)
    main_process = distributed.is_main_process()
    sentences, skipped, name = cli_io.input_sentences(args.input)
    distributed.check_same_inputs({"sentences": sentences})
    if skipped:
        print(f"note: {name}: skipped {skipped} blank line{'s' * (skipped > 1)}; row i "
              f"of the output is the i-th non-blank line", file=sys.stderr)
    model = load_pretrained(bundled_model_path() if args.model is None else args.model,
                            pooler=args.pooler)
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
    if not main_process:
        return 0
    # Exactly this name (np.save on a name would append '.npy'), whole or not at all.
    with store.open_atomic(output, "wb", overwrite=args.overwrite, what="--output") as f:
        np.save(f, vectors)
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
    cli_io.add_output_flags(
        p, "--out", "output folder: absent, empty, or a previous export with --overwrite",
        overwrite_help="replace a previous export", required=True)
    p.add_argument("--format", default="hf", choices=FORMATS)
    p.add_argument("--pooler", default=None, choices=POOLERS,
                   help="default: the source's own (a workdir refuses another one)")
    p.add_argument("--step", default="best", help="workdir checkpoint: best | latest | N")
    p.add_argument("--post", default="none",
                   help="calibration baked into the sentence-transformers folder (an affine one "
                        "as a Dense module, a flow as a PyTorch module file): "
                        f"{' | '.join(exportable_calibrations())}")
    p.add_argument("--fit-data", type=Path, default=None,
                   help="sentences (one a line, blank lines skipped) to fit --post on")
    p.add_argument("--calibration", type=Path, default=None,
                   help="a saved calibration or flow folder to bake in instead of --post")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help="append Normalize (default: as the source sentence-transformers "
                        "folder, else off)")
    p.add_argument("--max-length", type=int, default=None,
                   help="token limit (sentence-transformers max_seq_length)")
    p.add_argument("--batch-size", type=int, default=64, help="encoding batch for --post")
    return plugins.add_import_flag(p)


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
    origin = json.loads((out / RECORD_FILE).read_text(encoding="utf-8")).get("provenance", {})
    print(f"exported {describe_provenance(origin) if origin else args.source} -> {out} "
          f"({args.format})", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------- main
COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "encode": encode_main,
    "export": export_main,
    "index": index_main,
    "search": search_main,
    "serve": serve_main,
    "prepare": prepare_main,
    "analyze": analyze_main,
    "plan": plan_main,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: python -m jaxsim {{{','.join(COMMANDS)}}} [options]"

    def command() -> int:
        if argv[:1] in (["-h"], ["--help"]):
            print(usage)
            return 0
        runtime.setup()
        if not argv or argv[0] not in COMMANDS:
            got = f"unknown command {argv[0]!r}" if argv else "no command"
            raise UsageError(f"{got}; {usage}")
        with _usage_errors_as_exceptions():
            return COMMANDS[argv[0]](argv[1:])

    return cli_io.run_command(command)


if __name__ == "__main__":
    exit_process(main())
