"""End-to-end: tiny random BERT through train_and_evaluate (STS-B eval, checkpoints, exact
resume, NaN stop) and the train.py CLI's error path."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.tiny_unsup_simcse import get_config
from jaxsim import train_lib
from jaxsim.checkpoint import Checkpointer
from jaxsim.paths import SENTEVAL_ROOT as SENTEVAL

ROOT = Path(__file__).resolve().parents[1]
if not SENTEVAL.is_dir():
    SENTEVAL = ROOT.parent / 'shared' / 'data' / 'senteval'


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    lines = (SENTEVAL / 'SNLI' / 's1.dev').read_text().splitlines()[:120]
    path = tmp_path_factory.mktemp('data') / 'corpus.txt'
    # Blank lines are part of real corpora; the reader must skip them.
    path.write_text('\n\n'.join(lines) + '\n\n')
    return path


def _cfg(corpus, **kw):
    c = get_config()
    c.update(train_file=str(corpus), max_steps=4, checkpoint_every=2, **kw)
    return c


def _params_at(workdir, step):
    with Checkpointer(Path(workdir) / 'checkpoints', read_only=True) as ck:
        return jax.tree.map(np.asarray, ck.restore(step).state['params'])


def test_train_eval_checkpoint_and_exact_resume(corpus, tmp_path):
    a = tmp_path / 'a'
    c = _cfg(corpus, senteval_root=str(SENTEVAL), eval_every=2, eval_test=True)
    r = train_lib.train_and_evaluate(c, a, progress=False)
    assert r.steps == 4 and np.isfinite(r.final_loss) and r.stopped is None
    assert [s for s, _ in r.dev_curve] == [0, 2, 4]
    assert all(-100 <= v <= 100 for _, v in r.dev_curve)
    assert r.best_step in (0, 2, 4) and r.test_at_best is not None
    rows = [json.loads(x) for x in (a / 'metrics.jsonl').read_text().splitlines()]
    losses = {m['step']: m['loss'] for m in rows if 'loss' in m}
    assert sorted(losses) == [1, 2, 3, 4]
    assert any('stsb_dev' in m for m in rows)
    cfg = json.loads((a / 'config.json').read_text())
    assert cfg['pooler'] == 'cls' and cfg['mlp_only_train'] is True
    assert Path(cfg['model'], 'model.safetensors').is_file()  # random base saved for export
    assert (a / 'tb').is_dir() and any((a / 'tb').iterdir())

    # Exact resume: drop the last checkpoint, rerun, and land on the same params and losses.
    b = tmp_path / 'b'
    shutil.copytree(a, b)
    shutil.rmtree(b / 'checkpoints' / '4')
    (b / 'metrics.jsonl').write_text('')
    c_b = _cfg(corpus, senteval_root='', eval_every=0)
    rb = train_lib.train_and_evaluate(c_b, b, progress=False)
    assert rb.steps == 4
    rows_b = [json.loads(x) for x in (b / 'metrics.jsonl').read_text().splitlines()]
    losses_b = {m['step']: m['loss'] for m in rows_b if 'loss' in m}
    assert sorted(losses_b) == [3, 4]
    for s in (3, 4):
        np.testing.assert_allclose(losses_b[s], losses[s], rtol=1e-6)
    pa, pb = _params_at(a, 4), _params_at(b, 4)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_allclose(x, y, atol=1e-7)


def test_non_finite_loss_stops_with_last_good_checkpoint(corpus, tmp_path, monkeypatch):
    # Poison every example holding one token id; place it so that step 3's batch holds it.
    c = _cfg(corpus, senteval_root='', eval_every=0)
    cfg = train_lib.TrainConfig.from_dict(c)
    sentences = [s for s in corpus.read_text().splitlines() if s.strip()]
    perm = np.random.default_rng([cfg.seed, 0]).permutation(len(sentences))
    sentences[perm[2 * cfg.batch_size]] = 'zebra zebra zebra'
    data = tmp_path / 'poisoned.txt'
    data.write_text('\n'.join(sentences))
    bundle = train_lib.build_model(train_lib.TrainConfig.from_dict(_cfg(data)))
    poison = bundle.tokenizer('zebra')['input_ids'][1]
    real = train_lib.make_loss_fn

    def poisoned(module, cfg):
        fn = real(module, cfg)

        def loss_fn(params, batch, key):
            loss, aux = fn(params, batch, key)
            return jnp.where(jnp.any(batch['input_ids'] == poison), jnp.nan, loss), aux
        return loss_fn

    monkeypatch.setattr(train_lib, 'make_loss_fn', poisoned)
    r = train_lib.train_and_evaluate(_cfg(data, senteval_root='', eval_every=0),
                                     tmp_path / 'w', progress=False)
    assert r.stopped is not None and 'step 3' in r.stopped
    with Checkpointer(tmp_path / 'w' / 'checkpoints', read_only=True) as ck:
        assert ck.all_steps() == [2]
        params = ck.restore(2).state['params']
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    rows = [json.loads(x) for x in (tmp_path / 'w' / 'metrics.jsonl').read_text().splitlines()]
    assert [m['step'] for m in rows] == [1, 2]


def test_cli_rejects_bad_batch_and_unknown_key(corpus, tmp_path):
    base = [sys.executable, str(ROOT / 'train.py'), '--config', str(ROOT / 'configs' /
            'tiny_unsup_simcse.py'), '--workdir', str(tmp_path / 'w'), '--noprogress',
            f'--config.train_file={corpus}']
    p = subprocess.run(base + ['--config.batch_size=15', '--config.grad_accum_steps=2'],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and 'not divisible by grad_accum_steps' in p.stderr
    p = subprocess.run(base + ['--config.train_file=/nonexistent/x.txt'],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and '/nonexistent/x.txt: corpus file not found' in p.stderr


def test_run_seeds_reports_mean_and_sample_std(tmp_path, monkeypatch):
    scores = {1: (80.0, 78.0), 2: (82.0, 79.0), 3: (84.0, 83.0)}
    seen = []

    def fake(cfg, workdir, progress=True):
        seen.append((cfg.seed, Path(workdir).name))
        dev, test = scores[cfg.seed]
        return train_lib.TrainResult(steps=3, final_loss=1.0, best_step=3, best_dev=dev,
                                     test_at_best=test, dev_curve=[(3, dev)], wall_s=1.0)

    monkeypatch.setattr(train_lib, 'train_and_evaluate', fake)
    s = train_lib.run_seeds(train_lib.TrainConfig(train_file='x'), tmp_path, [1, 2, 3])
    assert seen == [(1, 'seed_1'), (2, 'seed_2'), (3, 'seed_3')]
    assert s['stsb_dev_best']['mean'] == pytest.approx(82.0)
    assert s['stsb_dev_best']['std'] == pytest.approx(2.0)  # sample std (ddof=1)
    assert s['stsb_test_at_best']['mean'] == pytest.approx(80.0)
    assert json.loads((tmp_path / 'seeds_summary.json').read_text())['seeds'] == [1, 2, 3]
    assert '82.00 +- 2.00' in train_lib.format_seed_summary(s)
