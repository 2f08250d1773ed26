"""End to end in-process: a tiny random BERT through train_and_evaluate (STS-B selection,
checkpoints, exact resume, the workdir as a model for encode/eval/export, refusal of another
run, a finished rerun, the NaN stop, a user objective with its own hyperparameters, run_seeds).
"""
import functools
import hashlib
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

import jaxsim
from configs.tiny_unsup_simcse import get_config
from jaxsim.data.senteval import load_stsb
from jaxsim.eval.metrics import spearman_x100
from jaxsim.eval.runner import stsb_score
from jaxsim.export import export_model
from jaxsim.formats.checkpoint import Checkpointer
from jaxsim.objectives import ObjectiveError, register_objective
from jaxsim.storage.paths import SENTEVAL_ROOT
from jaxsim.train import loop
from jaxsim.train import step as step_lib
from jaxsim.train.config import TrainConfig, base_config
from jaxsim.train.records import RunMismatchError, TrainResult
from jaxsim.train.step import configure_jax

configure_jax()


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    lines = (SENTEVAL_ROOT / 'SNLI' / 's1.dev').read_text().splitlines()[:120]
    path = tmp_path_factory.mktemp('data') / 'corpus.txt'
    path.write_text('\n\n'.join(lines) + '\n')  # blank lines are skipped by the reader
    return path


@pytest.fixture(scope='module')
def senteval(tmp_path_factory):
    """STS-B dev/test of 40 real pairs each: the protocol on a budget."""
    root = tmp_path_factory.mktemp('senteval')
    folder = root / 'STS' / 'STSBenchmark'
    folder.mkdir(parents=True)
    for split in ('dev', 'test'):
        src = SENTEVAL_ROOT / 'STS' / 'STSBenchmark' / f'sts-{split}.csv'
        (folder / src.name).write_text('\n'.join(src.read_text().splitlines()[:40]) + '\n')
    return root


def _cfg(corpus, **kw) -> TrainConfig:
    fields = base_config().to_dict()
    fields.update(get_config().to_dict())
    fields.update({'train_file': str(corpus), 'max_steps': 4, 'checkpoint_every': 2, **kw})
    return TrainConfig.from_dict(fields)


def _files(workdir: Path) -> dict:
    """path -> (sha256, mtime) of every file: 'nothing changed' made checkable."""
    return {str(p.relative_to(workdir)): (hashlib.sha256(p.read_bytes()).hexdigest(),
                                          p.stat().st_mtime_ns)
            for p in sorted(workdir.rglob('*')) if p.is_file()}


def _strict_json(path: Path):
    def refuse(name):
        raise ValueError(f'{path}: non-JSON constant {name}')
    return json.loads(path.read_text(), parse_constant=refuse)


def _tensorboard(workdir: Path) -> dict:
    """tag -> [(step, value)] as TensorBoard shows them (orphaned steps purged)."""
    acc = event_accumulator.EventAccumulator(str(workdir / 'tb'), purge_orphaned_data=True)
    acc.Reload()
    return {tag: [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars(tag)]
            for tag in acc.Tags()['scalars']}


def _jsonl_curves(rows: list) -> dict:
    tags = sorted({k for row in rows for k in row if k != 'step'})
    return {tag: [(row['step'], row[tag]) for row in rows if row.get(tag) is not None]
            for tag in tags}


def _params(workdir, step):
    with Checkpointer(Path(workdir) / 'checkpoints', read_only=True) as ck:
        return jax.tree.map(np.asarray, ck.restore(step).state['params'])


def test_train_select_resume_and_use_the_workdir_as_a_model(corpus, senteval, tmp_path):
    a = tmp_path / 'a'
    cfg = _cfg(corpus, senteval_root=str(senteval), eval_every=2, eval_max_len=16)
    r = loop.train_and_evaluate(cfg, a, progress=False)
    assert (r.steps, r.total_steps, r.stopped, r.already_finished) == (4, 4, None, False)
    assert [s for s, _ in r.dev_curve] == [0, 2, 4] and r.test_at_best is not None
    assert r.best_dev == max(v for _, v in r.dev_curve) and r.best_step in (0, 2, 4)
    assert _strict_json(a / 'result.json')['best_step'] == r.best_step
    rows = [json.loads(x) for x in (a / 'metrics.jsonl').read_text().splitlines()]
    assert [m['step'] for m in rows] == [0, 1, 2, 3, 4]  # one row per step, in order
    assert [m['step'] for m in rows if 'stsb_dev' in m] == [0, 2, 4]
    assert all(np.isfinite(m['loss']) and {'align', 'uniform', 'lr'} <= set(m)
               for m in rows[1:])
    record = _strict_json(a / 'config.json')
    assert record['config']['pooler'] == 'cls' and record['derived']['data']['examples'] == 120
    assert sorted(p.name for p in a.iterdir()) == [  # .lock: emptied when the run ended
        '.lock', 'checkpoints', 'config.json', 'metrics.jsonl', 'model.json', 'result.json', 'tb',
        'tokenizer']
    # TensorBoard's own reader finds every metrics.jsonl value at its step, and the final
    # STS-B test score (result.json's) at the last step.
    assert _tensorboard(a) == {**_jsonl_curves(rows),
                               'stsb_test_at_best': [(4, r.test_at_best)]}

    # The workdir is a model: its best checkpoint, encoded by jaxsim.encode, gives the dev score.
    model = jaxsim.load_pretrained(a)
    assert (model.pooler, model.encoder.mlp_only_train, model.max_seq_length) == ('cls', True, 16)
    dev = load_stsb(senteval, 'dev')
    e1, e2 = jaxsim.encode(model, dev.sent1), jaxsim.encode(model, dev.sent2)
    assert abs(spearman_x100(e1, e2, dev.gold) - r.best_dev) < 1e-3
    # ... and so does the evaluation package's STS protocol, and an export read back.
    encode_fn = functools.partial(jaxsim.encode, model)
    assert abs(stsb_score(encode_fn, [senteval]) - r.best_dev) < 1e-3
    exported = jaxsim.load_pretrained(export_model(model, tmp_path / 'export'))
    np.testing.assert_allclose(jaxsim.encode(exported, dev.sent1), e1, atol=1e-5)

    # A finished run rerun: says so, changes nothing.
    before = _files(a)
    again = loop.train_and_evaluate(cfg, a, progress=False)
    assert again.already_finished and again.to_json() == r.to_json()
    assert _files(a) == before
    # Another run in the same workdir: refused in one line, nothing written.
    with pytest.raises(RunMismatchError) as e:
        loop.train_and_evaluate(cfg.replace(learning_rate=0.1, seed=3), a, progress=False)
    assert '\n' not in str(e.value) and 'learning_rate 0.001 -> 0.1, seed 0 -> 3' in str(e.value)
    assert '--allow-change=learning_rate,seed' in str(e.value)
    assert _files(a) == before

    # Exact resume: drop the last checkpoint and the result, rerun, land on the same bits.
    b = tmp_path / 'b'
    shutil.copytree(a, b)
    shutil.rmtree(b / 'checkpoints' / '4')
    (b / 'result.json').unlink()
    rb = loop.train_and_evaluate(cfg, b, progress=False)
    assert (b / 'metrics.jsonl').read_text() == (a / 'metrics.jsonl').read_text()
    # The resumed curves continue: steps past the checkpoint were purged, none twice.
    assert _tensorboard(b) == {**_jsonl_curves(rows),
                               'stsb_test_at_best': [(4, rb.test_at_best)]}
    assert {**rb.to_json(), 'wall_s': 0} == {**r.to_json(), 'wall_s': 0}
    for x, y in zip(jax.tree.leaves(_params(a, 4)), jax.tree.leaves(_params(b, 4))):
        np.testing.assert_array_equal(x, y)


def test_non_finite_loss_stops_with_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    real = step_lib.make_train_step

    def poisoned(*args, **kwargs):
        step = real(*args, **kwargs)

        def wrapped(state, batch):
            at = int(state.step)
            new, metrics = step(state, batch)
            return new, {**metrics, 'loss': jnp.float32(np.nan)} if at == 2 else metrics
        return wrapped

    monkeypatch.setattr(step_lib, 'make_train_step', poisoned)  # what build.train_program calls
    w = tmp_path / 'w'
    r = loop.train_and_evaluate(_cfg(corpus), w, progress=False)
    assert r.stopped is not None and 'step 3' in r.stopped and r.steps == 2
    assert r.stopped.endswith('; the last checkpoint, step 2, is kept')  # said only when true
    assert r.final_loss is not None and np.isfinite(r.final_loss)
    with Checkpointer(w / 'checkpoints', read_only=True) as ck:
        assert ck.all_steps() == [2]
    rows = [json.loads(x) for x in (w / 'metrics.jsonl').read_text().splitlines()]
    assert [m['step'] for m in rows] == [1, 2]
    assert _strict_json(w / 'result.json')['stopped'] == r.stopped
    before = _files(w)
    assert loop.train_and_evaluate(_cfg(corpus), w, progress=False).already_finished
    assert _files(w) == before


@register_objective('test_scaled', views=2, from_single=True, replace=True)
def scaled_unsup(z, scale, temp=0.05):
    """A user objective with its own required hyperparameter and its own aux."""
    a = z[:, 0] / jnp.linalg.norm(z[:, 0], axis=-1, keepdims=True)
    b = z[:, 1] / jnp.linalg.norm(z[:, 1], axis=-1, keepdims=True)
    logits = scale * (a @ b.T) / temp
    loss = -jnp.mean(jnp.diagonal(jax.nn.log_softmax(logits, axis=-1)))
    return loss, {'scale_seen': jnp.asarray(scale, jnp.float32), 'rows': a.shape[0] * 1.0}


def test_user_objective_gets_its_hyperparameters_from_the_config(corpus, tmp_path):
    w = tmp_path / 'user'
    with pytest.raises(ObjectiveError, match="'test_scaled' needs objective_kwargs 'scale'"):
        loop.train_and_evaluate(_cfg(corpus, objective='test_scaled'), w, progress=False)
    assert not w.exists()  # refused before anything was written
    # 120 examples, batch 48: 2 full batches + a kept last batch of 24 (a multiple of the 2
    # accumulation steps); the micro-batch aux are averaged whatever their names.
    cfg = _cfg(corpus, objective='test_scaled', objective_kwargs={'scale': 3.0},
               max_steps=0, num_epochs=1.0, batch_size=48, grad_accum_steps=2,
               last_batch='keep', checkpoint=False)
    r = loop.train_and_evaluate(cfg, w, progress=False)
    rows = [json.loads(x) for x in (w / 'metrics.jsonl').read_text().splitlines()]
    assert r.steps == 3 and [m['rows'] for m in rows] == [24.0, 24.0, 12.0]
    assert all(m['scale_seen'] == 3.0 for m in rows)
    run = _strict_json(w / 'config.json')['run']
    assert (run['steps_per_epoch'], run['dropped_per_epoch']) == (3, 0)


def test_an_edited_objective_is_not_resumed_as_the_finished_run(corpus, tmp_path):
    from tests.train.records_test import _LOSS_MODULE, _load_objective
    w = tmp_path / 'edited'
    _load_objective(tmp_path, _LOSS_MODULE)
    cfg = _cfg(corpus, objective='test_code_obj', max_steps=1, checkpoint=False)
    assert loop.train_and_evaluate(cfg, w, progress=False).steps == 1
    code = _strict_json(w / 'config.json')['derived']['code']['objective']
    assert loop.train_and_evaluate(cfg, w, progress=False).already_finished
    _load_objective(tmp_path, _LOSS_MODULE.replace('/ temp', '/ (2 * temp)'))
    with pytest.raises(RunMismatchError, match="the source of objective 'test_code_obj' "
                                               "changed .*--allow-change=code$"):
        loop.train_and_evaluate(cfg, w, progress=False)
    assert _strict_json(w / 'config.json')['derived']['code']['objective'] == code


def test_run_seeds_reports_mean_and_sample_std(tmp_path, monkeypatch):
    scores = {1: (80.0, 78.0), 2: (82.0, 79.0), 3: (84.0, 83.0)}
    seen = []

    def fake(cfg, workdir, progress=True, allow_changes=()):
        seen.append((cfg.seed, Path(workdir).name))
        dev, test = scores[cfg.seed]
        return TrainResult(steps=3, total_steps=3, final_loss=1.0, best_step=3, best_dev=dev,
                           test_at_best=test, dev_curve=[[3, dev]], wall_s=1.0)

    monkeypatch.setattr(loop, 'train_and_evaluate', fake)
    s = loop.run_seeds(TrainConfig(train_file='x'), tmp_path, [1, 2, 3])
    assert seen == [(1, 'seed_1'), (2, 'seed_2'), (3, 'seed_3')]
    assert s['stsb_dev_best']['mean'] == pytest.approx(82.0)
    assert s['stsb_dev_best']['std'] == pytest.approx(2.0)  # sample std (ddof=1)
    assert s['stsb_test_at_best']['mean'] == pytest.approx(80.0)
    assert _strict_json(tmp_path / 'seeds_summary.json')['seeds'] == [1, 2, 3]
    assert '82.00 +- 2.00' in loop.format_seed_summary(s)


def test_summary_line():
    r = TrainResult(steps=2, total_steps=2, final_loss=float('nan'), best_step=2,
                    best_dev=86.5512, test_at_best=84.1199, dev_curve=[[2, 86.5512]], wall_s=1)
    assert r.summary() == 'best STS-B dev 86.55 @ step 2, test 84.12'
    assert TrainResult(2, 2, None, None, None, None, [], 1.0).summary() == (
        'trained 2 steps, final loss n/a (no STS-B dev evaluation)')


def test_a_stop_without_a_checkpoint_says_nothing_was_saved(corpus, tmp_path, monkeypatch):
    real = step_lib.make_train_step

    def poisoned(*args, **kwargs):
        step = real(*args, **kwargs)
        return lambda state, batch: (lambda new, m: (new, {**m, 'loss': jnp.float32(np.nan)}))(
            *step(state, batch))

    monkeypatch.setattr(step_lib, 'make_train_step', poisoned)
    r = loop.train_and_evaluate(_cfg(corpus, checkpoint_every=0), tmp_path / 'w',
                                progress=False)
    assert r.stopped.startswith('non-finite loss or gradient at step 1 (loss nan')
    assert r.stopped.endswith('; no checkpoint was saved before it')


def test_a_resume_that_cannot_restore_leaves_the_run_record_as_it_was(corpus, tmp_path):
    """An allowed change that the checkpoint cannot take (no gradient clipping: another
    optimizer state) fails at the restore; the record must not claim the change."""
    w = tmp_path / 'w'
    loop.train_and_evaluate(_cfg(corpus, max_steps=2), w, progress=False)
    before = {k: v for k, v in _files(w).items() if k != '.lock'}  # the lock was taken
    with pytest.raises(Exception, match='cannot restore'):
        loop.train_and_evaluate(_cfg(corpus, max_steps=4, max_grad_norm=0.0), w,
                                progress=False, allow_changes=('max_steps', 'max_grad_norm'))
    assert {k: v for k, v in _files(w).items() if k != '.lock'} == before
    r = loop.train_and_evaluate(_cfg(corpus, max_steps=4), w, progress=False,
                                allow_changes=('max_steps',))
    assert r.steps == 4


def test_a_new_run_stopped_before_its_first_step_takes_back_what_it_wrote(corpus, tmp_path,
                                                                         monkeypatch):
    """Ctrl-C while the run loads (here: as the step is built) leaves no record behind, so
    the rerun with other settings is a new run, not refused."""
    from jaxsim.errors import Interrupted
    from jaxsim.train import build

    def interrupted(*args, **kwargs):
        raise Interrupted(2)

    monkeypatch.setattr(build, 'train_program', interrupted)
    w = tmp_path / 'w'
    with pytest.raises(Interrupted):
        loop.train_and_evaluate(_cfg(corpus), w, progress=False)
    assert {p.name for p in w.iterdir()} <= {'.lock'}
    monkeypatch.undo()
    r = loop.train_and_evaluate(_cfg(corpus, learning_rate=5e-4, max_steps=1), w,
                                progress=False)
    assert r.steps == 1


def test_a_stop_after_a_resume_without_saving_names_the_checkpoint_it_resumed_from(
        corpus, tmp_path, monkeypatch):
    w = tmp_path / 'w'
    loop.train_and_evaluate(_cfg(corpus, max_steps=2), w, progress=False)
    real = step_lib.make_train_step

    def poisoned(*args, **kwargs):
        step = real(*args, **kwargs)
        return lambda state, batch: (lambda new, m: (new, {**m, 'loss': jnp.float32(np.nan)}))(
            *step(state, batch))

    monkeypatch.setattr(step_lib, 'make_train_step', poisoned)
    r = loop.train_and_evaluate(_cfg(corpus, max_steps=4, checkpoint=False), w, progress=False,
                                allow_changes=('max_steps',))
    assert r.stopped.endswith('; the last checkpoint, step 2, is kept')
