"""Random-access training data: example i of a corpus without reading the others.

Every source has a length, returns example i as a tuple of stripped sentences (1 for a plain
corpus, 3 for NLI triplets), names itself for messages, and has a `fingerprint`: a digest of
its content computed once (with the line index) rather than by tokenizing everything.

  TextSource   a sentence file (one sentence a line; blank lines skipped, as `read_sentences`)
  CsvSource    NLI triplets `sent0,sent1,hard_neg` (the checks of `read_nli_csv`, per line)
  TfdsSource   a TensorFlow Datasets split prepared as ArrayRecord (`tfds.data_source`)
  ListSource   examples already in memory (the small SentEval-derived sets)
"""
from __future__ import annotations

import csv
import hashlib
import json
import os
import time
import weakref
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from jaxsim.data import index as index_lib
from jaxsim.data.readers import (NLI_COLUMNS, DataError, PathLike, check_nli_header,
                                 check_nli_row)
from jaxsim.io import store


def _sha256_json(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(',', ':'), ensure_ascii=False)
    return 'sha256:' + hashlib.sha256(text.encode()).hexdigest()


class _FileSource:
    """A source over one local text file through its line index."""

    views = 1

    def __init__(self, path: PathLike, idx: index_lib.LineIndex, skip: int = 0):
        self.path, self.index, self._skip = Path(path), idx, skip
        self.name = str(path)
        self.build_s = idx.build_s
        self._fd = os.open(self.path, os.O_RDONLY)
        self.close = weakref.finalize(self, os.close, self._fd)  # also when garbage-collected

    def __len__(self) -> int:
        return len(self.index) - self._skip

    def _line(self, i: int) -> str:
        if not 0 <= i < len(self):
            raise IndexError(f'{self.name}: example {i} of {len(self)}')
        return self.index.raw(self._fd, i + self._skip)

    def fingerprint(self) -> str:
        return _sha256_json({'file': self.index.sha256, 'size': self.index.size,
                             'records': len(self)})


class TextSource(_FileSource):
    """A sentence file: sentence i is the i-th non-blank line, stripped (`read_sentences`)."""

    def __init__(self, path: PathLike):
        idx = index_lib.load_or_build(path, 'text', what='sentence file')
        if not len(idx):
            raise DataError(f'{path}: no sentences (the file is empty or blank)')
        super().__init__(path, idx)

    def __getitem__(self, i: int) -> tuple[str]:
        return (self._line(i).strip(),)


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

    def __getitem__(self, i: int) -> tuple[str, str, str]:
        row = _parse_nli_line(self._line(i), self.path, -1)
        if len(row) != 3 or not all(c.strip() for c in row):  # changed since it was indexed
            row = check_nli_row(row, self.path, self.index.line_number(i + 1))
        return tuple(c.strip() for c in row)


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
        return _sha256_json(self.rows)


class TfdsSource:
    """String fields of a TFDS split prepared as ArrayRecord, read at random without TensorFlow.

    Examples with an empty field are skipped (as `read_tfds` does): which ones is found by one
    pass over the split, cached in the index folder with a digest of the dataset's files and
    reused while those files are unchanged.
    """

    def __init__(self, name: str, split: str = 'train', data_dir: Optional[str] = None,
                 fields: Sequence[str] = ('text',)):
        import tensorflow_datasets as tfds  # heavy import, only for users of this source
        self.fields, self.views = tuple(fields), len(fields)
        self.name = f'tfds:{name}/{split}'
        try:
            folder = Path(name).expanduser()
            builder = (tfds.builder_from_directory(str(folder)) if folder.is_dir()
                       else tfds.builder(name, data_dir=data_dir))
            self.source = builder.as_data_source(split=split)
        except Exception as e:
            raise DataError(f'TFDS {name!r} split {split!r} (data_dir={data_dir}): cannot open: '
                            f'{type(e).__name__}: {e}') from None
        files = sorted(p for p in Path(str(builder.data_path)).iterdir() if p.is_file())
        key = json.loads(json.dumps({  # as it reads back from JSON
            'split': split, 'fields': self.fields,
            'files': [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}))
        self.keep, self._digest, self.build_s = self._kept(builder, files, key)
        if not len(self.keep):
            raise DataError(f'TFDS {name!r} split {split!r}: no non-empty examples')

    def _kept(self, builder, files, key) -> tuple[np.ndarray, str, float]:
        tag = _sha256_json({'data': str(builder.data_path), **key})[7:23]
        stem = index_lib.index_dir() / f'{tag}-{builder.name}.tfds-index'
        meta_path = stem.with_name(stem.name + '.json')
        array_path = stem.with_name(stem.name + '.npy')
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get('key') == key:
                return np.load(array_path, mmap_mode='r'), meta['sha256'], 0.0
        except (OSError, ValueError):
            pass
        t0 = time.perf_counter()
        keep = np.array([i for i in range(len(self.source)) if all(self._fields(i))], np.uint64)
        h = hashlib.sha256()
        for p in files:
            with p.open('rb') as f:
                while block := f.read(index_lib.CHUNK_BYTES):
                    h.update(block)
        digest, build_s = 'sha256:' + h.hexdigest(), time.perf_counter() - t0
        try:
            with store.open_atomic(array_path, 'wb') as f:
                np.save(f, keep)
            store.write_json(meta_path, {'key': key, 'sha256': digest, 'records': len(keep)})
        except (OSError, store.StorageError):
            pass  # an unwritable cache only costs the pass again next time
        return keep, digest, build_s

    def _fields(self, i: int) -> tuple[str, ...]:
        ex = self.source[i]
        row = []
        for field in self.fields:
            if field not in ex:
                raise DataError(f'{self.name} example {i}: no field {field!r} (has {sorted(ex)})')
            v = ex[field]
            row.append((v.decode('utf-8') if isinstance(v, bytes) else str(v)).strip())
        return tuple(row)

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, i: int) -> tuple[str, ...]:
        return self._fields(int(self.keep[i]))

    def fingerprint(self) -> str:
        return _sha256_json({'files': self._digest, 'fields': self.fields,
                             'records': len(self)})


class Limited:
    """The first `limit` examples of a source."""

    def __init__(self, source, limit: int):
        self.source, self.limit = source, min(limit, len(source))
        self.name, self.views, self.build_s = source.name, source.views, source.build_s

    def __len__(self) -> int:
        return self.limit

    def __getitem__(self, i: int):
        if not 0 <= i < self.limit:
            raise IndexError(f'{self.name}: example {i} of {self.limit}')
        return self.source[i]

    def fingerprint(self) -> str:
        return _sha256_json({'source': self.source.fingerprint(), 'first': self.limit})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m jaxsim.data.sources FILE... [--format text|csv]`: builds (or finds) the line
    index of each training file ahead of a run, and prints its records, time and digest."""
    import argparse
    ap = argparse.ArgumentParser(prog='python -m jaxsim.data.sources',
                                 description='Index training files once, before a run.')
    ap.add_argument('files', nargs='+')
    ap.add_argument('--format', choices=('text', 'csv'), default='text',
                    help="'text': a sentence a line; 'csv': sent0,sent1,hard_neg triplets")
    args = ap.parse_args(argv)
    kind = TextSource if args.format == 'text' else CsvSource
    for path in args.files:
        try:
            src = kind(path)
        except DataError as e:
            print(f'error: {e}')
            return 1
        how = f'indexed in {src.build_s:.1f} s' if src.build_s else 'index reused'
        print(f'{path}: {len(src)} examples, {how}, {src.index.sha256}')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
