"""Readers for SentEval-format STS data (STS12-16, STS-B, SICK-R), resolved over data roots.

The layout and parsing follow SentEval (facebookresearch/SentEval, `senteval/sts.py` and
`senteval/sick.py`) as used by SimCSE's evaluation:

- STS12-16: `STS/STS1X-en-test/STS.input.<subset>.txt` (two tab-separated sentences a line)
  and `STS.gs.<subset>.txt` (one gold score a line), for SentEval's fixed list of subsets per
  year (`STS_SUBSETS`; e.g. STS13 is FNWN, headlines, OnWN: no SMT). Other input files in the
  folder are reported in the task's notes and not scored. Pairs whose gold line is empty are
  dropped, as SentEval does.
- STS-B: `STS/STSBenchmark/sts-{train,dev,test}.csv`, 7 tab-separated columns
  `genre file year id score s1 s2`.
- SICK-R: `SICK/SICK_{train,trial,test_annotated}.txt`, a header line then
  `pair_ID sentence_A sentence_B relatedness_score entailment_judgment`.

Several data roots may be given; each FILE is looked up in the roots in order, so one root can
hold SICK train/trial and another SICK_test_annotated.txt. SICK-R's test split falls back to
the trial file (with a note) only when no root holds the test file.

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
from collections.abc import Mapping, Sequence
from typing import Optional, Union

import numpy as np

from jaxsim.data.readers import DataError, decode_text, read_bytes, read_sentences, text_lines
from jaxsim.storage.paths import SENTEVAL_ROOT

PathLike = Union[str, os.PathLike]

# Canonical task keys (SentEval / SimCSE names), in the paper's column order.
TASK_KEYS = {**{f'sts1{i}': f'STS1{i}' for i in range(2, 7)},
             'stsb': 'STSBenchmark', 'sickr': 'SICKRelatedness'}
ALL_TASKS = tuple(TASK_KEYS)

# The subsets SentEval scores per year (senteval/sts.py, STS12Eval ... STS16Eval).
STS_SUBSETS = {
    'sts12': ('MSRpar', 'MSRvid', 'SMTeuroparl', 'surprise.OnWN', 'surprise.SMTnews'),
    'sts13': ('FNWN', 'headlines', 'OnWN'),
    'sts14': ('deft-forum', 'deft-news', 'headlines', 'images', 'OnWN', 'tweet-news'),
    'sts15': ('answers-forums', 'answers-students', 'belief', 'headlines', 'images'),
    'sts16': ('answer-answer', 'headlines', 'plagiarism', 'postediting', 'question-question'),
}

# Folders looked for under each data root, in order. A root may be the SentEval data dir
# (holding STS/ and SICK/) or the STS/ folder itself.
_TASK_DIRS = {
    **{f'sts1{i}': (f'STS/STS1{i}-en-test', f'STS1{i}-en-test') for i in range(2, 7)},
    'stsb': ('STS/STSBenchmark', 'STSBenchmark'),
    'sickr': ('SICK',),
}
# Split -> file. SICK's dev split is its trial file.
SPLIT_FILES = {
    'stsb': {'train': 'sts-train.csv', 'dev': 'sts-dev.csv', 'test': 'sts-test.csv'},
    'sickr': {'train': 'SICK_train.txt', 'dev': 'SICK_trial.txt',
              'test': 'SICK_test_annotated.txt'},
}


class SentEvalFormatError(DataError):
    """A SentEval file is missing or malformed; the message names file and line."""


@dataclasses.dataclass(frozen=True, eq=False)
class StsPairs:
    """N sentence pairs (`sent1`, `sent2`) with [N] float64 `gold` similarity scores."""

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
    """One STS task (one split of it) as read.

    Attributes:
      name: canonical key, e.g. 'STS12', 'STSBenchmark', 'SICKRelatedness'.
      subsets: subset name -> pairs. STS12-16: SentEval's subsets found; STS-B and SICK-R: one
        entry named after the file read ('test', 'dev', 'train'; SICK: 'trial' for dev).
      files: path relative to its data root -> 'sha256:<hex>' of every file read, so results
        can be compared only when they saw the same data.
      sources: the same paths -> the data root each was read from.
      notes: human-readable remarks (a fallback from SICK test to trial, a subset not scored).
      split: the split asked for ('test', 'dev' or 'train').
    """

    name: str
    subsets: dict[str, StsPairs]
    files: dict[str, str]
    sources: dict[str, str]
    notes: tuple[str, ...] = ()
    split: str = 'test'

    @property
    def num_pairs(self) -> int:
        return sum(len(p) for p in self.subsets.values())

    @property
    def roots(self) -> tuple[str, ...]:
        """The data roots the task's files came from, in first-use order."""
        return tuple(dict.fromkeys(self.sources.values()))

    def sentences(self) -> list[str]:
        """Both sentences of every pair, duplicates kept (a fit set's unit)."""
        return [s for p in self.subsets.values() for s in p.sent1 + p.sent2]


def _sha256(data: bytes) -> str:
    return 'sha256:' + hashlib.sha256(data).hexdigest()


class _Reader:
    """Reads files of one task, recording each one's hash and data root."""

    def __init__(self):
        self.files: dict[str, str] = {}
        self.sources: dict[str, str] = {}

    def lines(self, root: pathlib.Path, path: pathlib.Path) -> list[str]:
        """A UTF-8 text file's lines (split at '\\n' only, '\\r' dropped): the checks of
        `jaxsim.data.readers.read_text`, errors naming file and line."""
        try:
            data = read_bytes(path, 'SentEval file')
            text = decode_text(data, path)
        except DataError as e:
            raise SentEvalFormatError(str(e)) from None
        rel = path.relative_to(root).as_posix()
        self.files[rel] = _sha256(data)
        self.sources[rel] = str(root)
        return text_lines(text)


def _sentence(raw: str, path: pathlib.Path, lineno: int, column: str) -> str:
    s = ' '.join(raw.split())
    if not s:
        raise SentEvalFormatError(f'{path}:{lineno}: empty sentence in column {column}')
    return s


def _score(raw: str, path: pathlib.Path, lineno: int) -> float:
    try:
        v = float(raw)
    except ValueError:
        raise SentEvalFormatError(f'{path}:{lineno}: non-numeric score {raw[:40]!r}') from None
    if not math.isfinite(v):
        raise SentEvalFormatError(f'{path}:{lineno}: score {raw!r} is not finite')
    return v


def _split_cols(line: str, n: int, path: pathlib.Path, lineno: int, what: str) -> list[str]:
    cols = line.split('\t')
    if len(cols) != n:
        raise SentEvalFormatError(
            f'{path}:{lineno}: expected {n} tab-separated columns ({what}), got {len(cols)}')
    return cols


def _sts_subset(reader: _Reader, root: pathlib.Path, input_path: pathlib.Path) -> StsPairs:
    """One STS12-16 subset; drops pairs whose gold line is empty (as SentEval does)."""
    gs_path = input_path.with_name(input_path.name.replace('STS.input.', 'STS.gs.', 1))
    inputs = reader.lines(root, input_path)
    golds = reader.lines(root, gs_path)
    if len(inputs) != len(golds):
        short, n = (gs_path, len(golds)) if len(golds) < len(inputs) else (input_path,
                                                                         len(inputs))
        raise SentEvalFormatError(
            f'{short}:{n + 1}: line missing; {input_path.name} has {len(inputs)} lines and '
            f'{gs_path.name} {len(golds)}, they must pair up line by line')
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


def _stsb_file(reader: _Reader, root: pathlib.Path, path: pathlib.Path) -> StsPairs:
    """An STS-B `sts-*.csv` (SentEval format: 7 tab-separated columns, no header)."""
    s1, s2, gold = [], [], []
    for i, line in enumerate(reader.lines(root, path), start=1):
        cols = _split_cols(line, 7, path, i, 'genre file year id score s1 s2')
        gold.append(_score(cols[4].strip(), path, i))
        s1.append(_sentence(cols[5], path, i, 's1'))
        s2.append(_sentence(cols[6], path, i, 's2'))
    if not gold:
        raise SentEvalFormatError(f'{path}: no sentence pairs')
    return StsPairs(s1, s2, np.asarray(gold, np.float64))


def _sick_file(reader: _Reader, root: pathlib.Path, path: pathlib.Path) -> StsPairs:
    """A SICK file (header line, then 5 tab-separated columns), for relatedness."""
    lines = reader.lines(root, path)
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


def as_roots(roots: PathLike | Sequence[PathLike] | None,
             error: type[Exception] = SentEvalFormatError) -> list[pathlib.Path]:
    """The data roots as paths; None is the default root (`$JAXSIM_SENTEVAL` or
    ../shared/data/senteval). An empty list raises `error`."""
    if roots is None:
        roots = SENTEVAL_ROOT
    if isinstance(roots, (str, os.PathLike)):
        roots = [roots]
    out = [pathlib.Path(r) for r in roots]
    if not out:
        raise error('no data roots given')
    return out


def canonical(name: str) -> str:
    """'STS-B', 'STSBenchmark', 'sick' ... -> the task key ('stsb', 'sickr', ...)."""
    key = name.strip().lower().replace('-', '')
    aliases = {'stsbenchmark': 'stsb', 'sick': 'sickr', 'sickrelatedness': 'sickr'}
    key = aliases.get(key, key)
    if key not in TASK_KEYS:
        raise SentEvalFormatError(
            f'unknown STS task {name!r}; expected one of {", ".join(ALL_TASKS)}')
    return key


def find_file(key: str, filename: str, roots: Sequence[pathlib.Path]
              ) -> Optional[tuple[pathlib.Path, pathlib.Path]]:
    """(root, path) of the first root holding the task's file `filename`, else None."""
    for root in roots:
        for rel in _TASK_DIRS[key]:
            path = root / rel / filename
            if path.is_file():
                return root, path
    return None


def _looked(key: str, roots: Sequence[pathlib.Path], filename: str = '') -> str:
    return ', '.join(str(r / rel / filename) for r in roots for rel in _TASK_DIRS[key])


def has_split(name: str, split: str, roots: PathLike | Sequence[PathLike]) -> bool:
    """Whether some root holds the split's own file(s) (no fallback)."""
    key, roots = canonical(name), as_roots(roots)
    if key in STS_SUBSETS:
        return split == 'test' and any(
            find_file(key, f'STS.input.{s}.txt', roots) for s in STS_SUBSETS[key])
    return split in SPLIT_FILES[key] and find_file(key, SPLIT_FILES[key][split], roots) is not None


def has_task(name: str, roots: PathLike | Sequence[PathLike], split: str = 'test') -> bool:
    """Whether `load_sts_task(name, roots, split)` finds data (SICK test: trial counts)."""
    return has_split(name, split, roots) or (
        canonical(name) == 'sickr' and split == 'test' and has_split(name, 'dev', roots))


def _load_sts_year(key: str, roots: list[pathlib.Path], reader: _Reader
                   ) -> tuple[dict[str, StsPairs], list[str]]:
    task, listed = TASK_KEYS[key], STS_SUBSETS[key]
    subsets, missing, notes = {}, [], []
    for sub in listed:
        found = find_file(key, f'STS.input.{sub}.txt', roots)
        if found is None:
            missing.append(sub)
        else:
            subsets[sub] = _sts_subset(reader, *found)
    extra = sorted({p.name for r in roots for rel in _TASK_DIRS[key]
                    for p in (r / rel).glob('STS.input.*.txt')
                    if p.name[len('STS.input.'):-len('.txt')] not in listed})
    if extra:
        notes.append(f'{task}: {", ".join(extra)} not scored: SentEval scores only '
                     f'{", ".join(listed)}')
    if not subsets:
        dirs = [r / rel for r in roots for rel in _TASK_DIRS[key] if (r / rel).is_dir()]
        if not dirs:
            raise SentEvalFormatError(
                f'{task}: no task folder found; looked for {_looked(key, roots)}')
        raise SentEvalFormatError(
            f'{task}: none of SentEval\'s subsets ({", ".join(listed)}) found in '
            f'{", ".join(map(str, dirs))}')
    if missing:
        notes.append(f'{task}: subsets {", ".join(missing)} not found under the data roots; '
                     f'scored on {len(subsets)} of {len(listed)} (not comparable to published '
                     f'{task})')
    return subsets, notes


def load_sts_task(name: str, roots: PathLike | Sequence[PathLike], split: str = 'test',
                  fallback: bool = True) -> StsTask:
    """Loads one split of one task of the SimCSE STS protocol (`canonical` names it).

    `split`: 'test' (the protocol), 'dev' (STS-B dev / SICK trial, for model selection) or
    'train'; STS12-16 have only test data. `fallback`: score SICK trial (with a note) when no
    root holds SICK's test file. Notes are returned, never printed here.
    """
    key, roots = canonical(name), as_roots(roots)
    task = TASK_KEYS[key]
    reader = _Reader()
    notes: list[str] = []
    if key in STS_SUBSETS:
        if split != 'test':
            raise SentEvalFormatError(f'{task} has only a test split, got split={split!r}')
        subsets, notes = _load_sts_year(key, roots, reader)
    else:
        files = SPLIT_FILES[key]
        if split not in files:
            raise SentEvalFormatError(f'{task} split must be one of {sorted(files)}, '
                                      f'got {split!r}')
        found = find_file(key, files[split], roots)
        if found is None and key == 'sickr' and split == 'test' and fallback:
            found = find_file(key, files['dev'], roots)
            if found is not None:
                notes.append(f'{task}: {files["test"]} not found under the data roots; '
                             f'scoring {found[1]} instead (not comparable to published SICK-R)')
        if found is None:
            raise SentEvalFormatError(
                f'{task}: {files[split]} not found; looked for {_looked(key, roots, files[split])}')
        path = found[1]
        if key == 'stsb':
            subsets = {split: _stsb_file(reader, *found)}
        else:
            # Named after the file read: 'test', 'trial' or 'train'.
            sub = path.name[len('SICK_'):-len('.txt')].replace('_annotated', '')
            subsets = {sub: _sick_file(reader, *found)}
    return StsTask(task, subsets, reader.files, reader.sources, tuple(notes), split)


def load_stsb(roots: PathLike | Sequence[PathLike], split: str = 'dev') -> StsPairs:
    """Loads one STS-B split ('train', 'dev' or 'test')."""
    return load_sts_task('stsb', roots, split).subsets[split]


def load_sentences(path: PathLike) -> list[str]:
    """A sentence file (`jaxsim.data.readers.read_sentences`), whitespace-normalized like the
    STS sentences, for calibration fitting."""
    return [' '.join(s.split()) for s in read_sentences(path)]


def file_hash(path: PathLike) -> str:
    return _sha256(read_bytes(path))


def task_files(tasks: Sequence[StsTask]) -> Mapping[str, str]:
    """Merged path -> hash over several tasks."""
    return {path: digest for t in tasks for path, digest in t.files.items()}
