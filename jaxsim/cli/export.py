"""`python -m jaxsim export`: a train workdir, model folder or hub model as a Hugging Face or
sentence-transformers folder (the workflow is `jaxsim.export.export_source`).

    python -m jaxsim export --checkpoint WORKDIR_OR_FOLDER --out DIR
        [--format hf|sentence-transformers] [--post whitening[:K]|sn|natsv:K --fit-data FILE]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from jaxsim.cli import cli_io
from jaxsim.cli.cli_io import UsageError
from jaxsim.export import FORMATS, RECORD_FILE, export_source, exportable_calibrations
from jaxsim.formats.pretrained import describe_provenance
from jaxsim.models.poolers import POOLERS


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
    return cli_io.add_import_flag(p)


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
