"""The STS protocol: which tasks, which pairs are scored, and which sentences a calibration
is fitted on.

Scoring follows SimCSE's `evaluation.py` over SentEval: STS12-16 on SentEval's subsets (each
task scored on their concatenation, 'all'), STS-B and SICK-R on their test split, cosine
similarity, Spearman x100 (`jaxsim.eval.metrics`).

Label-free calibrations are fitted on unlabeled sentences; the fit set changes the numbers by
several points, so it is always named and recorded. `--fit-on` chooses it (the table is in
docs/evaluation.md): 'target' (the default), 'task', 'paper' (each task's fit set as the papers
fit it: `PAPER_RULES`) or a sentence file. Under 'paper', STS12-16 have one file, `full.txt`,
which BERT-flow uses as all three splits, so their pairs count three times; a split missing
under every data root is left out with a note (the shipped SICK has train and trial only).
Both sentences of every pair enter a fit set, duplicates kept, as in both papers.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Optional, Union

import numpy as np

from jaxsim import calibrate
from jaxsim.data import senteval
from jaxsim.data.senteval import StsTask
from jaxsim.eval import metrics
from jaxsim.eval.metrics import TaskScore

FIT_MODES = ('target', 'task', 'paper')
PAPER_RULES = {
    'flow': "BERT-flow run_siamese.py ('target', use_full_for_training=1): each task's "
            'train+dev+test; STS12-16 use their full set as all three splits (3 copies)',
    'other': "BERT-whitening eng/eval.py: each task's own pairs; STS-B and SICK-R train+dev+test",
}
# Positive pairs for alignment: STS-B pairs with gold > 4 (SimCSE, Sec. 3 / Fig. 2).
ALIGN_GOLD_THRESHOLD = 4.0
ORDER = list(senteval.TASK_KEYS.values())


class ProtocolError(senteval.SentEvalFormatError):
    """A task list or fit set that cannot be evaluated as asked."""


def load_tasks(tasks: Union[str, Sequence[Union[str, StsTask]]], roots, split: str = 'test'
               ) -> list[StsTask]:
    """Loads task names (a list or a comma-separated string); StsTask items pass through.

    Returns:
      The tasks in the paper's column order, whatever the order asked.
    """
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(',') if t.strip()]
    if not tasks:
        raise ProtocolError('no tasks given')
    out = [t if isinstance(t, StsTask) else senteval.load_sts_task(t, roots, split=split)
           for t in tasks]
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ProtocolError(f'a task is listed twice: {names}')
    return sorted(out, key=lambda t: ORDER.index(t.name) if t.name in ORDER else len(ORDER))


def default_tasks(roots, split: str = 'test') -> tuple[list[str], list[str]]:
    """(task keys found under `roots`, notes): the 7 tasks for 'test'; STS-B for 'dev'."""
    if split == 'dev':
        return ['stsb'], []
    found = [t for t in senteval.ALL_TASKS if senteval.has_task(t, roots)]
    if not found:
        raise ProtocolError(
            f'no STS task under {", ".join(map(str, roots))} (expected STS/STS1X-en-test, '
            'STS/STSBenchmark or SICK)')
    missing = [senteval.TASK_KEYS[t] for t in senteval.ALL_TASKS if t not in found]
    notes = [f'not found under the data roots, skipped: {", ".join(missing)}'] if missing else []
    return found, notes


def score_task(task: StsTask, vectors: Callable[[list[str]], np.ndarray]) -> TaskScore:
    """Scores one task given a sentence -> vector lookup ([N] sentences -> [N, D])."""
    return metrics.task_score(task.name, {
        name: (metrics.cosine_rows(vectors(p.sent1), vectors(p.sent2)), p.gold)
        for name, p in task.subsets.items()})


def stsb_positive_pairs(task: StsTask) -> tuple[list[str], list[str]]:
    """STS-B pairs with gold > 4: SimCSE's positives for the alignment metric."""
    s1, s2 = [], []
    for p in task.subsets.values():
        keep = np.flatnonzero(p.gold > ALIGN_GOLD_THRESHOLD)
        s1.extend(p.sent1[i] for i in keep)
        s2.extend(p.sent2[i] for i in keep)
    return s1, s2


# ---------------------------------------------------------------------------------------
# Fit sets.
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FitPart:
    """One source of a fit set: a task's split (or a sentence file) and what it contributed.

    Attributes:
      source: the task ('STSBenchmark', ...) or the sentence file's path.
      split: 'train' | 'dev' | 'test' for a task (SICK's 'dev' is its trial file), 'file'.
      sentences: sentence slots contributed (both sides of each pair, times `repeats`).
      repeats: how many copies of the split the rule takes.
    """

    source: str
    split: str
    sentences: int
    repeats: int = 1


@dataclasses.dataclass(frozen=True, eq=False)
class FitSet:
    """The sentences one calibration is fitted on, and where they came from.

    Attributes:
      fit_on: 'target', 'task', 'paper' or the sentence file.
      parts: the sources, in order.
      sentences: the fit sentences, duplicates and repeats kept.
      notes: remarks (a split the rule needs that is missing).
      missing: the files of splits the rule needs that no data root holds.
      files: path -> hash of files read beyond the evaluated tasks (other splits, the file).
      sources: the same paths -> their data root.
    """

    fit_on: str
    parts: tuple[FitPart, ...]
    sentences: list[str]
    notes: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    files: dict[str, str] = dataclasses.field(default_factory=dict)
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The JSON description: parts, the total sentence count, the missing splits' files."""
        return {'parts': [dataclasses.asdict(p) for p in self.parts],
                'sentences': len(self.sentences), 'missing': list(self.missing)}


def paper_family(post: str) -> str:
    """Which paper's rule fits `post` under --fit-on paper: 'flow' or 'other'."""
    return 'flow' if calibrate.parse_spec(post)[0] == 'flow' else 'other'


def _task_set(fit_on: str, tasks: Sequence[StsTask]) -> FitSet:
    parts, sentences = [], []
    for t in tasks:
        s = t.sentences()
        parts.append(FitPart(t.name, t.split, len(s)))
        sentences += s
    return FitSet(fit_on, tuple(parts), sentences)


def _paper_set(task: StsTask, roots, family: str) -> FitSet:
    """One task's fit set under `PAPER_RULES[family]` (`task` is its evaluated split)."""
    key = senteval.canonical(task.name)
    if key in senteval.STS_SUBSETS:
        if task.split != 'test':
            raise ProtocolError(f'{task.name}: the paper fit set is built from its test data')
        repeats = 3 if family == 'flow' else 1
        s = task.sentences()
        return FitSet('paper', (FitPart(task.name, 'test', repeats * len(s), repeats),),
                      s * repeats)
    parts, sentences, notes, files, sources = [], [], [], {}, {}
    missing = []
    for split in ('train', 'dev', 'test'):
        # Each split's own file, never SICK's trial-for-test fallback (trial is 'dev' here).
        if not senteval.has_split(key, split, roots):
            missing.append(senteval.SPLIT_FILES[key][split])
            continue
        loaded = senteval.load_sts_task(key, roots, split, fallback=False)
        files.update(loaded.files)
        sources.update(loaded.sources)
        s = loaded.sentences()
        parts.append(FitPart(task.name, split, len(s)))
        sentences += s
    if missing:
        notes.append(f'{task.name}: the paper fit set needs train+dev+test; '
                     f'{", ".join(missing)} not found under the data roots, so it is fitted on '
                     f'{"+".join(p.split for p in parts)} ({len(sentences)} sentences)')
    return FitSet('paper', tuple(parts), sentences, tuple(notes), tuple(missing), files, sources)


def fit_sets(fit_on: str, tasks: Sequence[StsTask], roots, post: str) -> dict[str, FitSet]:
    """Task name -> the FitSet that `post` is fitted on under `fit_on` (a mode or a sentence
    file); tasks sharing one fit ('target', a file) map to the same FitSet object. `roots`
    give the other splits 'paper' reads."""
    if fit_on == 'task':
        return {t.name: _task_set('task', [t]) for t in tasks}
    if fit_on == 'paper':
        family = paper_family(post)
        return {t.name: _paper_set(t, roots, family) for t in tasks}
    if fit_on == 'target':
        shared = _task_set('target', tasks)
    else:
        sentences = senteval.load_sentences(fit_on)
        shared = FitSet(str(fit_on), (FitPart(str(fit_on), 'file', len(sentences)),), sentences,
                        files={str(fit_on): senteval.file_hash(fit_on)})
    return {t.name: shared for t in tasks}


def check_fit_on(fit_on: str) -> None:
    """Validates --fit-on early: a mode, or an existing sentence file."""
    if fit_on not in FIT_MODES:
        senteval.load_sentences(fit_on)  # a missing or bad file fails before any model loads


# ---------------------------------------------------------------------------------------
# Results.
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StsResult:
    """One row of the results table: one model, pooler and calibration.

    Attributes:
      model: the model's name or path.
      pooler: the pooler used.
      post: the `--post` value ('none', 'whitening:256', ...).
      aggregate: which aggregation `tasks` and `avg` show.
      split: 'test' (the protocol) or 'dev'.
      scores: task key -> all its scores.
      details: everything else for the JSON (fit sets, diagnostics, file hashes, timing).
      fit_on: the fit set of its calibration (None for 'none').
    """

    model: str
    pooler: str
    post: str
    aggregate: str
    split: str
    scores: dict[str, TaskScore]
    details: dict[str, Any]
    fit_on: Optional[str] = None

    @property
    def label(self) -> str:
        return calibrate.label(self.post)

    @property
    def tasks(self) -> dict[str, float]:
        return {k: v.get(self.aggregate) for k, v in self.scores.items()}

    def avg_of(self, aggregate: str) -> float:
        return float(np.mean([v.get(aggregate) for v in self.scores.values()]))

    @property
    def avg(self) -> float:
        return self.avg_of(self.aggregate)


def check_post_widths(posts: Sequence[str], width: int, model: str) -> None:
    """Refuses, before any encoding, a calibration asking for more dimensions than the model's
    vectors have (e.g. whitening:99999 on a 384-wide model)."""
    for post in posts:
        name, arg = calibrate.parse_spec(post)
        cls = calibrate.CALIBRATIONS.get(name)
        if getattr(cls, 'linear', False) and isinstance(arg, int) and arg > width:
            raise ProtocolError(
                f'--post {post}: {arg} is more than the {width} dimensions of the vectors of '
                f'{model}')
