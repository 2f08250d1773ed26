"""`python -m jaxsim.cli.corpus`: training files made from SentEval's data (the readers are
`jaxsim.data.readers`).

    python -m jaxsim.cli.corpus snli-csv SNLI_DIR OUT.csv [--splits dev,test]
        SentEval's SNLI folder -> sent0,sent1,hard_neg triplets (supervised SimCSE's format)
    python -m jaxsim.cli.corpus corpus SENTEVAL_ROOT OUT.txt
        SentEval's text files -> one sentence a line (an unsupervised corpus)
"""
from __future__ import annotations

import argparse
from typing import Sequence

from jaxsim.data.readers import build_snli_triplets, build_unsup_corpus, write_nli_csv


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxsim.cli.corpus snli-csv SNLI_DIR OUT.csv` or `corpus ROOT OUT.txt`."""
    ap = argparse.ArgumentParser(prog='python -m jaxsim.cli.corpus')
    sub = ap.add_subparsers(dest='cmd', required=True)
    a = sub.add_parser('snli-csv', help='SentEval SNLI -> sent0,sent1,hard_neg CSV')
    a.add_argument('snli_dir')
    a.add_argument('out')
    a.add_argument('--splits', default='dev,test')
    b = sub.add_parser('corpus', help='SentEval text files -> one sentence per line')
    b.add_argument('senteval_root')
    b.add_argument('out')
    args = ap.parse_args(argv)
    if args.cmd == 'snli-csv':
        rows = build_snli_triplets(args.snli_dir, args.splits.split(','))
        print(f'{write_nli_csv(rows, args.out)}: {len(rows)} triplets')
    else:
        out = build_unsup_corpus(args.senteval_root, args.out)
        print(f'{out}: {len(out.read_text().splitlines())} sentences')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
