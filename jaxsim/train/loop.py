"""The training loop: `train_and_evaluate(config, workdir)` and `run_seeds`.

Order of work (nothing in the workdir is written before step 3):
  1. read and check every input on the host: config, objective, data, base model, STS-B files;
  2. compare the run with the one the workdir holds (same run: resume; different: refuse);
  3. write the run record, the model description (model.json + tokenizer/), then train:
     checkpoints (orbax, async), metrics.jsonl (one row per logged step), result.json.
A SIGINT/SIGTERM finishes the current step, saves, and raises `Interrupted`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxsim import distributed, runtime
from jaxsim import sharding as sharding_lib
from jaxsim.data import pipeline
from jaxsim.errors import Interrupted
from jaxsim.formats.checkpoint import CHECKPOINT_DIR, Checkpointer, CheckpointOptions
from jaxsim.formats.workdir import write_model
from jaxsim.model import SentenceModel
from jaxsim.models import st_head
from jaxsim.models.encoder import init_params
from jaxsim.models.poolers import get_pooler
from jaxsim.objectives import owned
from jaxsim.objectives.base import check_kwargs, get_objective
from jaxsim.progress import progress_bar
from jaxsim.storage import store
from jaxsim.storage.lock import hold_workdir
from jaxsim.train import build, records
from jaxsim.train.config import TrainConfig
from jaxsim.train.evaluate import DEV_METRIC, StsbEvaluator
from jaxsim.train.fingerprint import code_digests, parse_key_list
from jaxsim.train.records import TrainResult
from jaxsim.train.signals import deferred_signals
from jaxsim.train.state import TrainState, abstract_state, create_state, param_shardings
from jaxsim.train.step import check_jax_configured


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def _latest_step(workdir: store.Path) -> Optional[int]:
    """The step to resume from; every process takes process 0's answer (they must agree)."""
    folder, latest = workdir / CHECKPOINT_DIR, None
    if folder.is_dir():
        with Checkpointer(folder, read_only=True) as ckpt:
            latest = ckpt.latest_step()
    if jax.process_count() > 1:
        latest = int(multihost_utils.broadcast_one_to_all(np.int32(-1 if latest is None
                                                                    else latest)))
        latest = None if latest < 0 else latest
    return latest


def train_and_evaluate(config: Union[TrainConfig, Mapping], workdir: Union[str, Path], *,
                       progress: bool = True, allow_changes: Sequence[str] = ()) -> TrainResult:
    """Trains as configured in `workdir`, resuming the run it holds.

    Args:
      config: a TrainConfig or a dict of its fields.
      workdir: the run's folder; it ends up a loadable model (`jaxsim.load_pretrained`).
      progress: a progress bar and status lines on stderr (main process).
      allow_changes: run-defining config keys allowed to differ from the run the workdir
        holds (recorded in its config.json), e.g. ('max_steps',) to extend a run.

    Returns:
      The TrainResult (also WORKDIR/result.json). A workdir holding this finished run is left
      untouched and its stored result returned with `already_finished=True`.

    Raises:
      JaxsimError subclasses for bad input (one line), Interrupted on SIGINT/SIGTERM.
    """
    t0 = time.time()
    check_jax_configured()
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
    workdir = store.as_path(workdir, '--workdir')
    main = jax.process_index() == 0
    say = functools.partial(_say, progress and main)
    records.check_writable(workdir)
    records.check_own_files(workdir)
    allow = parse_key_list(allow_changes, extra=records.DERIVED_KEYS)

    # ---- 1. inputs, on the host -------------------------------------------------------------
    objective = get_objective(cfg.objective)
    objective_kwargs = check_kwargs(objective, cfg.objective_kwargs)
    build.check_loss_batch(cfg, objective)
    source = build.open_source(cfg)
    build.check_views(source, objective)
    base = build.load_base(cfg)
    encoder = build.make_encoder(cfg, base.config)
    mesh = sharding_lib.config_mesh(cfg)
    build.check_batch_split(cfg, mesh, base.config)
    # Each process reads and tokenizes only the rows its devices hold, ahead of the step.
    it = build.train_batches(cfg, source, base.tokenizer, mesh)
    total = cfg.max_steps or math.ceil(cfg.num_epochs * it.steps_per_epoch)
    model = SentenceModel(encoder=encoder.clone(dtype=jnp.float32, remat="none"), params=None,
                          tokenizer=base.tokenizer, path=str(workdir),
                          max_seq_length=cfg.eval_max_len, head=base.head)
    evaluator = StsbEvaluator(model, mesh, cfg.senteval_root, cfg.eval_max_len,
                              cfg.eval_batch_size, cfg.eval_test) if cfg.senteval_root else None

    # ---- 2. the workdir's run ---------------------------------------------------------------
    derived = {'data': {'source': source.name, 'examples': it.num_examples,
                        'sha256': pipeline.data_digest(source, base.tokenizer, cfg.max_len)},
               'grad_divisor': build.grad_divisor(cfg, mesh),
               'code': code_digests(objective, get_pooler(cfg.pooler))}
    facts = {'total_steps': total, 'steps_per_epoch': it.steps_per_epoch,
             'dropped_per_epoch': it.dropped_per_epoch, 'base_model': base.path,
             'devices': jax.device_count(), 'processes': jax.process_count(),
             'mesh': dict(mesh.shape)}
    distributed.check_same_inputs({
        'config': cfg.to_dict(), 'corpus': derived['data']['sha256']})
    latest = _latest_step(workdir)
    decision = records.check_workdir(workdir, records.make_record(cfg, derived, facts), allow,
                                     step=latest)
    stored = records.read_result(workdir) if decision.resume else None
    if stored is not None and (stored.get('stopped') and not decision.changed
                               or int(stored.get('steps', -1)) >= total):
        return TrainResult.from_json(stored, already_finished=True)
    if latest is not None and latest > total:
        raise records.RunMismatchError(f'{workdir}: already at step {latest}, beyond the '
                                       f'{total} steps configured')

    # ---- 3. train -----------------------------------------------------------------------------
    # One run at a time writes a workdir; process 0 holds its lock for all processes.
    with hold_workdir(workdir, main, say), records.undone_if_it_fails_to_start(
            workdir, main and not decision.resume) as start:
        def write_run_files() -> None:
            if main:
                workdir.mkdir(parents=True, exist_ok=True)
                records.remove([workdir / records.RESULT_FILE])
                store.write_json(workdir / records.CONFIG_FILE, decision.record)
                write_model(workdir, model, base_model=cfg.model)

        if latest is None:
            write_run_files()
        program = build.train_program(
            cfg, encoder, objective, objective_kwargs, mesh, total,
            mlm=build.mlm_settings(cfg, base.config, base.tokenizer) if encoder.mlm else None,
            head=base.head)
        shardings, ckpt = program.shardings, None
        if cfg.checkpoint or latest is not None:
            ckpt = Checkpointer(workdir / CHECKPOINT_DIR, CheckpointOptions(
                max_to_keep=cfg.keep_checkpoints, best_metric=DEV_METRIC if evaluator else None,
                keep_best=1 if evaluator else 0))
        if latest is not None:
            restored = ckpt.restore('latest', abstract_state(program.state_shape, shardings))
            state, step = restored.state, restored.step
            it.set_state(restored.data['iterator'])
            # Only a run that restores is recorded as resumed (with the changes it allowed).
            write_run_files()
            say(f'resuming {workdir} from step {step} of {total}')
        else:
            params = init_params(
                encoder, program.init_key, param_shardings(encoder, mesh, *build.param_rules(cfg)),
                base.bert_params, mlm_params=base.mlm_params)
            weights = st_head.head_weights(base.head)
            if weights:  # the kept head's Dense weights, trained with the encoder
                params = {**params, st_head.HEAD_KEY: jax.device_put(
                    weights, shardings.params[st_head.HEAD_KEY])}
            mine = build.owned_params(cfg, objective, objective_kwargs)
            if mine:  # the objective's own parameters, placed as the state keeps them
                params = owned.join(params, jax.device_put(mine, shardings.params[owned.KEY]))
            state, shardings = create_state(params, program.tx, program.dropout_key, mesh,
                                            program.compiler_options, shardings)
            step = 0
        base = base.without_weights()  # the state holds them: no second copy for the whole run
        log = records.MetricsLog(workdir, keep_upto=latest, enabled=main,
                                 tensorboard=cfg.tensorboard)
        parts = _RunParts(train_step=program.train_step, batches=it,
                          prepare=build.batch_preparer(cfg, objective, mesh), mesh=mesh,
                          checkpointer=ckpt, log=log, evaluator=evaluator, say=say,
                          show_bar=progress and main, started=start.started)
        loop = _Loop(cfg=cfg, parts=parts, state=state, step=step, total=total)
        try:
            loop.run()
            test_at_best = loop.final_test()
            log.final(loop.step, {'stsb_test_at_best': test_at_best})
        finally:
            it.close()
            log.close()
            if ckpt is not None:
                ckpt.close()
        result = TrainResult(steps=loop.step, total_steps=total, final_loss=loop.last_loss,
                             best_step=loop.best_step, best_dev=loop.best_dev,
                             test_at_best=test_at_best, dev_curve=loop.dev_curve,
                             wall_s=round(time.time() - t0, 3), stopped=loop.stopped)
        if main:
            store.write_json(workdir / records.RESULT_FILE, result.to_json())
        return result


@dataclasses.dataclass(frozen=True)
class _RunParts:
    """What the step loop drives, built once per run by `train_and_evaluate`. `batches`: this
    process's host batches in the run's order (checkpoints keep its position); `prepare`: a
    host batch -> the step's input; `checkpointer`: None when the run neither saves nor
    resumes; `say`: a status line (a no-op unless progress is on in the main process);
    `started`: called after each step is dispatched: once the first is (traced and compiled),
    a failure no longer takes back what a new run wrote.
    """

    train_step: Callable
    batches: pipeline.StreamIterator
    prepare: Callable[[dict], dict]
    mesh: Mesh
    checkpointer: Optional[Checkpointer]
    log: records.MetricsLog
    evaluator: Optional[StsbEvaluator]
    say: Callable[[str], Any]
    show_bar: bool
    started: Callable[[], None] = lambda: None


class _Loop:
    """The step loop's state: host-side bookkeeping around the jitted step."""

    def __init__(self, *, cfg: TrainConfig, parts: _RunParts, state: TrainState, step: int,
                 total: int):
        self.cfg, self.parts, self.total = cfg, parts, total
        self.state, self.step = state, step  # where the run stands; both advance each step
        self.stopped: Optional[str] = None
        # What earlier (re)runs logged up to the restored step.
        rows = parts.log.rows
        self.dev_curve = [[r['step'], r[DEV_METRIC]] for r in rows if DEV_METRIC in r]
        self.last_loss = next((r['loss'] for r in reversed(rows) if r.get('loss') is not None),
                              None)
        # The first best wins ties (HF), as max keeps the first of equal items.
        self.best_step, self.best_dev = max(self.dev_curve, key=lambda r: r[1],
                                            default=(None, None))
        self.best_params = None

    # ------------------------------------------------------------------ pieces
    def _is_eval(self, step: int) -> bool:
        every = self.cfg.eval_every
        return self.parts.evaluator is not None and (
            (every > 0 and step % every == 0) or (step == self.total and self.cfg.eval_at_end))

    def _evaluate(self, step: int, bar) -> float:
        if bar is not None:
            bar.set_description('STS-B dev')
        score = self.parts.evaluator.score(owned.encoder_params(self.state.params), 'dev')
        if bar is not None:
            bar.set_description('train')
        self.dev_curve.append([step, score])
        if self.best_dev is None or score > self.best_dev:
            self.best_step, self.best_dev = step, score
            if not self._saves():  # keep a copy for the test score
                self.best_params = jax.tree.map(jnp.copy,
                                                owned.encoder_params(self.state.params))
        return score

    def _saves(self) -> bool:
        return self.parts.checkpointer is not None and self.cfg.checkpoint

    def _save(self, step: int, metrics: Optional[dict] = None) -> None:
        if self._saves():
            # orbax warns about every checkpoint saved without the ranking metric; only
            # evaluation steps have one, the others are kept as 'latest' on purpose.
            with runtime.quiet_absl_messages('did not provide metrics'):
                self.parts.checkpointer.save(
                    step, self.state, data={'iterator': self.parts.batches.get_state()},
                    config=self.cfg.to_dict(), metrics=metrics)

    def _drain(self, pending: deque, keep: int, bar) -> Optional[dict]:
        """Reads the metrics of all but `keep` dispatched steps; writes their rows.

        Returns the row of the current step when it was drained (written by the caller, after
        its evaluation), or None. Sets `stopped` on a non-finite loss/gradient.
        """
        current = None
        while len(pending) > keep:
            s, m = pending.popleft()
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            if not (math.isfinite(m['loss']) and math.isfinite(m['grad_norm'])):
                self.stopped = (f'non-finite loss or gradient at step {s} (loss {m["loss"]}, '
                                f'grad_norm {m["grad_norm"]})')
                self.step = s - 1  # steps dispatched after it are discarded with it
                pending.clear()
                return None
            self.last_loss = m['loss']
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f'{m["loss"]:.4f}')
            row = m if s % self.cfg.log_every == 0 or s == self.total else {}
            if s == self.step:
                current = row
            elif row:
                self.parts.log.write(s, row)
        return current

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        cfg, parts = self.cfg, self.parts
        if parts.evaluator is not None and cfg.eval_at_start and self.step == 0 and not any(
                s == 0 for s, _ in self.dev_curve):
            parts.say('STS-B dev of the initial model ...')
            score = self._evaluate(0, None)
            parts.log.write(0, {DEV_METRIC: score})
            self._save(0, {DEV_METRIC: score})
        bar = None
        if parts.show_bar and self.step < self.total:
            # A bar on a terminal, plain periodic lines in a log (no carriage returns).
            bar = progress_bar(self.total, 'train', unit='step', initial=self.step)
        pending: deque = deque()
        try:
            with deferred_signals() as stop:
                while self.step < self.total:
                    batch = sharding_lib.assemble_batch(parts.prepare(next(parts.batches)),
                                                        parts.mesh)
                    self.state, metrics = parts.train_step(self.state, batch)
                    parts.started()  # the step traced and compiled: the run has begun
                    self.step += 1
                    pending.append((self.step, metrics))
                    is_eval = self._is_eval(self.step)
                    # A checkpoint follows the row of its own step, so a resume loses no row.
                    will_save = (is_eval or self.step == self.total or bool(stop) or (
                        cfg.checkpoint_every > 0 and self.step % cfg.checkpoint_every == 0))
                    # Host reads lag one step behind dispatch: the device never idles on logs.
                    row = self._drain(pending, 0 if will_save else 1, bar)
                    if self.stopped:
                        break
                    if not will_save:
                        continue
                    row = dict(row or {})
                    if is_eval:
                        row[DEV_METRIC] = self._evaluate(self.step, bar)
                    if row:
                        parts.log.write(self.step, row)
                    self._save(self.step, {DEV_METRIC: row[DEV_METRIC]} if is_eval else None)
                    if stop:
                        if parts.checkpointer is not None:
                            parts.checkpointer.wait_until_finished()
                        raise Interrupted(stop.signum, self.step if self._saves() else None)
                if parts.checkpointer is not None:
                    parts.checkpointer.wait_until_finished()
                if stop:
                    raise Interrupted(stop.signum,
                                      self.step if parts.checkpointer is not None else None)
        finally:
            if bar is not None:
                bar.close()
        if self.stopped:  # what of the run is left: its last checkpoint, if it saved one
            saved = parts.checkpointer.latest_step() if parts.checkpointer is not None else None
            self.stopped += (f'; the last checkpoint, step {saved}, is kept' if saved is not None
                             else '; no checkpoint was saved before it')

    def final_test(self) -> Optional[float]:
        """STS-B test with the best-on-dev parameters (None when not configured/possible)."""
        ev = self.parts.evaluator
        if ev is None or not ev.has('test') or self.best_step is None or self.stopped:
            return None
        self.parts.say(f'final evaluation: STS-B test with the parameters of step '
                       f'{self.best_step} (best on dev, {self.best_dev:.2f}) ...')
        if self.best_step == self.step:
            params = self.state.params
        elif self.best_params is not None:
            params = self.best_params
        else:
            params = self.parts.checkpointer.restore_params(
                self.best_step, NamedSharding(self.parts.mesh, P()))
        with deferred_signals() as stop:
            score = ev.score(owned.encoder_params(params), 'test')
            if stop:
                raise Interrupted(stop.signum, self.step)
        return score


def run_seeds(config: Union[TrainConfig, Mapping], workdir: Union[str, Path],
              seeds: Sequence[int], *, progress: bool = True,
              allow_changes: Sequence[str] = ()) -> dict:
    """Runs the config once per seed (WORKDIR/seed_N); mean and sample std of the scores.

    Seed variance (about 2 points for SimCSE) is the usual reproduction complaint, so the
    summary gives mean, sample std and every run's best STS-B dev and test-at-best.
    Writes WORKDIR/seeds_summary.json.
    """
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
    workdir = store.as_path(workdir, '--workdir')
    records.check_seeds_workdir(workdir)
    configs = {int(seed): cfg.replace(seed=int(seed)) for seed in seeds}  # all checked first
    runs = {seed: train_and_evaluate(seed_cfg, workdir / f'seed_{seed}', progress=progress,
                                     allow_changes=allow_changes).to_json()
            for seed, seed_cfg in configs.items()}

    def stats(key):
        values = [r[key] for r in runs.values() if r[key] is not None]
        if not values:
            return None
        return {'mean': float(np.mean(values)),
                'std': float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
                'n': len(values), 'values': values}

    summary = {'seeds': [int(s) for s in seeds], 'stsb_dev_best': stats('best_dev'),
               'stsb_test_at_best': stats('test_at_best'), 'final_loss': stats('final_loss'),
               'runs': runs}
    if jax.process_index() == 0:
        workdir.mkdir(parents=True, exist_ok=True)
        store.write_json(workdir / records.SEEDS_SUMMARY_FILE, summary)
    return summary


def format_seed_summary(summary: Mapping) -> str:
    lines = [f"seeds {summary['seeds']}"]
    for key in ('stsb_dev_best', 'stsb_test_at_best', 'final_loss'):
        s = summary.get(key)
        if s:
            lines.append(f"  {key:18s} {s['mean']:.2f} +- {s['std']:.2f}  "
                         f"({', '.join(f'{v:.2f}' for v in s['values'])})")
    return '\n'.join(lines)
