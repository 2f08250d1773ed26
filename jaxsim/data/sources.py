"""Random-access training data: example i of a corpus without reading the others.

Every source has a length, returns example i as a tuple of stripped sentences (1 for a plain
corpus, 3 for NLI triplets), names itself for messages, and has a `fingerprint`: a digest of
its content computed once (with the line index) rather than by tokenizing everything.

  TextSource   a sentence file (one sentence a line; blank lines skipped, as `read_sentences`)
  CsvSource    NLI triplets `sent0,sent1,hard_neg` (the checks of `read_nli_csv`, per line)
  TfdsSource   a TensorFlow Datasets split prepared as ArrayRecord (the builder's `as_data_source`)
  ListSource   examples already in memory (the small SentEval-derived sets)
"""
from __future__ import annotations

import csv
import hashlib
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from jaxsim.data import index as index_lib
from jaxsim.data.readers import (
    NLI_COLUMNS,
    DataError,
    PathLike,
    check_nli_header,
    check_nli_row,
    check_paired,
    open_tfds,
    sha256_json,
    snli_triplet_lines,
    tfds_row,
)


class _FileSource:
    """A source over one local text file through its line index."""

    views = 1

    def __init__(self, path: PathLike, idx: index_lib.LineIndex, skip: int = 0):
        self.path, self.index, self._skip = idx.path, idx, skip
        self.name, self.build_s = str(path), idx.build_s
        self._reader = idx.reader()  # refuses another version of the file

    def __len__(self) -> int:
        return len(self.index) - self._skip

    def __getitem__(self, i: int) -> tuple[str, ...]:
        return self.getitems([i])[0]

    def getitems(self, indices: Sequence[int]) -> list[tuple[str, ...]]:
        """Examples `indices`, read together (one round trip for a remote file)."""
        for i in indices:
            if not 0 <= i < len(self):
                raise IndexError(f'{self.name}: example {i} of {len(self)}')
        records = [int(i) + self._skip for i in indices]
        return [self._parse(text, r) for text, r in
                zip(self.index.read_lines(self._reader, records), records)]

    def fingerprint(self) -> str:
        return sha256_json({'file': self.index.sha256, 'size': self.index.size,
                             'records': len(self)})


class TextSource(_FileSource):
    """A sentence file: sentence i is the i-th non-blank line, stripped (`read_sentences`)."""

    def __init__(self, path: PathLike):
        idx = index_lib.load_or_build(path, 'text', what='sentence file')
        if not len(idx):
            raise DataError(f'{path}: no sentences (the file is empty or blank)')
        super().__init__(path, idx)

    def _parse(self, text: str, record: int) -> tuple[str]:
        return (text.strip(),)


def _parse_nli_line(text: str, path: PathLike, lineno: int) -> list[str]:
    try:
        rows = list(csv.reader([text], strict=True))
    except csv.Error as e:
        if 'end of data' in str(e):
            raise DataError(f'{path}:{lineno}: a quoted cell runs past the end of the line '
                            f'(unbalanced quote?)') from None
        raise DataError(f'{path}:{lineno}: malformed CSV ({e})') from None
    return rows[0] if rows else []


class _NliCheck:
    """Validates an NLI CSV's records while its index is built (header first)."""

    def __init__(self, path: PathLike):
        self.path, self.seen_header = path, False

    def __call__(self, texts: Sequence[str], linenos: np.ndarray) -> None:
        for text, lineno in zip(texts, linenos):
            row = _parse_nli_line(text, self.path, int(lineno))
            if not self.seen_header:
                check_nli_header(row if lineno == 1 else [], self.path)
                self.seen_header = True
            else:
                check_nli_row(row, self.path, int(lineno))


class CsvSource(_FileSource):
    """NLI triplets (header `sent0,sent1,hard_neg`, a triplet a line), as `read_nli_csv` reads
    them except that a quoted cell may not span lines (each example is one line)."""

    views = 3

    def __init__(self, path: PathLike):
        idx = index_lib.load_or_build(path, 'csv', check=_NliCheck(path), what='NLI CSV file')
        if not len(idx):
            raise DataError(f'{path}: empty file (expected header {",".join(NLI_COLUMNS)})')
        if len(idx) == 1:
            raise DataError(f'{path}: no triplets after the header')
        super().__init__(path, idx, skip=1)

    def _parse(self, text: str, record: int) -> tuple[str, str, str]:
        row = _parse_nli_line(text, self.path, -1)
        if len(row) != 3 or not all(c.strip() for c in row):  # changed since it was indexed
            row = check_nli_row(row, self.path, self.index.line_number(record))
        return tuple(c.strip() for c in row)


class SnliSource:
    """(premise, entailment, contradiction) triplets of SentEval's SNLI files, read at random.

    The triplets are those of `readers.build_snli_triplets` (hypotheses grouped by premise,
    each entailment paired with a contradiction of the same premise), found by one pass over
    `s1/s2/labels.<split>` and cached as line numbers ([triplets, 3] per split, beside the
    files or in the index cache folder); each triplet is then read as three lines.
    """

    views = 3

    def __init__(self, snli_dir: PathLike, splits: Sequence[str] = ('dev', 'test')):
        self.name = f'{snli_dir} ({",".join(splits)})'
        self.parts, self.build_s, digests = [], 0.0, []
        for split in splits:
            files = [Path(snli_dir) / f'{name}.{split}' for name in ('s1', 's2', 'labels')]
            idx = [index_lib.load_or_build(f, 'lines', what='SNLI file') for f in files]
            check_paired(files, [len(x) for x in idx])
            key = {'split': split, 'files': [x.sha256 for x in idx]}
            table, _, built = index_lib.cached(
                index_lib.cache_stems(files[0], 'snli-triplets'), key,
                lambda files=files: (_snli_table(files), {}))
            readers = [x.reader() for x in idx[:2]]
            self.parts.append((table, idx[:2], readers))
            self.build_s += sum(x.build_s for x in idx) + built
            digests.append(key)
        self._starts = np.cumsum([0] + [len(t) for t, _, _ in self.parts])
        self._digest = sha256_json(digests)
        if not len(self):
            raise DataError(f'{snli_dir}: no (entailment, contradiction) pairs found')

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> tuple[str, str, str]:
        if not 0 <= i < len(self):
            raise IndexError(f'{self.name}: example {i} of {len(self)}')
        part = int(np.searchsorted(self._starts, i, side='right')) - 1
        table, (s1, s2), (r1, r2) = self.parts[part]
        premise, ent, con = (int(x) for x in table[i - self._starts[part]])
        (premise,), (ent, con) = s1.read_lines(r1, [premise]), s2.read_lines(r2, [ent, con])
        return premise.strip(), ent.strip(), con.strip()

    def fingerprint(self) -> str:
        return sha256_json({'snli': self._digest, 'records': len(self)})


def _snli_table(files: Sequence[Path]) -> np.ndarray:
    """[triplets, 3] int64 0-based lines: premise (of s1), entailment and contradiction (of s2)."""
    with files[0].open('rb') as f1, files[1].open('rb') as f2, files[2].open('rb') as f3:
        rows = ([x.decode('utf-8-sig') for x in line] for line in zip(f1, f2, f3))
        return np.array(snli_triplet_lines(rows, files[2]), np.int64).reshape(-1, 3)


class ListSource:
    """Examples held in memory (tuples of sentences, or sentences)."""

    build_s = 0.0

    def __init__(self, rows: Sequence, name: str):
        self.rows = [(r,) if isinstance(r, str) else tuple(r) for r in rows]
        if not self.rows:
            raise DataError(f'{name}: no examples')
        self.name, self.views = name, len(self.rows[0])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[str, ...]:
        return self.rows[i]

    def fingerprint(self) -> str:
        return sha256_json(self.rows)


class TfdsSource:
    """String fields of a TFDS split prepared as ArrayRecord, read at random without TensorFlow.

    Examples with an empty field are skipped (as `read_tfds` does): which ones is found by one
    pass over the split, cached in the index folder with a digest of the dataset's files and
    reused while those files are unchanged.
    """

    def __init__(self, name: str, split: str = 'train', data_dir: Optional[str] = None,
                 fields: Sequence[str] = ('text',)):
        self.fields, self.views = tuple(fields), len(fields)
        self.name = f'tfds:{name}/{split}'
        builder, self.source = open_tfds(name, split, data_dir)
        files = sorted(p for p in Path(str(builder.data_path)).iterdir() if p.is_file())
        key = {'split': split, 'fields': self.fields,
               'files': [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}

        def build():
            keep = np.array([i for i in range(len(self.source)) if all(self._fields(i))],
                            np.uint64)
            h = hashlib.sha256()
            for p in files:
                with p.open('rb') as f:
                    while block := f.read(index_lib.CHUNK_BYTES):
                        h.update(block)
            return keep, {'sha256': 'sha256:' + h.hexdigest()}

        tag = sha256_json({'data': str(builder.data_path), **key})[7:23]
        stem = index_lib.index_dir() / f'{tag}-{builder.name}.tfds-index'
        self.keep, meta, self.build_s = index_lib.cached([stem], key, build)
        self._digest = meta['sha256']
        if not len(self.keep):
            raise DataError(f'TFDS {name!r} split {split!r}: no non-empty examples')

    def _fields(self, i: int) -> tuple[str, ...]:
        return tfds_row(self.source[i], self.fields, f'{self.name} example {i}')

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, i: int) -> tuple[str, ...]:
        return self._fields(int(self.keep[i]))

    def fingerprint(self) -> str:
        return sha256_json({'files': self._digest, 'fields': self.fields,
                             'records': len(self)})


class Limited:
    """The first `limit` examples of a source."""

    def __init__(self, source, limit: int):
        self.source, self.limit = source, min(limit, len(source))
        self.name, self.views, self.build_s = source.name, source.views, source.build_s

    def __len__(self) -> int:
        return self.limit

    def __getitem__(self, i: int):
        return self.getitems([i])[0]

    def getitems(self, indices: Sequence[int]) -> list:
        for i in indices:
            if not 0 <= i < self.limit:
                raise IndexError(f'{self.name}: example {i} of {self.limit}')
        inner = getattr(self.source, 'getitems', None)
        return inner(list(indices)) if inner else [self.source[i] for i in indices]

    def fingerprint(self) -> str:
        return sha256_json({'source': self.source.fingerprint(), 'first': self.limit})
