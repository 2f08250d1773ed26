"""Readers for SentEval-format STS folders (STS12-16, STS-B, SICK-R).

The layout and parsing follow SentEval (facebookresearch/SentEval, `senteval/sts.py` and
`senteval/sick.py`) as used by SimCSE's evaluation:

- STS12-16: `STS/STS1X-en-test/STS.input.<subset>.txt` (two tab-separated sentences a line)
  and `STS.gs.<subset>.txt` (one gold score a line). Pairs whose gold line is empty are
  dropped, as SentEval does.
- STS-B: `STS/STSBenchmark/sts-{train,dev,test}.csv`, 7 tab-separated columns
  `genre file year id score s1 s2`.
- SICK-R: `SICK/SICK_{train,trial,test_annotated}.txt`, a header line then
  `pair_ID sentence_A sentence_B relatedness_score entailment_judgment`.

Sentences are whitespace-normalized (`' '.join(s.split())`): SentEval stores token lists and
SimCSE's batcher joins them with single spaces, so this is the text the encoder sees there.

Every malformed input raises `SentEvalFormatError` naming the file and the 1-based line,
before any model code runs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import pathlib
import sys
from collections.abc import Mapping, Sequence
from typing import Union

import numpy as np

PathLike = Union[str, os.PathLike]

# Canonical task keys (SentEval / SimCSE names), in the paper's column order.
TASK_KEYS = {
    'sts12': 'STS12',
    'sts13': 'STS13',
    'sts14': 'STS14',
    'sts15': 'STS15',
    'sts16': 'STS16',
    'stsb': 'STSBenchmark',
    'sickr': 'SICKRelatedness',
}
ALL_TASKS = tuple(TASK_KEYS)

# Folders looked for under each data root, in order. A root may be the SentEval data dir
# (holding STS/ and SICK/) or the STS/ folder itself.
_TASK_DIRS = {
    **{f'sts1{i}': (f'STS/STS1{i}-en-test', f'STS1{i}-en-test') for i in range(2, 7)},
    'stsb': ('STS/STSBenchmark', 'STSBenchmark'),
    'sickr': ('SICK',),
}
_SICK_FILES = {
    'train': 'SICK_train.txt', 'dev': 'SICK_trial.txt', 'test': 'SICK_test_annotated.txt'}
_STSB_FILES = {'train': 'sts-train.csv', 'dev': 'sts-dev.csv', 'test': 'sts-test.csv'}


class SentEvalFormatError(ValueError):
    """A SentEval file is missing or malformed; the message names file and line."""


@dataclasses.dataclass(frozen=True, eq=False)
class StsPairs:
    """Sentence pairs with gold similarity scores.

    Attributes:
      sent1: N first sentences.
      sent2: N second sentences.
      gold: [N] float64 gold scores.
    """

    sent1: list[str]
    sent2: list[str]
    gold: np.ndarray

    def __post_init__(self):
        if not len(self.sent1) == len(self.sent2) == len(self.gold):
            raise ValueError(
                f'StsPairs: {len(self.sent1)} sent1, {len(self.sent2)} sent2, '
                f'{len(self.gold)} gold scores; they must match')

    def __len__(self) -> int:
        return len(self.gold)


@dataclasses.dataclass(frozen=True, eq=False)
class StsTask:
    """One STS task as evaluated.

    Attributes:
      name: canonical key, e.g. 'STS12', 'STSBenchmark', 'SICKRelatedness'.
      subsets: subset name -> pairs. STS12-16: every `STS.input.<subset>.txt`; STS-B and
        SICK-R: one entry named after the evaluated split ('test' or 'dev').
      files: path relative to the data root -> 'sha256:<hex>' of every file read, so results
        can be compared only when they saw the same data.
      notes: human-readable remarks (e.g. a fallback from SICK test to trial).
      root: the data root the task was read from.
    """

    name: str
    subsets: dict[str, StsPairs]
    files: dict[str, str]
    notes: tuple[str, ...] = ()
    root: str = ''

    @property
    def num_pairs(self) -> int:
        return sum(len(p) for p in self.subsets.values())


def _sha256(data: bytes) -> str:
    return 'sha256:' + hashlib.sha256(data).hexdigest()


def _read_lines(path: pathlib.Path, files: dict[str, str]) -> list[str]:
    """Reads a UTF-8 text file into lines, recording its hash in `files`.

    Splits on '\\n' only (a stray U+2028 inside a sentence is not a line break) and strips a
    trailing '\\r'. Undecodable bytes raise, naming the line.
    """
    if not path.is_file():
        raise SentEvalFormatError(f'{path}: file not found')
    data = path.read_bytes()
    files[str(path)] = _sha256(data)
    try:
        text = data.decode('utf-8')
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b'\n') + 1
        raise SentEvalFormatError(
            f'{path}:{line}: bytes are not valid UTF-8 ({e.reason} at byte {e.start})') from None
    lines = text.split('\n')
    if lines and lines[-1] == '':
        lines.pop()
    return [ln[:-1] if ln.endswith('\r') else ln for ln in lines]


def _sentence(raw: str, path: pathlib.Path, lineno: int, column: str) -> str:
    s = ' '.join(raw.split())
    if not s:
        raise SentEvalFormatError(f'{path}:{lineno}: empty sentence in column {column}')
    return s


def _score(raw: str, path: pathlib.Path, lineno: int) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise SentEvalFormatError(f'{path}:{lineno}: non-numeric score {raw!r}') from None
    if not math.isfinite(v):
        raise SentEvalFormatError(f'{path}:{lineno}: score {raw!r} is not finite')
    return v


def _split_cols(line: str, n: int, path: pathlib.Path, lineno: int, what: str) -> list[str]:
    cols = line.split('\t')
    if len(cols) != n:
        raise SentEvalFormatError(
            f'{path}:{lineno}: expected {n} tab-separated columns ({what}), got {len(cols)}')
    return cols


def read_sts_subset(input_path: PathLike, gs_path: PathLike,
                    files: dict[str, str] | None = None) -> StsPairs:
    """Reads one STS12-16 subset; drops pairs whose gold line is empty (as SentEval does)."""
    files = {} if files is None else files
    input_path, gs_path = pathlib.Path(input_path), pathlib.Path(gs_path)
    inputs = _read_lines(input_path, files)
    golds = _read_lines(gs_path, files)
    if len(inputs) != len(golds):
        raise SentEvalFormatError(
            f'{input_path} has {len(inputs)} lines but {gs_path} has {len(golds)}; '
            'they must pair up line by line')
    s1, s2, gold = [], [], []
    for i, (line, g) in enumerate(zip(inputs, golds), start=1):
        if not g.strip():
            continue  # No gold score for this pair: SentEval drops it.
        a, b = _split_cols(line, 2, input_path, i, 'sentence1, sentence2')
        s1.append(_sentence(a, input_path, i, 'sentence1'))
        s2.append(_sentence(b, input_path, i, 'sentence2'))
        gold.append(_score(g.strip(), gs_path, i))
    if not gold:
        raise SentEvalFormatError(f'{gs_path}: no pair has a gold score')
    return StsPairs(s1, s2, np.asarray(gold, np.float64))


def read_stsb_file(path: PathLike, files: dict[str, str] | None = None) -> StsPairs:
    """Reads an STS-B `sts-*.csv` (SentEval format: 7 tab-separated columns, no header)."""
    files = {} if files is None else files
    path = pathlib.Path(path)
    s1, s2, gold = [], [], []
    for i, line in enumerate(_read_lines(path, files), start=1):
        cols = _split_cols(line.strip('\n'), 7, path, i, 'genre file year id score s1 s2')
        gold.append(_score(cols[4].strip(), path, i))
        s1.append(_sentence(cols[5], path, i, 's1'))
        s2.append(_sentence(cols[6], path, i, 's2'))
    if not gold:
        raise SentEvalFormatError(f'{path}: no sentence pairs')
    return StsPairs(s1, s2, np.asarray(gold, np.float64))


def read_sick_file(path: PathLike, files: dict[str, str] | None = None) -> StsPairs:
    """Reads a SICK file (header line, then 5 tab-separated columns) for relatedness."""
    files = {} if files is None else files
    path = pathlib.Path(path)
    lines = _read_lines(path, files)
    if not lines or not lines[0].startswith('pair_ID'):
        raise SentEvalFormatError(f'{path}:1: expected the SICK header line starting with pair_ID')
    s1, s2, gold = [], [], []
    for i, line in enumerate(lines[1:], start=2):
        cols = _split_cols(line, 5, path, i,
                           'pair_ID sentence_A sentence_B relatedness_score entailment_judgment')
        s1.append(_sentence(cols[1], path, i, 'sentence_A'))
        s2.append(_sentence(cols[2], path, i, 'sentence_B'))
        gold.append(_score(cols[3].strip(), path, i))
    if not gold:
        raise SentEvalFormatError(f'{path}: no sentence pairs')
    return StsPairs(s1, s2, np.asarray(gold, np.float64))


def _as_roots(roots: PathLike | Sequence[PathLike]) -> list[pathlib.Path]:
    if isinstance(roots, (str, os.PathLike)):
        roots = [roots]
    out = [pathlib.Path(r) for r in roots]
    if not out:
        raise ValueError('no data roots given')
    return out


def _canonical(name: str) -> str:
    key = name.lower().replace('-', '')
    aliases = {'stsbenchmark': 'stsb', 'sick': 'sickr', 'sickrelatedness': 'sickr'}
    key = aliases.get(key, key)
    if key not in TASK_KEYS:
        raise ValueError(f'unknown STS task {name!r}; expected one of {", ".join(ALL_TASKS)}')
    return key


def find_task_dir(name: str, roots: PathLike | Sequence[PathLike]) -> pathlib.Path:
    """Returns the folder holding task `name` in the first root that has it."""
    return _find_task(name, roots)[1]


def _find_task(name: str, roots) -> tuple[pathlib.Path, pathlib.Path]:
    """(root, task folder) of the first root holding task `name`."""
    key = _canonical(name)
    roots = _as_roots(roots)
    for root in roots:
        for rel in _TASK_DIRS[key]:
            if (root / rel).is_dir():
                return root, root / rel
    looked = ', '.join(str(r / rel) for r in roots for rel in _TASK_DIRS[key])
    raise SentEvalFormatError(f'{TASK_KEYS[key]}: no task folder found; looked for {looked}')


def has_task(name: str, roots: PathLike | Sequence[PathLike]) -> bool:
    try:
        find_task_dir(name, roots)
    except SentEvalFormatError:
        return False
    return True


def load_stsb(roots: PathLike | Sequence[PathLike], split: str = 'dev') -> StsPairs:
    """Loads one STS-B split ('train', 'dev' or 'test')."""
    if split not in _STSB_FILES:
        raise ValueError(f'STS-B split must be one of {sorted(_STSB_FILES)}, got {split!r}')
    return read_stsb_file(find_task_dir('stsb', roots) / _STSB_FILES[split])


def load_sts_task(name: str, roots: PathLike | Sequence[PathLike], split: str = 'test',
                  verbose: bool = True) -> StsTask:
    """Loads one task of the SimCSE STS protocol.

    Args:
      name: one of sts12..sts16, stsb, sickr (case-insensitive; 'STSBenchmark' etc. accepted).
      roots: one data root or several; the task is read from the first root holding it.
      split: 'test' (the protocol) or 'dev' (STS-B dev / SICK trial, for model selection).
        STS12-16 only have test data.
      verbose: print notes (such as the SICK trial fallback) to stderr.

    Returns:
      The task with its subsets, file hashes and notes.
    """
    key = _canonical(name)
    root, task_dir = _find_task(key, roots)
    files: dict[str, str] = {}
    notes: list[str] = []
    if key.startswith('sts1'):
        if split != 'test':
            raise ValueError(f'{TASK_KEYS[key]} has only a test split, got split={split!r}')
        inputs = sorted(task_dir.glob('STS.input.*.txt'))
        if not inputs:
            raise SentEvalFormatError(
                f'{TASK_KEYS[key]}: no STS.input.<subset>.txt files in {task_dir}')
        subsets = {}
        for p in inputs:
            sub = p.name[len('STS.input.'):-len('.txt')]
            subsets[sub] = read_sts_subset(p, task_dir / f'STS.gs.{sub}.txt', files)
    elif key == 'stsb':
        if split not in _STSB_FILES:
            raise ValueError(f'STS-B split must be one of {sorted(_STSB_FILES)}, got {split!r}')
        subsets = {split: read_stsb_file(task_dir / _STSB_FILES[split], files)}
    else:
        if split not in _SICK_FILES:
            raise ValueError(f'SICK split must be one of {sorted(_SICK_FILES)}, got {split!r}')
        path = task_dir / _SICK_FILES[split]
        if split == 'test' and not path.is_file():
            trial = task_dir / _SICK_FILES['dev']
            if not trial.is_file():
                raise SentEvalFormatError(
                    f'SICKRelatedness: neither {path} nor {trial} exists')
            notes.append(f'SICKRelatedness: {path.name} not found in {task_dir}; '
                         f'scoring {trial.name} instead (not comparable to published SICK-R)')
            path = trial
        # Name the subset after the file actually read ('test', 'trial' or 'train').
        sub = path.name[len('SICK_'):-len('.txt')].replace('_annotated', '')
        subsets = {sub: read_sick_file(path, files)}
    if verbose:
        for n in notes:
            print(f'note: {n}', file=sys.stderr)
    # Keys relative to the data root, so results from different machines compare by hash.
    files = {pathlib.Path(f).relative_to(root).as_posix(): h for f, h in files.items()}
    return StsTask(TASK_KEYS[key], subsets, files, tuple(notes), str(root))


def load_sentences(path: PathLike) -> list[str]:
    """Reads a corpus file (one sentence a line, blank lines skipped) for calibration fitting."""
    path = pathlib.Path(path)
    out = [' '.join(ln.split()) for ln in _read_lines(path, {})]
    out = [s for s in out if s]
    if not out:
        raise SentEvalFormatError(f'{path}: no sentences (all lines blank)')
    return out


def file_hash(path: PathLike) -> str:
    return _sha256(pathlib.Path(path).read_bytes())


def task_files(tasks: Sequence[StsTask]) -> Mapping[str, str]:
    """Merged path -> hash over several tasks."""
    out: dict[str, str] = {}
    for t in tasks:
        out.update(t.files)
    return out
