"""Readers of training data: sentence files, NLI CSV, SentEval SNLI triplets, TFDS, corpora.

Every reader returns plain Python data (strings, or tuples of strings) and raises DataError
naming the file and line for bad input.
"""
from __future__ import annotations

import csv
import logging
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from jaxsim.errors import JaxsimError

log = logging.getLogger(__name__)

NLI_COLUMNS = ('sent0', 'sent1', 'hard_neg')


class DataError(JaxsimError):
    """Bad training data; the message names the file (and line)."""


# ---------------------------------------------------------------------------------------------
# Readers.
# ---------------------------------------------------------------------------------------------

def read_corpus(path: str | Path) -> list[str]:
    """Unsupervised corpus: a text file with one sentence per line; blank lines are skipped.

    Raises:
      DataError: missing/undecodable file, or a file without any sentence.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f'{path}: corpus file not found')
    sentences = []
    with path.open('rb') as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode('utf-8').strip()
            except UnicodeDecodeError as e:
                raise DataError(f'{path}:{lineno}: not valid UTF-8 ({e.reason})') from None
            if line:
                sentences.append(line)
    if not sentences:
        raise DataError(f'{path}: no sentences (the file is empty or blank)')
    return sentences


def read_nli_csv(path: str | Path) -> list[tuple[str, str, str]]:
    """Supervised data: CSV with header `sent0,sent1,hard_neg` (the reference NLI format).

    Raises:
      DataError: missing file, wrong header, or a malformed row (wrong column count or an empty
        field), naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f'{path}: NLI CSV file not found')
    rows = []
    with path.open(encoding='utf-8', newline='') as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise DataError(f'{path}: empty file (expected header {",".join(NLI_COLUMNS)})')
        header = [h.strip() for h in header]
        if tuple(header) != NLI_COLUMNS:
            raise DataError(f'{path}:1: header {header} != {list(NLI_COLUMNS)}')
        for row in reader:
            lineno = reader.line_num
            if not row:
                continue
            if len(row) != 3:
                raise DataError(f'{path}:{lineno}: expected 3 columns {NLI_COLUMNS}, got '
                                f'{len(row)}')
            row = [c.strip() for c in row]
            for name, cell in zip(NLI_COLUMNS, row):
                if not cell:
                    raise DataError(f'{path}:{lineno}: empty {name!r}')
            rows.append(tuple(row))
    if not rows:
        raise DataError(f'{path}: no triplets after the header')
    return rows


def build_snli_triplets(snli_dir: str | Path, splits: Sequence[str] = ('dev', 'test')
                        ) -> list[tuple[str, str, str]]:
    """(premise, entailment, contradiction) triplets from SentEval's SNLI files.

    SentEval ships `s1.<split>` (premises), `s2.<split>` (hypotheses) and `labels.<split>`, one
    pair per line. Hypotheses are grouped by premise; each entailment is paired with a
    contradiction of the same premise (cycling when counts differ), the construction behind the
    reference's `nli_for_simcse.csv`. Premises lacking either label are dropped.

    Raises:
      DataError: a missing file, or files of different lengths.
    """
    snli_dir = Path(snli_dir)
    triplets = []
    for split in splits:
        files = [snli_dir / f'{name}.{split}' for name in ('s1', 's2', 'labels')]
        for f in files:
            if not f.is_file():
                raise DataError(f'{f}: SNLI file not found')
        columns = [f.read_text(encoding='utf-8').splitlines() for f in files]
        if len({len(c) for c in columns}) != 1:
            raise DataError(f'{snli_dir}: {", ".join(f.name for f in files)} have different '
                            f'line counts {[len(c) for c in columns]}')
        groups: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        order = []
        for s1, s2, label in zip(*columns):
            s1, s2, label = s1.strip(), s2.strip(), label.strip()
            if not s1 or not s2:
                continue
            if s1 not in groups:
                order.append(s1)
            groups[s1][label].append(s2)
        for premise in order:
            ent, con = groups[premise]['entailment'], groups[premise]['contradiction']
            for i, hyp in enumerate(ent):
                if con:
                    triplets.append((premise, hyp, con[i % len(con)]))
    if not triplets:
        raise DataError(f'{snli_dir}: no (entailment, contradiction) pairs found')
    return triplets


def write_nli_csv(triplets: Sequence[tuple[str, str, str]], path: str | Path) -> Path:
    """Writes triplets in the reference CSV format (header sent0,sent1,hard_neg)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open('w', encoding='utf-8', newline='') as f:
        w = csv.writer(f)
        w.writerow(NLI_COLUMNS)
        w.writerows(triplets)
    return path


def read_tfds(name: str, split: str = 'train', data_dir: str | None = None,
              fields: Sequence[str] = ('text',)) -> list[tuple[str, ...]]:
    """Rows from a TensorFlow Datasets dataset via `tfds.data_source` (no TensorFlow needed).

    Works for datasets prepared with `file_format='array_record'`. `name` is a registered TFDS
    name (optionally 'name:version', found under `data_dir`), or the folder of a prepared
    dataset version (e.g. '~/tensorflow_datasets/my_corpus/1.0.0'), which needs no builder code.

    Args:
      name: dataset name or prepared-dataset folder.
      split: split name (TFDS slicing syntax allowed, e.g. 'train[:10%]').
      data_dir: TFDS data directory.
      fields: the string features to read per example (1 for unsup, 3 for sup, in order
        sent0, sent1, hard_neg).

    Returns:
      A list of tuples of str, one tuple per example.
    """
    import tensorflow_datasets as tfds  # heavy import, only for users of this source
    try:
        if Path(name).expanduser().is_dir():
            source = tfds.builder_from_directory(str(Path(name).expanduser())).as_data_source(
                split=split)
        else:
            source = tfds.data_source(name, split=split, data_dir=data_dir)
    except Exception as e:
        raise DataError(f'TFDS {name!r} split {split!r} (data_dir={data_dir}): cannot open: '
                        f'{type(e).__name__}: {e}') from None
    rows = []
    for i in range(len(source)):
        ex = source[i]
        row = []
        for field in fields:
            if field not in ex:
                raise DataError(f'TFDS {name!r} example {i}: no field {field!r} '
                                f'(has {sorted(ex)})')
            v = ex[field]
            row.append((v.decode('utf-8') if isinstance(v, bytes) else str(v)).strip())
        if all(row):
            rows.append(tuple(row))
    if not rows:
        raise DataError(f'TFDS {name!r} split {split!r}: no non-empty examples')
    return rows


# Plain one-sentence-per-line SentEval files usable as an unsupervised corpus. STS files are
# deliberately absent: training on evaluation sentences would leak.
CORPUS_FILES = ('SNLI/s1.dev', 'SNLI/s2.dev', 'SNLI/s1.test', 'SNLI/s2.test',
                'MR/rt-polarity.pos', 'MR/rt-polarity.neg', 'CR/custrev.pos', 'CR/custrev.neg',
                'MPQA/mpqa.pos', 'MPQA/mpqa.neg')


def collect_corpus(senteval_root: str | Path, files: Sequence[str] = CORPUS_FILES,
                   min_words: int = 3) -> list[str]:
    """Deduplicated sentences (first-seen order) from shipped SentEval plain-text files.

    Args:
      senteval_root: the SentEval data folder.
      files: relative paths of one-sentence-per-line files (a missing one is an error).
      min_words: drop fragments shorter than this (MPQA holds many 1-2 word phrases).
    """
    root = Path(senteval_root)
    seen, sentences = set(), []
    for rel in files:
        path = root / rel
        if not path.is_file():
            raise DataError(f'{path}: corpus source not found')
        for line in path.read_text(encoding='utf-8', errors='replace').splitlines():
            s = line.strip()
            if len(s.split()) >= min_words and s not in seen:
                seen.add(s)
                sentences.append(s)
    if not sentences:
        raise DataError(f'{root}: no sentences in {list(files)}')
    return sentences


def build_unsup_corpus(senteval_root: str | Path, out_path: str | Path,
                       files: Sequence[str] = CORPUS_FILES, min_words: int = 3) -> Path:
    """Writes `collect_corpus(...)` as a one-sentence-per-line corpus file; returns its path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    sentences = collect_corpus(senteval_root, files, min_words)
    out_path.write_text('\n'.join(sentences) + '\n', encoding='utf-8')
    return out_path


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxsim.data.pipeline snli-csv SNLI_DIR OUT.csv` or `corpus ROOT OUT.txt`."""
    import argparse
    ap = argparse.ArgumentParser(prog='python -m jaxsim.data.pipeline')
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
