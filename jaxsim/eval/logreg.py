"""SentEval's logistic-regression classifier, trained many at a time in JAX.

SentEval (facebookresearch/SentEval, `senteval/tools/classifier.py`, `MLP` with `nhid=0`)
trains one `nn.Linear(D, K)` at a time with softmax cross-entropy and `torch.optim.Adam`
(lr 1e-3, betas (0.9, 0.999), eps 1e-8), the L2 penalty as Adam's coupled `weight_decay` on
weight and bias. The cross-validation protocols train hundreds of these (MR: 10 outer folds x
4 L2 values x 10 inner folds), one after the other.

Here they train together: a jitted round (`epoch_size` epochs, then dev accuracy) runs a
chunk of problems (train/dev row sets) x all L2 values, a problem's minibatch gathered once
and shared by its L2 values; problems whose classifiers have all stopped drop out. What
SentEval's results depend on is kept exactly:

  - batch order: `np.random.seed(seed)` is reset for every classifier, then one
    `np.random.permutation(len(train))` per epoch; with `validation_split` the dev rows are
    the first `int(split * n)` of one permutation drawn before the epochs. The same NumPy
    streams are replayed here (classifiers with the same stream share it).
  - the loss is the batch mean: SentEval sets `loss_fn.size_average = False` after building
    `nn.CrossEntropyLoss()`, which current PyTorch ignores (the reduction is fixed at
    construction), so the mean is what runs.
  - the last, partial batch of an epoch is a step of its own.
  - early stopping: every `epoch_size` epochs, score on dev; keep the best model (strictly
    better accuracy only); after `tenacity + 1` rounds without improvement (counted over the
    whole run, not consecutively) stop; never start a round past `max_epoch` epochs.
  - every classifier starts from the same weights (PyTorch reseeds before each `nn.Linear`):
    PyTorch's own draw, reproduced bit for bit with NumPy (`torch_like_init`). MRPC's test
    accuracy moves by up to ~0.6 points with another draw of the same distribution.

Only float summation order differs; on the shipped tasks every score equals SentEval's.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxsim.errors import JaxsimError


class ClassifierError(JaxsimError):
    """Bad classifier input: shapes, labels, non-finite features, too little data."""


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
    """SentEval's classifier settings; the defaults are SimCSE's `evaluation.py --mode test`.

    Attributes:
      batch_size: minibatch rows.
      tenacity: rounds without dev improvement tolerated before stopping.
      epoch_size: epochs per round (dev accuracy is checked once a round).
      max_epoch: no round starts after this many epochs.
      learning_rate, b1, b2, eps: Adam, PyTorch's defaults.
      l2_grid: the L2 values searched (SentEval with usepytorch: 1e-5 .. 1e-2).
      validation_split: fraction of train carved out as dev when a problem has no dev rows.
      seed: the NumPy seed of the batch order and PyTorch's seed of the initial weights.
    """

    batch_size: int = 64
    tenacity: int = 5
    epoch_size: int = 4
    max_epoch: int = 200
    learning_rate: float = 1e-3
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    l2_grid: tuple[float, ...] = (1e-5, 1e-4, 1e-3, 1e-2)
    validation_split: float = 0.05
    seed: int = 1111

    def __post_init__(self):
        for name in ('batch_size', 'epoch_size'):
            if getattr(self, name) < 1:
                raise ClassifierError(f'ClassifierConfig.{name} must be >= 1')
        if self.tenacity < 0 or self.max_epoch < 0:
            raise ClassifierError('ClassifierConfig: tenacity and max_epoch must be >= 0')
        if not self.l2_grid or any(v < 0 for v in self.l2_grid):
            raise ClassifierError(f'ClassifierConfig.l2_grid must be non-empty and >= 0, '
                                  f'got {self.l2_grid}')
        if not 0 < self.validation_split < 1:
            raise ClassifierError('ClassifierConfig.validation_split must be in (0, 1)')


# ---------------------------------------------------------------------------------------
# Problems and results.
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Problem:
    """One training set-up, shared by every L2 value of the grid.

    Attributes:
      train: [T] rows of the feature matrix, in the order SentEval's train matrix has them.
      dev: [V] rows scored for early stopping, or None to carve `validation_split` of
        `train` with the seeded permutation (SentEval's `validation_split`).
    """

    train: np.ndarray
    dev: Optional[np.ndarray] = None


@dataclasses.dataclass(frozen=True)
class FitResult:
    """The best-on-dev classifiers of `fit`, one per (problem, L2 value).

    Attributes:
      weight: [P, R, D, K] float32.
      bias: [P, R, K] float32.
      dev_correct: [P, R] correct dev predictions of the kept model.
      dev_size: [P] dev rows per problem.
      epochs: [P, R] epochs trained before stopping.
      rounds: rounds run (the longest classifier's epochs / epoch_size).
    """

    weight: np.ndarray
    bias: np.ndarray
    dev_correct: np.ndarray
    dev_size: np.ndarray
    epochs: np.ndarray
    rounds: int

    @property
    def dev_accuracy(self) -> np.ndarray:
        """[P, R] dev accuracy in [0, 1]."""
        return self.dev_correct / self.dev_size[:, None]


def predict(weight, bias, x) -> np.ndarray:
    """Class ids argmax(x @ weight + bias): weight [D, K], bias [K], x [N, D] -> [N]."""
    logits = np.asarray(x, np.float32) @ np.asarray(weight) + np.asarray(bias)
    return np.argmax(logits, axis=-1)


def torch_like_init(dim: int, num_classes: int, seed: int) -> dict[str, np.ndarray]:
    """The weights `torch.manual_seed(seed); nn.Linear(dim, num_classes)` starts from, exactly.

    PyTorch's CPU generator is MT19937 seeded like NumPy's legacy `RandomState(seed)`; a float32
    `uniform_(lo, hi)` takes one 32-bit draw per element, in memory order, as
    `(draw & (2**24 - 1)) * 2**-24 * (hi - lo) + lo` in float64, rounded to float32. The weight
    ([K, D], kaiming_uniform with a=sqrt(5), i.e. bound 1/sqrt(D)) is drawn before the bias
    (bound 1/sqrt(D)).

    Returns:
      {'w': [D, K], 'b': [K]} float32.
    """
    draws = np.random.RandomState(seed).randint(0, 2**32, size=num_classes * dim + num_classes,
                                                dtype=np.uint32)
    unit = (draws & np.uint32(2**24 - 1)).astype(np.float64) * 2.0**-24

    def uniform(u, bound):
        lo, hi = np.float32(-bound), np.float32(bound)     # (to - from) is float32 in ATen
        return (u * np.float64(hi - lo) + np.float64(lo)).astype(np.float32)

    # Python-float arithmetic in torch.nn.init's order (kaiming_uniform_, a = sqrt(5)).
    gain = math.sqrt(2.0 / (1 + math.sqrt(5) ** 2))
    weight = uniform(unit[:num_classes * dim], math.sqrt(3.0) * (gain / math.sqrt(dim)))
    bias = uniform(unit[num_classes * dim:], 1 / math.sqrt(dim))
    return {'w': weight.reshape(num_classes, dim).T.copy(), 'b': bias}


# ---------------------------------------------------------------------------------------
# The jitted round: epoch_size epochs of minibatch Adam, then dev accuracy.
# ---------------------------------------------------------------------------------------


def _adam(l2, cfg: ClassifierConfig) -> optax.GradientTransformation:
    # torch.optim.Adam(weight_decay=l2): the penalty is added to the gradient before the moments.
    return optax.chain(optax.add_decayed_weights(l2),
                       optax.scale_by_adam(cfg.b1, cfg.b2, cfg.eps),
                       optax.scale(-cfg.learning_rate))


def _classifier_step(params, opt_state, l2, live, xb, yb, wb, cfg):
    """One Adam step of one classifier. xb [B, D], yb [B], wb [B] row weights (1/count or 0)."""

    def loss_fn(p):
        logits = xb @ p['w'] + p['b']                                   # [B, K]
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, yb) * wb)

    grads = jax.grad(loss_fn)(params)
    updates, new_opt = _adam(l2, cfg).update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(live, new, old)  # noqa: E731
    return jax.tree.map(keep, new_params, params), jax.tree.map(keep, new_opt, opt_state)


def _train_round(state, x, y, l2, active, rows, dev_rows, cfg: ClassifierConfig):
    """One round for C problems. state: params/opt/best trees with leading [C, R];
    rows [S, C, B] train rows (-1 pad); dev_rows [C, V] (-1 pad); active [C, R].
    Returns (state, dev correct [C, R])."""
    # vmap over L2 values (the batch is shared), then over problems.
    step = jax.vmap(functools.partial(_classifier_step, cfg=cfg),
                    in_axes=(0, 0, 0, 0, None, None, None))
    step = jax.vmap(step, in_axes=(0, 0, None, 0, 0, 0, 0))

    def body(carry, batch_rows):                                        # [C, B]
        params, opt = carry
        valid = batch_rows >= 0
        safe = jnp.maximum(batch_rows, 0)
        count = valid.sum(-1)                                           # [C]
        wb = valid / jnp.maximum(count, 1)[:, None]
        live = active & (count > 0)[:, None]                            # [C, R]
        return step(params, opt, l2, live, x[safe], y[safe], wb), None

    (params, opt), _ = jax.lax.scan(body, (state['params'], state['opt']), rows)

    def dev_correct(args):
        p, r = args                                                     # [R, ...], [V]
        valid = r >= 0
        xd = x[jnp.maximum(r, 0)]                                       # [V, D]
        logits = jnp.einsum('vd,rdk->rvk', xd, p['w']) + p['b'][:, None, :]
        hit = (jnp.argmax(logits, -1) == y[jnp.maximum(r, 0)]) & valid
        return hit.sum(-1)                                              # [R]

    correct = jax.lax.map(dev_correct, (params, dev_rows)).astype(jnp.int32)
    improved = active & (correct > state['best_correct'])
    pick = lambda new, old: jnp.where(  # noqa: E731
        improved.reshape(improved.shape + (1,) * (new.ndim - 2)), new, old)
    best = jax.tree.map(pick, params, state['best'])
    best_correct = jnp.where(improved, correct, state['best_correct'])
    return {'params': params, 'opt': opt, 'best': best, 'best_correct': best_correct}, correct


@functools.partial(jax.jit, static_argnames=('cfg',), donate_argnums=(0,))
def _train_chunk(state, ids, x, y, l2, active, rows, dev_rows, *, cfg: ClassifierConfig):
    """`_train_round` on the problems `ids` [C] of the full state (leading [P + 1, R])."""
    sub, correct = _train_round(jax.tree.map(lambda a: a[ids], state), x, y, l2, active, rows,
                                dev_rows, cfg)
    return jax.tree.map(lambda a, b: a.at[ids].set(b), state, sub), correct


# ---------------------------------------------------------------------------------------
# Host side: plans, batch order, early stopping.
# ---------------------------------------------------------------------------------------

# Problems per jitted call: chunks of this size stay on one thread, where all problems in one
# call had XLA split the ops over threads for more CPU per problem (docs/performance.md,
# "Figures the code relies on"). Chunks also let problems whose classifiers have all stopped
# drop out.
CHUNK = 16


def _plan(problem: Problem, n: int, cfg: ClassifierConfig, streams: dict):
    """(train rows in order, dev rows, stream key); draws the carve-out permutation."""
    train = np.asarray(problem.train, np.int64).reshape(-1)
    if train.size and (train.min() < 0 or train.max() >= n):
        raise ClassifierError(f'train rows out of range [0, {n})')
    # Classifiers with the same train size and carve-out see the same NumPy stream.
    key = (len(train), problem.dev is None)
    cut = int(cfg.validation_split * len(train))
    if key not in streams:
        rng = np.random.RandomState(cfg.seed)
        carve = rng.permutation(len(train)) if problem.dev is None else None
        streams[key] = (rng, carve, len(train) - cut if problem.dev is None else len(train))
    if problem.dev is None:
        carve = streams[key][1]
        train, dev = train[carve[cut:]], train[carve[:cut]]
    else:
        dev = np.asarray(problem.dev, np.int64).reshape(-1)
        if dev.size and (dev.min() < 0 or dev.max() >= n):
            raise ClassifierError(f'dev rows out of range [0, {n})')
    if len(train) == 0 or len(dev) == 0:
        raise ClassifierError(f'a classifier needs train and dev rows; got {len(train)} train '
                              f'and {len(dev)} dev rows')
    return train, dev, key


def _chunk_rows(plans, ids, perms, steps: int, cfg: ClassifierConfig) -> np.ndarray:
    """[epoch_size * steps, C, B] train rows of problems `ids` this round, -1 where a batch is
    short (and for padding ids >= len(plans))."""
    b, e = cfg.batch_size, cfg.epoch_size
    rows = np.full((e, len(ids), steps * b), -1, np.int32)
    for c, p in enumerate(ids):
        if p < len(plans):
            train, _, key = plans[p]
            for i, perm in enumerate(perms[key]):
                rows[i, c, :len(train)] = train[perm]
    # [E, C, steps*B] -> [E, steps, C, B] -> [E*steps, C, B]
    return rows.reshape(e, len(ids), steps, b).transpose(0, 2, 1, 3).reshape(
        e * steps, len(ids), b)


def _pad_rows(rows: Sequence[np.ndarray]) -> np.ndarray:
    out = np.full((len(rows), max(len(r) for r in rows)), -1, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def fit(x, y, problems: Sequence[Problem], num_classes: int,
        cfg: ClassifierConfig = ClassifierConfig(),
        progress: Optional[Callable[[int, int], None]] = None) -> FitResult:
    """Trains one classifier per (problem, L2 value) as SentEval does; keeps the best on dev.

    Args:
      x: [N, D] features; problems index its rows.
      y: [N] class ids in [0, num_classes).
      problems: train/dev row sets (see `Problem`).
      num_classes: K.
      cfg: the classifier settings.
      progress: called after every round with (classifiers done training, classifiers).

    Returns:
      The kept (best-on-dev) classifiers and their dev scores.
    """
    x = np.asarray(x, np.float32)
    y = np.asarray(y)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ClassifierError(f'features must be [N, D] and labels [N]; got {x.shape} and '
                              f'{y.shape}')
    if not np.isfinite(x).all():
        bad = int(np.argwhere(~np.isfinite(x))[0, 0])
        raise ClassifierError(f'features have non-finite values (first in row {bad})')
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0
                   or y.max() >= num_classes):
        raise ClassifierError(f'labels must be integers in [0, {num_classes})')
    if not problems:
        raise ClassifierError('no problems to fit')
    streams: dict = {}
    plans = [_plan(p, len(x), cfg, streams) for p in problems]
    num_p, num_r, dim = len(plans), len(cfg.l2_grid), x.shape[1]
    chunk = min(CHUNK, num_p)
    steps = max(-(-len(t) // cfg.batch_size) for t, _, _ in plans)
    init = torch_like_init(dim, num_classes, cfg.seed)  # PyTorch's own, for every classifier
    # One extra problem (index num_p) pads the last chunk; it never trains.
    params = jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a, jnp.float32),
                                                     (num_p + 1, num_r) + a.shape), init)
    l2 = jnp.asarray(cfg.l2_grid, jnp.float32)
    opt = jax.vmap(jax.vmap(lambda p, lam: _adam(lam, cfg).init(p)))(
        params, jnp.broadcast_to(l2, (num_p + 1, num_r)))
    state = {'params': params, 'opt': opt, 'best': jax.tree.map(jnp.copy, params),
             'best_correct': jnp.full((num_p + 1, num_r), -1, jnp.int32)}
    x_dev, y_dev = jnp.asarray(x), jnp.asarray(y, jnp.int32)
    dev_rows = _pad_rows([d for _, d, _ in plans] + [np.zeros(0, np.int64)])

    active = np.ones((num_p + 1, num_r), bool)
    active[num_p] = False
    best = np.full((num_p + 1, num_r), -1, np.int64)
    misses = np.zeros((num_p + 1, num_r), np.int64)
    epochs = np.zeros((num_p + 1, num_r), np.int64)
    rounds = 0
    while active.any() and cfg.epoch_size * rounds <= cfg.max_epoch:
        # Every stream advances once a round, whichever of its classifiers still train.
        perms = {key: [rng.permutation(n) for _ in range(cfg.epoch_size)]
                 for key, (rng, _, n) in streams.items()}
        live = np.flatnonzero(active.any(1))
        correct = np.zeros_like(best)
        for start in range(0, len(live), chunk):
            ids = np.full(chunk, num_p)
            ids[:len(live[start:start + chunk])] = live[start:start + chunk]
            state, c = _train_chunk(state, jnp.asarray(ids), x_dev, y_dev, l2,
                                    jnp.asarray(active[ids]),
                                    jnp.asarray(_chunk_rows(plans, ids, perms, steps, cfg)),
                                    jnp.asarray(dev_rows[ids]), cfg=cfg)
            correct[ids] = np.asarray(c)
        epochs[active] += cfg.epoch_size
        improved = active & (correct > best)
        best = np.where(improved, correct, best)
        missed = active & ~improved
        active = active & ~(missed & (misses >= cfg.tenacity))
        misses = misses + missed
        rounds += 1
        if progress is not None:
            progress(int(num_p * num_r - active.sum()), num_p * num_r)
    return FitResult(weight=np.asarray(state['best']['w'])[:num_p],
                     bias=np.asarray(state['best']['b'])[:num_p],
                     dev_correct=np.asarray(state['best_correct'])[:num_p],
                     dev_size=np.asarray([len(d) for _, d, _ in plans]),
                     epochs=epochs[:num_p], rounds=rounds)
