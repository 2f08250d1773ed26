"""`python -m jaxsim prepare FILE... [--format text|csv|snli]`: index training files once, before
a run (docs/pod.md); the sources are `jaxsim.data.sources`."""
from __future__ import annotations

import argparse
from typing import Sequence

from jaxsim.cli import cli_io
from jaxsim.data.sources import CsvSource, SnliSource, TextSource


def prepare_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog='python -m jaxsim prepare',
        description='Index training files once, before a run (every process then reads only '
                    'its rows). An index is reused while its file is unchanged.')
    ap.add_argument('files', nargs='+', help='files (or SentEval SNLI folders with --format snli)')
    ap.add_argument('--format', choices=('text', 'csv', 'snli'), default='text',
                    help="'text': a sentence a line; 'csv': sent0,sent1,hard_neg triplets; "
                         "'snli': SentEval's SNLI folder")
    ap.add_argument('--snli-splits', default=None,
                    help='with --format snli (default: dev,test)')
    return cli_io.add_import_flag(ap)


def prepare_main(argv: Sequence[str]) -> int:
    """`python -m jaxsim prepare FILE... [--format text|csv|snli]`: builds (or finds) the index
    of each training file and prints its examples, time and content digest."""
    parser = prepare_parser()
    args = parser.parse_args(argv)
    if args.snli_splits is not None and args.format != 'snli':
        parser.error(f'--snli-splits {args.snli_splits} has no effect: it goes with --format snli '
                     f'(the files are read as --format {args.format})')
    for path in args.files:
        if args.format == 'snli':
            src = SnliSource(path, (args.snli_splits or 'dev,test').split(','))
            digest = src.fingerprint()
        else:
            src = (TextSource if args.format == 'text' else CsvSource)(path)
            digest = src.index.sha256
        how = f'indexed in {src.build_s:.1f} s' if src.build_s else 'index reused'
        print(f'{path}: {len(src)} examples, {how}, {digest}', flush=True)
    return 0
