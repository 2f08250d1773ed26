"""The transfer-task classifier and protocols against PyTorch / scikit-learn references."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.model_selection import StratifiedKFold

import jaxsim
from jaxsim.data.transfer import LabeledText
from jaxsim.errors import JaxsimError
from jaxsim.eval import logreg, transfer
from jaxsim.eval.logreg import ClassifierConfig, ClassifierError, Problem
from jaxsim.storage.paths import SENTEVAL_ROOT

# The references run thousands of tiny steps; threads only add contention.
torch.set_num_threads(1)

# Short runs keep the references fast; the logic (rounds, tenacity, carve-out) is the same.
FAST = ClassifierConfig(epoch_size=2, tenacity=2, max_epoch=16, l2_grid=(1e-5, 3e-2),
                        batch_size=16)


def torch_reference_fit(x, y, train, dev, l2, cfg: ClassifierConfig):
    """SentEval's MLP(nhid=0).fit, written out with PyTorch: NumPy-seeded batch order,
    optional validation_split carve-out, Adam with coupled weight decay, early stopping."""
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    xt, yt = x[train], y[train]
    if dev is None:
        perm = np.random.permutation(len(xt))
        cut = int(cfg.validation_split * len(xt))
        xt, yt, xd, yd = xt[perm[cut:]], yt[perm[cut:]], xt[perm[:cut]], yt[perm[:cut]]
    else:
        xd, yd = x[dev], y[dev]
    model = torch.nn.Linear(x.shape[1], int(y.max()) + 1)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.learning_rate, weight_decay=l2)
    loss_fn = torch.nn.CrossEntropyLoss()
    xt, yt, xd, yd = map(torch.as_tensor, (xt, yt, xd, yd))
    epoch, best, misses, stop, kept = 0, -1, 0, False, None
    while not stop and epoch <= cfg.max_epoch:
        for _ in range(cfg.epoch_size):
            perm = np.random.permutation(len(xt))
            for i in range(0, len(xt), cfg.batch_size):
                idx = torch.as_tensor(perm[i:i + cfg.batch_size])
                loss = loss_fn(model(xt[idx]), yt[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        epoch += cfg.epoch_size
        with torch.no_grad():
            correct = int((model(xd).argmax(1) == yd).sum())
        if correct > best:
            best, kept = correct, copy.deepcopy(model)
        else:
            stop = misses >= cfg.tenacity
            misses += 1
    return kept.weight.detach().numpy().T, kept.bias.detach().numpy(), best, epoch


def _blobs(n, dim, classes, spread, seed):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, dim)) * 2
    y = rng.integers(0, classes, n)
    return (centers[y] + spread * rng.normal(size=(n, dim))).astype(np.float32), y


def _predict_ref(x, w, b):
    return np.argmax(x @ w + b, axis=1)


# ---------------------------------------------------------------------------------------
# Building blocks.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_stratified_kfold_matches_sklearn(seed):
    rng = np.random.default_rng(seed)
    y = rng.choice([7, 3, 5], size=int(rng.integers(40, 300)), p=[0.5, 0.3, 0.2])
    for n_splits, random_state in [(10, 1111), (3, 1111), (5, 42)]:
        ours = transfer.stratified_kfold(y, n_splits, random_state)
        ref = StratifiedKFold(n_splits, shuffle=True, random_state=random_state).split(y, y)
        for (a, b), (c, d) in zip(ours, ref, strict=True):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, d)


def test_torch_like_init_is_pytorchs_linear_init():
    for dim, classes, seed in [(384, 2, 1111), (768, 2, 1111), (19, 6, 3)]:
        torch.manual_seed(seed)
        layer = torch.nn.Linear(dim, classes)
        init = logreg.torch_like_init(dim, classes, seed)
        np.testing.assert_array_equal(init['w'], layer.weight.detach().numpy().T)
        np.testing.assert_array_equal(init['b'], layer.bias.detach().numpy())


def test_fit_replays_senteval_classifier():
    """Every (problem, L2) classifier equals SentEval's PyTorch loop: weights, dev score, epochs.
    Covers partial batches (train sizes not multiples of 16), 3 classes, a given dev set and
    the 5% carve-out, and classifiers stopping at different rounds."""
    x, y = _blobs(230, 7, 3, spread=2.5, seed=0)
    problems = [Problem(np.arange(0, 170), np.arange(170, 230)),
                Problem(np.arange(30, 230)),
                Problem(np.arange(0, 199)[::-1].copy(), np.arange(199, 230))]
    fit = logreg.fit(x, y, problems, 3, FAST)
    assert fit.epochs.min() < fit.epochs.max()           # early stopping differs by classifier
    for p, prob in enumerate(problems):
        for r, l2 in enumerate(FAST.l2_grid):
            w, b, best, epochs = torch_reference_fit(x, y, prob.train, prob.dev, l2, FAST)
            np.testing.assert_allclose(fit.weight[p, r], w, atol=2e-5)
            np.testing.assert_allclose(fit.bias[p, r], b, atol=2e-5)
            assert fit.dev_correct[p, r] == best and fit.epochs[p, r] == epochs, (p, r)
    assert fit.dev_size.tolist() == [60, int(0.05 * 200), 31]


@pytest.mark.parametrize('spread', [0.3, 3.0])
def test_fit_accuracy_close_to_sklearn_logistic_regression(spread):
    """Separable (spread 0.3) and overlapping (3.0) classes: held-out accuracy as sklearn's."""
    x, y = _blobs(3000, 12, 4, spread=spread, seed=1)
    cfg = ClassifierConfig(l2_grid=(1e-5,))
    fit = logreg.fit(x, y, [Problem(np.arange(2000), np.arange(2000, 2400))], 4, cfg)
    ours = np.mean(logreg.predict(fit.weight[0, 0], fit.bias[0, 0], x[2400:]) == y[2400:])
    ref = LogisticRegression(C=1e4, max_iter=2000).fit(x[:2000], y[:2000]).score(x[2400:],
                                                                                 y[2400:])
    assert abs(ours - ref) <= 0.02, (ours, ref)
    assert ours > (0.99 if spread < 1 else 0.5)


def test_fit_rejects_bad_input():
    x, y = _blobs(50, 3, 2, 1.0, 0)
    bad = x.copy()
    bad[7, 1] = np.nan
    with pytest.raises(ClassifierError, match='non-finite values .first in row 7'):
        logreg.fit(bad, y, [Problem(np.arange(50))], 2, FAST)
    with pytest.raises(ClassifierError, match=r'labels must be integers in \[0, 2\)'):
        logreg.fit(x, y + 1, [Problem(np.arange(50))], 2, FAST)
    with pytest.raises(ClassifierError, match='needs train and dev rows; got 9 train and 0 dev'):
        logreg.fit(x, y, [Problem(np.arange(9))], 2, FAST)
    with pytest.raises(ClassifierError, match=r'train rows out of range'):
        logreg.fit(x, y, [Problem(np.arange(60))], 2, FAST)
    assert issubclass(ClassifierError, JaxsimError)


def test_f1_and_order():
    rng = np.random.default_rng(0)
    t, p = rng.integers(0, 2, 300), rng.integers(0, 2, 300)
    assert transfer.f1_x100(t, p) == round(100 * f1_score(t, p), 2)
    split = LabeledText(['b c', 'a', 'x y', 'q', 'z z'], None, np.array([1, 1, 0, 0, 1]))
    # (tokens, label) ascending; ties keep file order.
    assert transfer.senteval_order(split).tolist() == [3, 1, 2, 0, 4]
    pairs = LabeledText(['a b', 'a', 'a'], ['c', 'd e', 'd'], np.array([0, 1, 1]))
    assert transfer.senteval_order(pairs).tolist() == [2, 1, 0]


# ---------------------------------------------------------------------------------------
# Protocols against SentEval's validation.py, written out with the reference fit.
# ---------------------------------------------------------------------------------------


def _ref_scores(x, y, splits, cfg):
    """[R] SentEval-rounded mean dev accuracy x100 over (train, dev) splits of x."""
    return [round(100 * np.mean([torch_reference_fit(x, y, a, b, l2, cfg)[2] / len(b)
                                 for a, b in splits]), 2) for l2 in cfg.l2_grid]


def test_cross_validate_matches_senteval_inner_kfold():
    x, y = _blobs(150, 5, 2, spread=3.0, seed=2)
    out = transfer.cross_validate(x, y, 2, FAST, kfold=3)
    skf = StratifiedKFold(3, shuffle=True, random_state=1111)
    fold_acc, dev = [], []
    for train, test in skf.split(x, y):
        inner = [(train[a], train[b]) for a, b in skf.split(x[train], y[train])]
        scores = _ref_scores(x, y, inner, FAST)
        r = int(np.argmax(scores))
        dev.append(scores[r])
        w, b, _, _ = torch_reference_fit(x, y, train, None, FAST.l2_grid[r], FAST)
        fold_acc.append(round(100 * np.mean(_predict_ref(x[test], w, b) == y[test]), 2))
    assert out['fold_acc'] == fold_acc
    assert out['acc'] == round(np.mean(fold_acc), 2) and out['devacc'] == round(np.mean(dev), 2)


def test_cv_then_test_and_dev_then_test_match_senteval():
    x, y = _blobs(260, 5, 3, spread=3.0, seed=3)
    tr, te = np.arange(200), np.arange(200, 260)
    out = transfer.cv_then_test(x[tr], y[tr], x[te], y[te], 3, FAST, kfold=3)
    folds = list(StratifiedKFold(3, shuffle=True, random_state=FAST.seed).split(x[tr], y[tr]))
    scores = _ref_scores(x, y, folds, FAST)
    r = int(np.argmax(scores))
    w, b, _, _ = torch_reference_fit(x, y, tr, None, FAST.l2_grid[r], FAST)
    assert out['dev_scores'] == scores and out['l2'] == FAST.l2_grid[r]
    assert out['acc'] == round(100 * np.mean(_predict_ref(x[te], w, b) == y[te]), 2)

    dv = np.arange(150, 200)
    out = transfer.dev_then_test(x[:150], y[:150], x[dv], y[dv], x[te], y[te], 3, FAST)
    ref = [torch_reference_fit(x, y, np.arange(150), dv, l2, FAST) for l2 in FAST.l2_grid]
    scores = [round(100 * r[2] / len(dv), 2) for r in ref]
    r = int(np.argmax(scores))
    assert out['dev_scores'] == scores
    assert out['acc'] == round(100 * np.mean(_predict_ref(x[te], *ref[r][:2]) == y[te]), 2)


# ---------------------------------------------------------------------------------------
# End to end.
# ---------------------------------------------------------------------------------------


def test_evaluate_transfer_on_real_subset(tmp_path, bundled):
    """MR (first 60 lines of each file) through the bundled model, and MRPC with a fake
    encoder; result fields, timings, table and JSON."""
    for name in ('rt-polarity.pos', 'rt-polarity.neg'):
        lines = (SENTEVAL_ROOT / 'MR' / name).read_bytes().split(b'\n')[:60]
        (tmp_path / 'MR').mkdir(exist_ok=True)
        (tmp_path / 'MR' / name).write_bytes(b'\n'.join(lines) + b'\n')
    calls = []

    def encode(sentences):
        calls.append(len(sentences))
        return jaxsim.encode(bundled, sentences, pooler='avg')

    mr = transfer.evaluate_transfer('mr', encode, tmp_path, model='minilm')
    assert calls == [120] and mr.task == 'MR' and mr.n_dev == mr.n_test == 120
    assert 60 <= mr.acc <= 100 and mr.f1 is None
    assert len(mr.details['fold_acc']) == 10 and len(mr.details['l2']) == 10
    assert set(mr.details['timing']) >= {'total_s', 'classifier_s'}  # recorded, not asserted
    assert set(mr.details['files']) == {'MR/rt-polarity.pos', 'MR/rt-polarity.neg'}

    head = 'Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n'
    rng = np.random.default_rng(0)
    for split, n in (('train', 400), ('test', 100)):
        rows = []
        for i, (k, first) in enumerate(zip(rng.integers(0, 2, n), rng.integers(0, 2, n))):
            pair = ['same', 'same'] if k else (['other', 'same'] if first else ['same', 'other'])
            rows.append(f'{int(k)}\t1\t2\tw{i} {pair[0]}\tw{i} {pair[1]}')
        (tmp_path / 'MRPC').mkdir(exist_ok=True)
        (tmp_path / 'MRPC' / f'msr_paraphrase_{split}.txt').write_text(head + '\n'.join(rows))
    # Word vectors averaged; 'other' stands out in one coordinate, in either sentence of a
    # non-paraphrase: u - v is +4 or -4 there (no linear rule on it passes ~75%), |u - v| is 4.
    word_vec = {'same': np.zeros(6), 'other': 8 * np.eye(6)[0]}

    def fake(sentences):
        vec = lambda w: word_vec.setdefault(w, 0.1 * rng.normal(size=6))  # noqa: E731
        return np.stack([np.mean([vec(w) for w in s.split()], 0) for s in sentences])

    mrpc = transfer.evaluate_transfer('MRPC', fake, tmp_path, model='minilm')
    assert mrpc.acc >= 95 and mrpc.f1 >= 95 and (mrpc.n_dev, mrpc.n_test) == (400, 100)

    table = transfer.format_transfer_table([mr, mrpc])
    assert '| Model | MR | MRPC | Avg. |' in table
    assert f'| minilm | {mr.acc:.2f} | {mrpc.acc:.2f} | {(mr.acc + mrpc.acc) / 2:.2f} |' in table
    assert f'MRPC F1 x100 (minilm): {mrpc.f1:.2f}' in table
    transfer.write_transfer_json(tmp_path / 'out' / 'transfer.json', [mr, mrpc])
    records = json.loads((tmp_path / 'out' / 'transfer.json').read_text())
    assert [r['task'] for r in records] == ['MR', 'MRPC'] and records[1]['f1'] == mrpc.f1

    with pytest.raises(ClassifierError, match=r'MR: encode_fn returned shape \(3, 4\)'):
        transfer.evaluate_transfer('MR', lambda s: np.zeros((3, 4)), tmp_path)
