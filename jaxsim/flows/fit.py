"""Maximum-likelihood fitting of a flow on cached (frozen) embeddings.

The whole epoch runs inside jitted `lax.scan`s over precomputed batch indices, so Python only
touches the loop at held-out evaluations. Everything random (train/held-out split, actnorm init
batch, parameter init, per-epoch shuffles) derives from one explicit PRNG key, so a seed gives
bit-identical results. All inputs are checked before anything is traced.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from jaxsim import calibration
from jaxsim.flows.config import FlowConfig
from jaxsim.flows.models import make_flow
from jaxsim.flows.prior import nats_to_bits_per_dim, nll_nats


def check_embeddings(x: Any, what: str = 'embeddings') -> np.ndarray:
    """Validates a [N, D] matrix of embeddings (finite, non-empty) as float32 numpy."""
    return calibration.check_embeddings(x, what, np.float32, min_rows=1)


@dataclasses.dataclass(frozen=True)
class FitPlan:
    """How the rows and steps are laid out; computed (and checked) before any tracing."""

    num_train: int
    num_val: int
    steps_per_chunk: int
    chunks_per_epoch: int
    init_rows: int


def plan_fit(num_rows: int, dim: int, config: FlowConfig) -> FitPlan:
    """Checks that `config` fits `num_rows` x `dim` data and lays out the fit.

    Raises:
      ValueError: the architecture cannot take `dim` channels, or there are too few rows for the
        held-out split / batch size.
    """
    config.check_dim(dim)
    num_val = int(round(num_rows * config.val_fraction)) if config.val_fraction > 0 else 0
    if config.val_fraction > 0:
        num_val = max(num_val, 1)
    num_train = num_rows - num_val
    if num_train < config.batch_size:
        raise ValueError(
            f'FlowConfig does not fit the data: {num_rows} rows minus {num_val} held out '
            f'(val_fraction={config.val_fraction}) leave {num_train} training rows, fewer than '
            f'batch_size={config.batch_size}.')
    if num_train < 2:
        raise ValueError(f'flow fitting needs at least 2 training rows; got {num_train}')
    steps_per_epoch = num_train // config.batch_size
    # Equal-length chunks so each epoch compiles one scan; the < 1/evals_per_epoch leftover
    # batches are dropped (each epoch reshuffles, so no row is systematically skipped).
    chunks = min(config.evals_per_epoch, steps_per_epoch)
    return FitPlan(num_train=num_train, num_val=num_val, steps_per_chunk=steps_per_epoch // chunks,
                   chunks_per_epoch=chunks, init_rows=min(config.init_batch_size, num_train))


def _check_not_diverged(nll: float, x: np.ndarray, config: FlowConfig, when: str) -> None:
    """Raises FloatingPointError for a non-finite or absurd NLL (nats per example).

    A sane flow on standardized data sits near a unit Gaussian (~1.4 nats per dim); thousands of
    nats per dim mean the fit blew up (seen: RealNVP with actnorm on exactly constant columns),
    and carrying on would only return garbage latents.
    """
    dim = x.shape[1]
    if math.isfinite(nll) and nll / dim <= 1e3:
        return
    spread = x.std(axis=0)
    constant = np.flatnonzero(spread <= 1e-6 * max(float(np.median(spread)), 1e-30))
    raise FloatingPointError(
        f'flow fit diverged {when}: NLL {nll:.3g} nats ({nll / dim:.3g} per dim), '
        f'arch={config.arch!r}, coupling={config.coupling!r}'
        + (f'; the data has {constant.size} constant column(s) {constant[:8].tolist()}'
           if constant.size else '')
        + '. Try a lower learning_rate, an additive coupling, or the reference Glow '
          '(configs/flow_glow.py), which handles constant columns.')


@dataclasses.dataclass(frozen=True)
class FitResult:
    """Output of `fit_flow`.

    Attributes:
      params: the fitted params (the best held-out NLL if there is a held-out split).
      history: one dict per evaluation: step, epoch, train_nll, val_nll (nats per example, NaN
        without held-out rows), val_bpd (bits/dim).
      best_step: optimizer step of `params`.
      stopped_early: True if patience ran out before `max_epochs`.
      init_nll: held-out (or training) NLL in nats right after actnorm init.
    """

    params: Any
    history: list[dict[str, float]]
    best_step: int
    stopped_early: bool
    init_nll: float


def _mean_nll(model: nn.Module, params, x: jax.Array) -> jax.Array:
    z, logdet = model.apply({'params': params}, x, method='forward')
    return jnp.mean(nll_nats(z, logdet))


def init_flow_params(model: nn.Module, x_init: jax.Array, key: jax.Array):
    """Random init, then data-dependent actnorm init on x_init [rows, dim] (jit-able)."""
    variables = model.init(key, x_init[:1], method='forward')
    _, variables = model.apply(variables, x_init, method='init_from_batch', mutable=['params'])
    return variables['params']


@functools.lru_cache(maxsize=16)
def _jitted(config: FlowConfig, dim: int):
    """Jitted init / train-chunk / eval functions, cached per (config, dim) so that refitting
    (e.g. one flow per eval task) does not recompile."""
    model = make_flow(config, dim)
    tx = optax.adam(config.learning_rate)
    loss_and_grad = jax.value_and_grad(lambda p, xb: _mean_nll(model, p, xb))

    def init(key, x_init, x_eval):
        params = init_flow_params(model, x_init, key)
        return params, tx.init(params), _mean_nll(model, params, x_eval)

    def train_chunk(params, opt_state, x_train, batch_idx, x_eval):
        """batch_idx: [steps, batch] rows of x_train -> new state, mean training NLL and the NLL
        on x_eval (evaluated in the same program: one compilation fewer)."""

        def step(carry, idx):
            p, s = carry
            loss, grads = loss_and_grad(p, x_train[idx])
            updates, s = tx.update(grads, s, p)
            return (optax.apply_updates(p, updates), s), loss

        (params, opt_state), losses = jax.lax.scan(step, (params, opt_state), batch_idx)
        return params, opt_state, jnp.mean(losses), _mean_nll(model, params, x_eval)

    return model, jax.jit(init), jax.jit(train_chunk)


def _rng(key: jax.Array, *tags: int) -> np.random.Generator:
    """A NumPy generator seeded by a JAX key (and integer tags, e.g. the epoch): host-side
    shuffles stay a pure function of the key without compiling device permutations."""
    seed = [int(v) for v in np.asarray(jax.random.key_data(key)).ravel()] + [int(t) for t in tags]
    return np.random.default_rng(seed)


def fit_flow(x: np.ndarray, config: FlowConfig, key: jax.Array,
             progress: bool = True) -> FitResult:
    """Fits the flow of `config` by maximum likelihood on the rows of x.

    Args:
      x: [N, D] embeddings (numpy or array-like), finite.
      config: architecture and optimisation settings.
      key: PRNG key; all randomness derives from it.
      progress: show a tqdm bar with the held-out NLL.

    Returns:
      A FitResult; `make_flow(config, D)` applies its params.
    """
    x = check_embeddings(x)
    n, dim = x.shape
    plan = plan_fit(n, dim, config)
    _, init_fn, train_chunk = _jitted(config, dim)
    split_key, init_key, param_key, shuffle_key = jax.random.split(key, 4)

    order = _rng(split_key).permutation(n)
    x_val = jnp.asarray(x[order[: plan.num_val]])  # [num_val, D]
    x_train = jnp.asarray(x[order[plan.num_val:]])  # [num_train, D]
    init_idx = _rng(init_key).permutation(plan.num_train)[: plan.init_rows]
    eval_x = x_val if plan.num_val else x_train
    params, opt_state, init_nll = init_fn(param_key, x_train[init_idx], eval_x)
    init_nll = float(init_nll)
    _check_not_diverged(init_nll, x, config, 'at initialization')
    best_nll, best_params, best_step = math.inf, params, 0
    history: list[dict[str, float]] = []
    bad_evals, stopped_early, step = 0, False, 0
    per_epoch = plan.steps_per_chunk * plan.chunks_per_epoch
    total = config.max_epochs * plan.chunks_per_epoch
    bar = tqdm.tqdm(total=total, desc='flow fit', unit='chunk', disable=not progress, leave=False)
    try:
        for epoch in range(config.max_epochs):
            perm = _rng(shuffle_key, epoch).permutation(plan.num_train)
            batches = perm[: per_epoch * config.batch_size].reshape(
                plan.chunks_per_epoch, plan.steps_per_chunk, config.batch_size)
            for c in range(plan.chunks_per_epoch):
                params, opt_state, train_nll, val_nll = train_chunk(
                    params, opt_state, x_train, batches[c], eval_x)
                step += plan.steps_per_chunk
                train_nll = float(train_nll)
                _check_not_diverged(train_nll, x, config, f'at step {step} (epoch {epoch})')
                val_nll = float(val_nll) if plan.num_val else math.nan
                history.append({'step': step, 'epoch': epoch, 'train_nll': train_nll,
                                'val_nll': val_nll,
                                'val_bpd': float(nats_to_bits_per_dim(val_nll, dim))})
                bar.update(1)
                bar.set_postfix(train_nll=f'{train_nll:.2f}', val_nll=f'{val_nll:.2f}')
                if not plan.num_val:
                    best_params, best_step = params, step
                elif val_nll < best_nll:
                    best_nll, best_params, best_step, bad_evals = val_nll, params, step, 0
                else:
                    bad_evals += 1
                    if bad_evals >= config.patience:
                        stopped_early = True
                        break
            if stopped_early:
                break
    finally:
        bar.close()
    return FitResult(params=best_params, history=history, best_step=best_step,
                     stopped_early=stopped_early, init_nll=init_nll)
