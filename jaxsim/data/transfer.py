"""Readers for the SentEval transfer tasks: MR, CR, SUBJ, MPQA, SST2, TREC, MRPC.

The layout and parsing follow SentEval (facebookresearch/SentEval: `senteval/binary.py`,
`sst.py`, `trec.py`, `mrpc.py`), because the classifier protocol's fold assignment depends on
the exact samples and their order:

- MR, CR, SUBJ, MPQA: two files of one sentence a line, read as Latin-1 and split with
  `str.splitlines()`. Blank lines stay samples (CR and MPQA have a few; SentEval encodes them
  as empty sentences and counts them). The first file gets label 1, the second label 0:
  MR `rt-polarity.pos`/`.neg`, CR `custrev.pos`/`.neg`, MPQA `mpqa.pos`/`.neg`,
  SUBJ `subj.objective`/`subj.subjective` (objective = 1, as SentEval passes it first).
- SST2: `SST/binary/sentiment-{train,dev,test}`, UTF-8, `sentence<TAB>label` with label 0/1.
- TREC: `TREC/train_5500.label` and `TREC_10.label`, Latin-1, `COARSE:fine question words`;
  the six coarse classes ABBR DESC ENTY HUM LOC NUM are labels 0..5.
- MRPC: `MRPC/msr_paraphrase_{train,test}.txt`, UTF-8, a header line, then
  `Quality<TAB>#1 ID<TAB>#2 ID<TAB>#1 String<TAB>#2 String`.

Sentences are whitespace-normalized (`' '.join(line.split())`): SentEval keeps token lists and
SimCSE's batcher joins them with single spaces, so this is the text the encoder sees there.

A data root is a SentEval data folder holding the task folders (`MR/`, `SST/binary/`, ...)
or SimCSE's `data/` folder holding them under `downstream/`. A missing or malformed file raises
`TransferDataError` naming the file and 1-based line, before any model code runs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
from collections.abc import Sequence
from typing import Callable, Optional, Union

import numpy as np

from jaxsim.data.senteval import as_roots
from jaxsim.errors import JaxsimError

PathLike = Union[str, os.PathLike]

TREC_CLASSES = ('ABBR', 'DESC', 'ENTY', 'HUM', 'LOC', 'NUM')


class TransferDataError(JaxsimError):
    """A transfer-task file is missing or malformed; the message names file and line."""


@dataclasses.dataclass(frozen=True, eq=False)
class LabeledText:
    """N sentences `sent1` (with their pairs' `sent2` for MRPC, else None) and [N] int64
    class `labels`, in file order."""

    sent1: list[str]
    sent2: Optional[list[str]]
    labels: np.ndarray

    def __post_init__(self):
        n = len(self.sent1)
        if (self.sent2 is not None and len(self.sent2) != n) or len(self.labels) != n:
            raise ValueError(f'LabeledText: {n} sent1, '
                             f'{None if self.sent2 is None else len(self.sent2)} sent2, '
                             f'{len(self.labels)} labels; they must match')

    def __len__(self) -> int:
        return len(self.labels)


@dataclasses.dataclass(frozen=True, eq=False)
class TransferData:
    """One transfer task's data as read from disk.

    Attributes:
      name: canonical task name ('MR', 'SST2', ...).
      splits: 'all' for the cross-validated tasks (MR, CR, SUBJ, MPQA); 'train', 'dev', 'test'
        for SST2; 'train', 'test' for TREC and MRPC.
      num_classes: number of classes.
      files: path relative to the data root -> 'sha256:<hex>' of every file read.
      root: the data root the task was read from.
    """

    name: str
    splits: dict[str, LabeledText]
    num_classes: int
    files: dict[str, str]
    root: str


# ---------------------------------------------------------------------------------------
# File-level readers. Each records the file's hash in `files` (path -> hash).
# ---------------------------------------------------------------------------------------


def _read_bytes(path: pathlib.Path, files: Optional[dict[str, str]]) -> bytes:
    if not path.is_file():
        raise TransferDataError(f'{path}: file not found')
    data = path.read_bytes()
    if files is not None:
        files[str(path)] = 'sha256:' + hashlib.sha256(data).hexdigest()
    return data


def _text_lines(path: pathlib.Path, files: Optional[dict[str, str]], encoding: str) -> list[str]:
    """Lines as Python's text-mode `for line in f` yields them (universal newlines), stripped
    of their line break; undecodable bytes raise naming the line."""
    data = _read_bytes(path, files)
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b'\n') + 1
        raise TransferDataError(
            f'{path}:{line}: bytes are not valid {encoding} ({e.reason} at byte {e.start})'
        ) from None
    lines = text.replace('\r\n', '\n').replace('\r', '\n').split('\n')
    if lines[-1] == '':
        lines.pop()
    return lines


def _sentence(raw: str) -> str:
    return ' '.join(raw.split())


def _int_label(raw: str, allowed: range, path: pathlib.Path, lineno: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise TransferDataError(f'{path}:{lineno}: label {raw!r} is not an integer') from None
    if value not in allowed:
        raise TransferDataError(f'{path}:{lineno}: label {value} is not one of '
                                f'{", ".join(map(str, allowed))}')
    return value


def read_sentence_file(path: PathLike, files: dict[str, str] | None = None) -> list[str]:
    """One sentence a line (MR/CR/SUBJ/MPQA): Latin-1, `str.splitlines()`, blank lines kept."""
    path = pathlib.Path(path)
    # Latin-1 decodes any byte, as SentEval's binary.py reads these files.
    lines = _read_bytes(path, files).decode('latin-1').splitlines()
    if not any(line.strip() for line in lines):
        raise TransferDataError(f'{path}: no sentences')
    return [_sentence(line) for line in lines]


def read_binary_pair(first: PathLike, second: PathLike,
                     files: dict[str, str] | None = None) -> LabeledText:
    """Two sentence files; `first` gets label 1 and `second` label 0, first file first."""
    a = read_sentence_file(first, files)
    b = read_sentence_file(second, files)
    return LabeledText(a + b, None, np.asarray([1] * len(a) + [0] * len(b), np.int64))


def read_sst_file(path: PathLike, files: dict[str, str] | None = None) -> LabeledText:
    """SST binary: `sentence<TAB>label` a line, label 0 or 1."""
    path = pathlib.Path(path)
    sents, labels = [], []
    for i, line in enumerate(_text_lines(path, files, 'utf-8'), start=1):
        cols = line.strip().split('\t')
        if len(cols) != 2:
            raise TransferDataError(
                f'{path}:{i}: expected 2 tab-separated columns (sentence, label), got {len(cols)}')
        labels.append(_int_label(cols[1].strip(), range(2), path, i))
        sents.append(_sentence(cols[0]))
    if not labels:
        raise TransferDataError(f'{path}: no samples')
    return LabeledText(sents, None, np.asarray(labels, np.int64))


def read_trec_file(path: PathLike, files: dict[str, str] | None = None) -> LabeledText:
    """TREC: `COARSE:fine question words` a line (Latin-1); the coarse class is the label."""
    path = pathlib.Path(path)
    sents, labels = [], []
    for i, line in enumerate(_text_lines(path, files, 'latin-1'), start=1):
        target, sep, rest = line.strip().partition(':')
        if not sep:
            raise TransferDataError(f'{path}:{i}: expected COARSE:fine question, no ":" found')
        if target not in TREC_CLASSES:
            raise TransferDataError(f'{path}:{i}: unknown TREC class {target!r}; expected one '
                                    f'of {", ".join(TREC_CLASSES)}')
        fine, space, question = rest.partition(' ')
        if not space:
            raise TransferDataError(f'{path}:{i}: expected a space after the fine label '
                                    f'{target}:{fine}')
        labels.append(TREC_CLASSES.index(target))
        sents.append(_sentence(question))
    if not labels:
        raise TransferDataError(f'{path}: no samples')
    return LabeledText(sents, None, np.asarray(labels, np.int64))


def read_mrpc_file(path: PathLike, files: dict[str, str] | None = None) -> LabeledText:
    """MRPC: a header line, then `Quality<TAB>#1 ID<TAB>#2 ID<TAB>#1 String<TAB>#2 String`."""
    path = pathlib.Path(path)
    lines = _text_lines(path, files, 'utf-8')
    if not lines:
        raise TransferDataError(f'{path}: empty file (expected a header line and samples)')
    s1, s2, labels = [], [], []
    for i, line in enumerate(lines[1:], start=2):
        cols = line.strip().split('\t')
        if len(cols) != 5:
            raise TransferDataError(
                f'{path}:{i}: expected 5 tab-separated columns '
                f'(Quality, #1 ID, #2 ID, #1 String, #2 String), got {len(cols)}')
        labels.append(_int_label(cols[0].strip(), range(2), path, i))
        s1.append(_sentence(cols[3]))
        s2.append(_sentence(cols[4]))
    if not labels:
        raise TransferDataError(f'{path}: no samples after the header line')
    return LabeledText(s1, s2, np.asarray(labels, np.int64))


# ---------------------------------------------------------------------------------------
# Tasks.
# ---------------------------------------------------------------------------------------


def _binary(first: str, second: str) -> Callable[[pathlib.Path, dict], dict[str, LabeledText]]:
    return lambda d, files: {'all': read_binary_pair(d / first, d / second, files)}


def _sst(d: pathlib.Path, files: dict) -> dict[str, LabeledText]:
    return {s: read_sst_file(d / f'sentiment-{s}', files) for s in ('train', 'dev', 'test')}


def _trec(d: pathlib.Path, files: dict) -> dict[str, LabeledText]:
    return {'train': read_trec_file(d / 'train_5500.label', files),
            'test': read_trec_file(d / 'TREC_10.label', files)}


def _mrpc(d: pathlib.Path, files: dict) -> dict[str, LabeledText]:
    return {s: read_mrpc_file(d / f'msr_paraphrase_{s}.txt', files) for s in ('train', 'test')}


@dataclasses.dataclass(frozen=True)
class _TaskFiles:
    folder: str                     # relative to a data root (or to its downstream/)
    num_classes: int
    read: Callable[[pathlib.Path, dict], dict[str, LabeledText]]


_TASKS = {
    'MR': _TaskFiles('MR', 2, _binary('rt-polarity.pos', 'rt-polarity.neg')),
    'CR': _TaskFiles('CR', 2, _binary('custrev.pos', 'custrev.neg')),
    'SUBJ': _TaskFiles('SUBJ', 2, _binary('subj.objective', 'subj.subjective')),
    'MPQA': _TaskFiles('MPQA', 2, _binary('mpqa.pos', 'mpqa.neg')),
    'SST2': _TaskFiles('SST/binary', 2, _sst),
    'TREC': _TaskFiles('TREC', len(TREC_CLASSES), _trec),
    'MRPC': _TaskFiles('MRPC', 2, _mrpc),
}
TASK_NAMES = tuple(_TASKS)


def canonical_name(name: str) -> str:
    """'mr' -> 'MR', 'sst' / 'sst-2' -> 'SST2'; unknown names raise listing the known ones."""
    key = name.upper().replace('-', '').replace('_', '')
    key = {'SST': 'SST2'}.get(key, key)
    if key not in _TASKS:
        raise TransferDataError(f'unknown transfer task {name!r}; choose one of '
                                f'{", ".join(TASK_NAMES)}')
    return key


def find_task_dir(name: str, roots: PathLike | Sequence[PathLike]
                  ) -> tuple[pathlib.Path, pathlib.Path]:
    """(root, task folder) of the first root holding task `name` (directly or in downstream/)."""
    spec = _TASKS[canonical_name(name)]
    candidates = [(root, root / sub / spec.folder)
                  for root in as_roots(roots, TransferDataError) for sub in ('.', 'downstream')]
    for root, folder in candidates:
        if folder.is_dir():
            return root, folder
    looked = ', '.join(str(f) for _, f in candidates)
    raise TransferDataError(f'{canonical_name(name)}: no task folder found; looked for {looked}')


def has_task(name: str, roots: PathLike | Sequence[PathLike]) -> bool:
    try:
        find_task_dir(name, roots)
    except TransferDataError:
        return False
    return True


def load_transfer_task(name: str, roots: PathLike | Sequence[PathLike]) -> TransferData:
    """Reads one transfer task (`canonical_name`) from the first data root holding its folder:
    its splits in file order, with the hashes of the files read."""
    key = canonical_name(name)
    spec = _TASKS[key]
    root, folder = find_task_dir(key, roots)
    files: dict[str, str] = {}
    splits = spec.read(folder, files)
    files = {os.path.relpath(f, root).replace(os.sep, '/'): h for f, h in files.items()}
    return TransferData(key, splits, spec.num_classes, files, str(root))
