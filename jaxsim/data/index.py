"""Line-offset indexes of text files: built once, cached, reused while the file is unchanged.

A corpus is read at random through an [N, 2] uint64 array of the (start, end) byte offsets of
its records, built by one streaming pass that validates the file as `readers.read_text` does
and hashes its content. Where it is cached and when it is reused: docs/training.md. It is
reused while the file's size, modification time and a hash of its first and last 64 KiB are
unchanged. The file must stay the one indexed while it is read (offsets into another file's
bytes read other text): every read checks that, raising `DataChangedError` naming the file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import fsspec
import numpy as np

from jaxsim.data.readers import MAX_LINE_CHARS, DataError, PathLike, read_checked
from jaxsim.storage import store

log = logging.getLogger(__name__)

INDEX_VERSION = 1
CHUNK_BYTES = 1 << 22  # scanned at a time: the per-chunk numpy work stays ~100 MB
EDGE_BYTES = 1 << 16
_BOM = b'\xef\xbb\xbf'
# Bytes that str.isspace() holds for (str.strip() removes them): \t \n \v \f \r, \x1c-\x1f,
# space. Other whitespace is non-ASCII (U+00A0, U+2028, ...), checked by decoding the line.
_ASCII_SPACE = np.zeros(256, bool)
_ASCII_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
# A validator of records: (texts, 1-based line numbers) -> None, raising DataError.
Check = Callable[[Sequence[str], np.ndarray], None]


def index_dir() -> Path:
    """The index cache folder for files whose own folder is not writable."""
    return Path(os.environ.get('JAXSIM_INDEX_DIR')
                or Path.home() / '.cache' / 'jaxsim' / 'index')


@dataclasses.dataclass(frozen=True)
class FileKey:
    """What identifies a file's version cheaply: size, mtime and a hash of its edges."""

    size: int
    mtime_ns: int
    edges: str

    @classmethod
    def of(cls, path: Path) -> 'FileKey':
        st = path.stat()
        if hasattr(st, 'st_size'):
            size, mtime_ns = st.st_size, st.st_mtime_ns
        else:  # an epath StatResult (gs://, s3://): seconds
            size, mtime_ns = st.length, int(float(st.mtime or 0) * 1e9)
        h = hashlib.sha256()
        with path.open('rb') as f:
            h.update(f.read(EDGE_BYTES))
            if size > EDGE_BYTES:
                f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
                h.update(f.read(EDGE_BYTES))
        return cls(size, mtime_ns, h.hexdigest()[:32])


class DataChangedError(DataError):
    """A file changed while a run read it through its index."""


def changed_error(path: PathLike, how: str) -> DataChangedError:
    return DataChangedError(f'{path} changed during the run ({how}); restore it, or start a '
                            f'new run on it')


# The fields of an fsspec `info` that change when a remote object is rewritten.
_REMOTE_VERSION = ('size', 'generation', 'etag', 'ETag', 'mtime', 'updated', 'LastModified')


class ByteReader:
    """Reads byte ranges of one file from any thread: `os.pread` on a local file; on a remote
    one (gs://, s3://) ranged reads through its fsspec file system, all ranges of a call at
    once (one round trip for a batch rather than one per line).

    Given the `FileKey` of the version that was indexed, `check()` raises DataChangedError
    once the file is another version.
    """

    def __init__(self, path: PathLike, key: Optional[FileKey] = None):
        self.name, self._key = str(path), key
        if store.is_remote(path):
            self._fs, self._path = fsspec.core.url_to_fs(str(path))
            self._version = self._remote_version() if key is not None else None
            if self._version is not None and self._version.get('size') != key.size:
                raise changed_error(self.name, f'size {key.size} -> {self._version["size"]} '
                                               f'bytes')
        else:
            self._fs, self._fd = None, os.open(path, os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)  # closed with the reader

    def read(self, spans: np.ndarray) -> list[bytes]:
        """The bytes of each [start, end) row of `spans`."""
        starts, ends = [int(x) for x in spans[:, 0]], [int(x) for x in spans[:, 1]]
        if self._fs is None:
            return [os.pread(self._fd, e - s, s) for s, e in zip(starts, ends)]
        return self._fs.cat_ranges([self._path] * len(starts), starts, ends, on_error='raise')

    def check(self) -> None:
        """Raises DataChangedError when the file is no longer the indexed version (nothing is
        checked without a key). One or two `stat` calls locally; one metadata request remote."""
        key = self._key
        if key is None:
            return
        if self._fs is not None:
            now = self._remote_version()
            if now is None:
                raise changed_error(self.name, 'removed')
            if now != self._version:
                raise changed_error(self.name, _size_change(key.size, now.get('size'))
                                    or 'rewritten: new version, same size')
            return
        try:
            st = os.stat(self.name)
        except FileNotFoundError:
            raise changed_error(self.name, 'removed') from None
        except OSError as e:
            raise DataError(f'{self.name}: cannot read file: {e.strerror or e}') from None
        size = _size_change(key.size, st.st_size)
        if size:
            raise changed_error(self.name, size)
        if st.st_mtime_ns != key.mtime_ns:
            raise changed_error(self.name, 'rewritten: modification time changed, same size')
        # An in-place rewrite changes the file read; a rename over the path leaves the reader
        # on the old file, which the path (and the run's record) no longer names.
        fst = os.fstat(self._fd)
        if (st.st_dev, st.st_ino) != (fst.st_dev, fst.st_ino):
            raise changed_error(self.name, 'replaced by another file')

    def _remote_version(self) -> Optional[dict]:
        try:
            self._fs.invalidate_cache(self._path)  # a listing may hold the old metadata
            info = self._fs.info(self._path)
        except FileNotFoundError:
            return None
        return {k: str(info[k]) if k != 'size' else int(info[k])
                for k in _REMOTE_VERSION if info.get(k) is not None}


def _size_change(before: int, now) -> str:
    return '' if now == before else f'size {before} -> {now} bytes'


class DiskArray:
    """A saved .npy array read by rows with `os.pread`, never loaded or memory-mapped: a memory
    map's resident memory grows with the corpus (docs/performance.md), reading rows does not."""

    def __init__(self, path: Path):
        with open(path, 'rb') as f:
            version = np.lib.format.read_magic(f)
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            self.shape, fortran, self.dtype = read_header(f)
            self._start = f.tell()
        if fortran and len(self.shape) > 1:
            raise ValueError(f'{path}: Fortran-ordered array')
        self._row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        fd = self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, fd)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows):
        """Row i (an int) or rows (a sequence or array of ints)."""
        one = np.ndim(rows) == 0
        rows = np.atleast_1d(np.asarray(rows, np.int64))
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f'rows out of range [0, {len(self)})')
        data = b''.join(os.pread(self._fd, self._row, self._start + int(r) * self._row)
                        for r in rows)
        out = np.frombuffer(data, self.dtype).reshape((len(rows),) + tuple(self.shape[1:]))
        return out[0] if one else out

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self[np.arange(len(self))], dtype)


@dataclasses.dataclass
class LineIndex:
    """The records of one text file and how to read them: their [records, 2] uint64 (start,
    end) byte `offsets`, the file's `sha256`, `size` and physical `lines`, the seconds spent
    building the index now (`build_s`, 0.0 when reused) and the version indexed (`key`, which
    its readers refuse any other than; None: not checked)."""

    path: Path
    offsets: Union[np.ndarray, DiskArray]
    sha256: str
    size: int
    lines: int
    build_s: float = 0.0
    key: Optional[FileKey] = None

    def __len__(self) -> int:
        return len(self.offsets)

    def reader(self) -> ByteReader:
        """A reader of the file that refuses any version but the one indexed."""
        return ByteReader(self.path, self.key)

    def read_lines(self, reader: ByteReader, records: Sequence[int]) -> list[str]:
        """The lines of `records` as text (not stripped), read with `reader`; DataChangedError
        when the file is not the version indexed (or a record read is no longer a whole line)."""
        spans = np.asarray(self.offsets[np.asarray(records, np.int64)]).reshape(-1, 2)
        starts, ends = spans[:, 0].astype(np.int64), spans[:, 1].astype(np.int64)
        # One byte more on each side: a record still where the index has it lies between
        # line breaks (a rewrite within one mtime tick, or with its mtime restored, shows).
        lo, hi = np.maximum(starts - 1, 0), np.minimum(ends + 1, self.size)
        try:
            blobs = reader.read(np.stack([lo, hi], 1))
        except Exception:
            reader.check()  # a read that failed because the file shrank says so
            raise
        reader.check()  # after the read: a change before or during it shows here
        out = []
        for blob, s, e, first in zip(blobs, starts.tolist(), ends.tolist(), lo.tolist()):
            a, b = s - first, s - first + e - s
            line = blob[a:b]
            if (len(line) != e - s or b'\n' in line
                    or blob[b:] != (b'\n' if e < self.size else b'')
                    or a and blob[:a] != b'\n' and not (s == len(_BOM) and blob[:a] == _BOM[-1:])):
                raise changed_error(self.path, f'bytes {s}-{e} are no longer the line indexed '
                                               f'there')
            try:
                out.append(line.decode('utf-8'))
            except UnicodeDecodeError:
                raise changed_error(self.path, f'bytes {s}-{e} are no longer UTF-8') from None
        return out

    def line_number(self, i: int) -> int:
        """Record i's 1-based line in the file (counts line breaks: meant for messages)."""
        start, seen = int(self.offsets[i][0]), 0
        with self.path.open('rb') as f:
            while start > 0:
                block = f.read(min(CHUNK_BYTES, start))
                seen, start = seen + block.count(b'\n'), start - len(block)
        return seen + 1


def load_or_build(path: PathLike, kind: str = 'text', check: Optional[Check] = None,
                  what: str = 'file') -> LineIndex:
    """The index of `path`, from the cache when the file is unchanged, else built and cached.

    `kind`: 'text' (records are the lines not blank after stripping whitespace), 'csv' (the
    non-empty lines, '\\r' aside) or 'lines' (every line). `check` validates every record when
    the index is built (e.g. CSV columns); `what` the file is, for messages.

    Raises:
      DataError: naming the file (and line): missing, unreadable, not UTF-8, NUL byte, an
        overlong line, what `check` refuses.
    """
    path = store.as_path(path) if store.is_remote(path) else Path(path)
    key = read_checked(path, what, FileKey.of)

    def build():
        offsets, sha, lines = _scan(path, kind, check)
        log.info('%s: indexing %d records', path, len(offsets))
        return offsets, {'sha256': sha, 'lines': lines}

    offsets, meta, build_s = cached(cache_stems(path, f'{kind}-index'),
                                    {'kind': kind, **dataclasses.asdict(key)}, build)
    return LineIndex(path, offsets, meta['sha256'], key.size, meta['lines'], build_s, key)


def cache_stems(path: Path, suffix: str) -> list[Path]:
    """Where a file's derived array may live: beside it, then in the cache folder.

    A $JAXSIM_INDEX_DIR set explicitly is the only place: data folders are then never written
    (shared read-only data, hermetic test sessions).
    """
    name = f'{path.name}.{suffix}'
    if store.is_remote(path):  # read with os.pread: a local copy only
        return [index_dir() / f'{hashlib.sha256(str(path).encode()).hexdigest()[:16]}-{name}']
    tag = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    in_cache = index_dir() / f'{tag}-{name}'
    return [in_cache] if os.environ.get('JAXSIM_INDEX_DIR') else [path.parent / name, in_cache]


def cached(stems: Sequence[Path], key: dict, build: Callable[[], tuple[np.ndarray, dict]]
           ) -> tuple[np.ndarray, dict, float]:
    """An array derived from data files, identified by `key`, built once.

    Looks for STEM.json holding `key` (and STEM.npy of the recorded shape) at each stem in
    turn; otherwise calls build() -> (array, metadata) and saves both at the first writable
    stem (the array first, then the metadata that validates it: every process of a run may
    build at once, and a crash mid-write never leaves a half-written index).
    Returns (array, a DiskArray when cached; metadata; seconds spent building, 0.0 if found).
    """
    key = json.loads(json.dumps({'version': INDEX_VERSION, **key}))  # as it reads back
    for stem in stems:
        found = _load(stem, key)
        if found is not None:
            return (*found, 0.0)
    t0 = time.perf_counter()
    array, extra = build()
    build_s = time.perf_counter() - t0
    meta = {'key': key, 'shape': list(array.shape), 'dtype': array.dtype.str, **extra,
            'build_s': round(build_s, 3)}
    for stem in stems:
        try:
            with store.open_atomic(stem.with_name(stem.name + '.npy'), 'wb') as f:
                np.save(f, array)
            store.write_json(stem.with_name(stem.name + '.json'), meta)
        except (OSError, store.StorageError):
            continue
        found = _load(stem, key)
        if found is not None:
            return (*found, build_s)
    log.warning('%s: could not cache (read-only folders); kept in memory', stems[0])
    return array, meta, build_s


def _load(stem: Path, key: dict) -> Optional[tuple[np.ndarray, dict]]:
    try:
        meta = json.loads(stem.with_name(stem.name + '.json').read_text())
        if meta.get('key') != key:
            return None
        array = DiskArray(stem.with_name(stem.name + '.npy'))
    except (OSError, ValueError):
        return None
    if list(array.shape) != meta.get('shape') or array.dtype.str != meta.get('dtype'):
        return None
    return array, meta


# ---------------------------------------------------------------------------------------------
# The scan.
# ---------------------------------------------------------------------------------------------

def _scan(path: Path, kind: str, check: Optional[Check]) -> tuple[np.ndarray, str, int]:
    """One pass: validated (start, end) offsets of the records, content sha256, line count."""
    h, parts, lines_before, pos, carry = hashlib.sha256(), [], 0, 0, b''
    with path.open('rb') as f:
        while True:
            block = f.read(CHUNK_BYTES)
            h.update(block)
            data, eof = carry + block, not block
            if pos == 0 and data.startswith(_BOM):  # pos 0: `data` starts at the file's start
                data, pos = data[len(_BOM):], len(_BOM)
            cut = len(data) if eof else data.rfind(b'\n') + 1
            if cut == 0 and not eof:  # no line break in the carried bytes: one very long line
                if len(data) > 4 * MAX_LINE_CHARS:
                    raise DataError(f'{path}:{lines_before + 1}: line of more than '
                                    f'{MAX_LINE_CHARS} characters exceeds the limit (missing '
                                    f'line breaks?)')
                carry = data
                continue
            chunk, carry = data[:cut], data[cut:]
            if chunk:
                starts, ends, linenos = _chunk_records(path, chunk, kind, lines_before, pos)
                if check is not None and len(starts):
                    check([chunk[s:e].decode('utf-8') for s, e in zip(starts, ends)], linenos)
                parts.append(np.stack([starts + pos, ends + pos], 1).astype(np.uint64))
                lines_before += chunk.count(b'\n') + (0 if chunk.endswith(b'\n') else 1)
                pos += len(chunk)
            if eof:
                break
    offsets = np.concatenate(parts) if parts else np.zeros((0, 2), np.uint64)
    return offsets, 'sha256:' + h.hexdigest(), lines_before


def _chunk_records(path: Path, chunk: bytes, kind: str, lines_before: int, pos: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validates a chunk of whole lines; (start, end, line number) of its records."""
    nul = chunk.find(b'\x00')
    if nul >= 0:
        line = lines_before + chunk.count(b'\n', 0, nul) + 1
        raise DataError(f'{path}:{line}: NUL byte (a binary file, not text)')
    try:
        chunk.decode('utf-8')
    except UnicodeDecodeError as e:
        line = lines_before + chunk.count(b'\n', 0, e.start) + 1
        raise DataError(f'{path}:{line}: not valid UTF-8 ({e.reason} at byte {pos + e.start})'
                        ) from None
    buf = np.frombuffer(chunk, np.uint8)
    breaks = np.flatnonzero(buf == 10)
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [len(buf)]])
    if ends[-1] == starts[-1]:  # the chunk ends with a line break: no line after it
        starts, ends = starts[:-1], ends[:-1]
    linenos = lines_before + 1 + np.arange(len(starts))
    for i in np.flatnonzero(ends - starts > MAX_LINE_CHARS):  # bytes >= characters
        n = len(chunk[starts[i]:ends[i]].decode('utf-8'))
        if n > MAX_LINE_CHARS:
            raise DataError(f'{path}:{linenos[i]}: line of {n} characters exceeds the '
                            f'{MAX_LINE_CHARS} limit (missing line breaks?)')
    if kind == 'lines':
        keep = np.ones(len(starts), bool)
    elif kind == 'csv':
        length = ends - starts
        cr = np.zeros(len(starts), bool)
        cr[length > 0] = buf[ends[length > 0] - 1] == 13
        keep = length - cr > 0
    else:
        keep = _non_blank(chunk, buf, starts, ends)
    return starts[keep], ends[keep], linenos[keep]


def _non_blank(chunk: bytes, buf: np.ndarray, starts: np.ndarray, ends: np.ndarray
               ) -> np.ndarray:
    """Which lines hold something besides whitespace (str.strip's whitespace)."""
    filled = ends > starts
    first = np.zeros(len(starts), np.uint8)
    first[filled] = buf[starts[filled]]
    # Most lines start with a visible ASCII character; the rest are decoded and stripped.
    keep = filled & ~_ASCII_SPACE[first] & (first < 128)
    for i in np.flatnonzero(filled & ~keep):
        keep[i] = bool(chunk[starts[i]:ends[i]].decode('utf-8').strip())
    return keep
