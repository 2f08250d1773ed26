"""The run record of a train workdir: what run it holds, its metrics log and its result.

WORKDIR/config.json records the config, a fingerprint of everything that determines what the
run computes (the run-defining config keys, a digest of the tokenized data, the gradient
divisor) and the history of changes the user allowed. A rerun in the same workdir is checked
against it BEFORE anything is written: the same run resumes, a different one is refused in one
line naming the differing keys, unless those keys are explicitly allowed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from jaxsim.errors import USER_ERRORS, JaxsimError
from jaxsim.formats.checkpoint import CHECKPOINT_DIR
from jaxsim.formats.workdir import CONFIG_FILE, MODEL_FILE, TOKENIZER_DIR
from jaxsim.storage import store
from jaxsim.storage.lock import LOCK_FILE
from jaxsim.storage.tb import ScalarWriter
from jaxsim.train.config import TrainConfig, base_config
from jaxsim.train.fingerprint import OPERATIONAL_KEYS, differences, fingerprint, run_defining

METRICS_FILE = 'metrics.jsonl'
TENSORBOARD_DIR = 'tb'
RESULT_FILE = 'result.json'
RECORD_FORMAT = 'jaxsim-train-run'
SEEDS_SUMMARY_FILE = 'seeds_summary.json'
# What an interrupted writer leaves beside its target (jaxsim.storage.store's temporary siblings).
_LEFTOVER = re.compile(r'^\..+\.(tmp|old)-\d+-[0-9a-f]{8}$')
# Run-defining values that are not config keys: allowed like keys (--allow-change=data).
# 'code': digests of the source the run executes (`fingerprint.code_digests`).
DERIVED_KEYS = ('data', 'grad_divisor', 'code')


class RunMismatchError(JaxsimError):
    """A workdir that holds another run (or something else), or cannot be written."""


def _read(path: store.Path) -> Optional[dict]:
    return store.read_json(path, RunMismatchError) if path.is_file() else None


def check_writable(workdir: store.Path) -> None:
    """Refuses a workdir that cannot be written (local) or reached (remote), before any work."""
    try:
        store.check_reachable(workdir, '--workdir')
    except store.StorageError as e:
        raise RunMismatchError(str(e)) from None


def _foreign(workdir: store.Path, own=lambda name: False) -> list[str]:
    """Names in `workdir` that no jaxsim run wrote (besides those `own` accepts)."""
    if not workdir.is_dir():
        return []
    return sorted(p.name for p in workdir.iterdir()
                  if not (p.name == LOCK_FILE or _LEFTOVER.match(p.name) or own(p.name)))


def _refuse_foreign(workdir: store.Path, names: list[str]) -> None:
    if names:
        shown = ', '.join(names[:3]) + (f' and {len(names) - 3} more' if len(names) > 3 else '')
        raise RunMismatchError(f'--workdir {workdir} holds files jaxsim did not write ({shown}); '
                               f'choose an empty or new --workdir')


def check_own_files(workdir: store.Path) -> None:
    """Refuses, before any work, a workdir that holds no run record but other files: a run
    would replace them (model.json, metrics.jsonl, result.json, ...)."""
    if (workdir / CONFIG_FILE).exists():
        return  # a run's (check_workdir compares it) or a foreign config.json (refused there)
    if (workdir / CHECKPOINT_DIR).is_dir():
        raise RunMismatchError(f'{workdir}: holds checkpoints but no {CONFIG_FILE}; not a '
                               f'workdir this run can continue, choose another --workdir')
    _refuse_foreign(workdir, _foreign(workdir))


def check_seeds_workdir(workdir: store.Path) -> None:
    """The same for `--seeds`: the workdir holds seed_N runs and their summary only."""
    runs = re.compile(r'^seed_-?\d+$')
    names = _foreign(workdir, lambda name: bool(runs.match(name)))
    if len(names) < len(_foreign(workdir)):  # seed_N runs: the summary is theirs
        names = [n for n in names if n != SEEDS_SUMMARY_FILE]
    _refuse_foreign(workdir, names)


def make_record(cfg: TrainConfig, derived: Mapping[str, Any], run: Mapping[str, Any]) -> dict:
    """The content of config.json for a run: `derived` holds the run-defining values computed
    from `cfg` (DERIVED_KEYS), `run` facts that may change between resumes (devices, mesh)."""
    compared = {**run_defining(cfg), **derived}
    return {'format': RECORD_FORMAT, 'version': 1, 'config': cfg.to_dict(),
            'derived': dict(derived), 'fingerprint': fingerprint(compared), 'run': dict(run),
            'changes': []}


def _compared(record: Mapping[str, Any]) -> dict:
    # A config key added to jaxsim after the run started counts at its default: new settings
    # default to the behaviour the run already had.
    config = {**base_config().to_dict(), **(record.get('config') or {})}
    return {**run_defining(config), **(record.get('derived') or {})}


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a (re)run in a workdir does.

    Attributes:
      record: the record to write (the new one, with the old change history extended).
      resume: the workdir already holds this run.
      changed: run-defining keys that differ from the stored run (all allowed).
    """

    record: dict
    resume: bool
    changed: dict


def _short(value: Any, other: Any = None) -> str:
    """`value` as JSON in at most 40 characters; cut where it differs from `other`, so two long
    values that share a beginning do not print alike."""
    text = json.dumps(value)
    if len(text) <= 40:
        return text
    theirs = json.dumps(other)
    at = next((i for i, (a, b) in enumerate(zip(text, theirs)) if a != b),
              min(len(text), len(theirs)))
    start = max(0, min(at - 10, len(text) - 34))
    return ('...' if start else '') + text[start:start + 34] + (
        '...' if start + 34 < len(text) else '')


def _change(key: str, old: Any, new: Any) -> str:
    """'key old -> new'; for dicts (e.g. the data's source, size and digest) the entries that
    differ, each so."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        keys = [k for k in dict.fromkeys([*old, *new]) if old.get(k) != new.get(k)]
        if keys:
            return ', '.join(_change(f'{key}.{k}', old.get(k), new.get(k)) for k in keys)
    return f'{key} {_short(old, new)} -> {_short(new, old)}'


def _code_change(record: Mapping[str, Any], old: Any, new: Any) -> str:
    """'the source of objective 'x' changed (sha256:1a2b3c4d -> sha256:5e6f7a8b)'; parts the
    old record did not hash are not compared."""
    old, new = old or {}, new or {}
    config = record.get('config') or {}
    labels = {'objective': f"objective {config.get('objective')!r}",
              'objective_params': f"objective {config.get('objective')!r} (init_params)",
              'pooler': f"pooler {config.get('pooler')!r}"}
    parts = [f'the source of {labels.get(part, part)} changed '
             f'({str(old.get(part))[:15]} -> {str(new.get(part))[:15]})'
             for part in sorted(old) if old.get(part) != new.get(part)]
    return ', '.join(parts)


def check_workdir(workdir: store.Path, record: dict, allow: Sequence[str] = (),
                  step: Optional[int] = None) -> Decision:
    """Compares the run about to start (`record`, of `make_record`) with the one stored in
    `workdir`; writes nothing. `allow`: run-defining keys (config keys or DERIVED_KEYS) allowed
    to differ; `step`: the step it resumes from (noted in the change history). Otherwise a
    RunMismatchError: one line naming the differing keys and how to proceed.
    """
    old = _read(workdir / CONFIG_FILE)
    if old is None:
        check_own_files(workdir)
        return Decision(record=record, resume=False, changed={})
    if old.get('format') != RECORD_FORMAT:
        raise RunMismatchError(f'{workdir / CONFIG_FILE}: not a jaxsim train record; choose an '
                               f'empty or new --workdir')
    changed = differences(_compared(old), _compared(record))
    old_code = (old.get('derived') or {}).get('code')
    if old_code is None:
        changed.pop('code', None)  # a run recorded before code was hashed: nothing to compare
    elif 'code' in changed:  # parts hashed since the run was recorded: nothing to compare
        new_code = {k: v for k, v in (changed['code'][1] or {}).items() if k in old_code}
        if new_code == old_code:
            changed.pop('code')
    refused = [k for k in changed if k not in allow]
    if refused:
        what = ', '.join(_code_change(record, *changed[k]) if k == 'code' else
                         _change(k, *changed[k]) for k in refused)
        raise RunMismatchError(
            f'{workdir} holds a run with other settings ({what}); rerun with the same config, '
            f'use another --workdir, or allow it with --allow-change={",".join(refused)}')
    operational = {k: v for k, v in differences(old.get('config') or {}, record['config']).items()
                   if k in OPERATIONAL_KEYS}
    history = list(old.get('changes') or [])
    if changed or operational:
        history.append({'at_step': step, 'allowed': {k: list(v) for k, v in changed.items()},
                        'operational': {k: list(v) for k, v in operational.items()}})
    return Decision(record={**record, 'changes': history}, resume=True, changed=changed)


def read_result(workdir: store.Path) -> Optional[dict]:
    return _read(workdir / RESULT_FILE)


@dataclasses.dataclass
class TrainResult:
    """Summary of a run (WORKDIR/result.json).

    Attributes:
      steps: optimizer steps done.
      total_steps: steps the run was configured for.
      final_loss: the last logged training loss (None if none was).
      best_step, best_dev: the step with the best STS-B dev score and that score (None when
        no evaluation ran).
      test_at_best: STS-B test with the best step's parameters (None if not evaluated).
      dev_curve: [[step, STS-B dev], ...].
      wall_s: wall time of the last (re)run.
      stopped: why training stopped early (non-finite loss), else None.
      already_finished: the workdir held this finished run; nothing was done (not stored).
    """

    steps: int
    total_steps: int
    final_loss: Optional[float]
    best_step: Optional[int]
    best_dev: Optional[float]
    test_at_best: Optional[float]
    dev_curve: list
    wall_s: float
    stopped: Optional[str] = None
    already_finished: bool = False

    def summary(self) -> str:
        """One line: 'best STS-B dev 86.55 @ step 2, test 84.12' (or what is known)."""
        if self.stopped:
            return f'stopped: {self.stopped}'
        if self.best_dev is None:
            loss = 'n/a' if self.final_loss is None else f'{self.final_loss:.4f}'
            return f'trained {self.steps} steps, final loss {loss} (no STS-B dev evaluation)'
        line = f'best STS-B dev {self.best_dev:.2f} @ step {self.best_step}'
        return line + (f', test {self.test_at_best:.2f}' if self.test_at_best is not None else '')

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop('already_finished')
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], **extra) -> 'TrainResult':
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names}, **extra)


class MetricsLog:
    """WORKDIR/metrics.jsonl: one JSON row per logged step, steps strictly increasing; with
    `tensorboard`, the same scalars as TensorBoard event files in WORKDIR/tb/
    (`jaxsim.storage.tb`), and there also the end-of-training evaluation (`final`).

    Opening it for a run resumed at step S drops the rows after S (written after the last
    checkpoint by a run that did not survive), so the log continues without duplicates; the
    event files get a purge marker at S + 1, so TensorBoard drops those steps too and the
    curves continue.
    """

    def __init__(self, workdir: store.Path, keep_upto: Optional[int], enabled: bool = True,
                 tensorboard: bool = False):
        self.path = workdir / METRICS_FILE
        self.enabled = enabled
        self.rows = [r for r in read_rows(self.path)
                     if keep_upto is not None and r['step'] <= keep_upto]
        self._file = self._tb = None
        if enabled:
            self._rewrite()
            if not store.is_remote(self.path):
                self._file = open(self.path, 'a', encoding='utf-8')
            if tensorboard and not store.is_remote(self.path):  # event files: local only
                self._tb = ScalarWriter(workdir / TENSORBOARD_DIR,
                                        purge_step=0 if keep_upto is None else keep_upto + 1)

    def _rewrite(self) -> None:
        # Object stores cannot append: there every row rewrites the (small) log in one PUT.
        store.write_atomic(self.path, ''.join(_row_text(r) for r in self.rows))

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        row = {'step': int(step), **store.nan_to_null({k: float(v) for k, v in values.items()})}
        if self.rows and row['step'] <= self.rows[-1]['step']:
            raise ValueError(f'metrics row for step {step} after step {self.rows[-1]["step"]}')
        self.rows.append(row)
        if self._file is not None:
            try:
                self._file.write(_row_text(row))
                self._file.flush()
            except OSError as e:  # a full disk: name the log (a resume rewrites its rows)
                raise store.StorageError(f'{self.path}: cannot append the row of step {step}: '
                                         f'{e.strerror or e}; the checkpoints are kept: free '
                                         f'space and rerun to resume') from None
        elif self.enabled:
            self._rewrite()
        if self._tb is not None:
            self._tb.write(row['step'], {k: v for k, v in row.items() if k != 'step'})

    def final(self, step: int, values: Mapping[str, Optional[float]]) -> None:
        """End-of-training evaluation scores (result.json holds them): TensorBoard only, at
        the last step, so metrics.jsonl keeps one row per step."""
        if self._tb is not None:
            self._tb.write(step, values)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _row_text(row: Mapping[str, Any]) -> str:
    return json.dumps(row, allow_nan=False) + '\n'


def read_rows(path: store.Path) -> list[dict]:
    """The rows of a metrics.jsonl; a torn last line (killed mid-write) is ignored."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding='utf-8').splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get('step'), int):
            rows.append(row)
    return rows


def remove(paths: Iterable[store.Path]) -> None:
    for p in paths:
        if p.is_file():
            p.unlink()


class _Start:
    def __init__(self):
        self.training = False

    def started(self) -> None:
        """From here on the run keeps what it wrote (its first steps may be saved)."""
        self.training = True


@contextlib.contextmanager
def undone_if_it_fails_to_start(workdir: store.Path, new_run: bool) -> Iterator[_Start]:
    """For a new run (`new_run`: the workdir held none, see `check_own_files`): what it wrote
    before training starts (its record, model, tokenizer, an empty checkpoint folder) is
    removed again when it fails or is stopped on the way, e.g. a sharding the mesh cannot take,
    an objective that fails at its first step, Ctrl-C while the run loads. The corrected
    command is then a new run too, not refused as 'a run with other settings'."""
    start = _Start()
    try:
        yield start
    except (*USER_ERRORS, KeyboardInterrupt):  # KeyboardInterrupt: also a stop before the start
        if new_run and not start.training:
            workdir = store.as_path(workdir)
            remove([workdir / CONFIG_FILE, workdir / MODEL_FILE, workdir / METRICS_FILE])
            for folder in (TOKENIZER_DIR, CHECKPOINT_DIR, TENSORBOARD_DIR):
                if (workdir / folder).is_dir():
                    (workdir / folder).rmtree()
        raise
