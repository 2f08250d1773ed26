"""Maximum-likelihood fitting of a flow on embeddings, with the batch sharded over a mesh.

One jitted optimizer step serves every dataset size; steps are dispatched asynchronously and
their NLLs fetched only at evaluations. A cold fit is mostly XLA compilation, so the training
program compiles on a second thread while the init compiles and runs. The global batch is
split over the mesh's data axes (`jaxsim.sharding.batch_sharding`); params and optimizer state
are replicated, and the mean over the global batch makes the fit equal to the 1-device fit up
to float32 rounding. Everything random (held-out split, init rows, params, per-epoch shuffles,
dropout-noise keys) derives from one explicit PRNG key.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsim import compile_options, sharding
from jaxsim.flows.checks import check_matrix, check_not_diverged
from jaxsim.flows.config import FlowConfig, FlowError
from jaxsim.flows.models import make_flow
from jaxsim.flows.optim import decay_mask, make_optimizer
from jaxsim.flows.prior import nats_to_bits_per_dim, nll_nats
from jaxsim.progress import progress_bar
from jaxsim.storage.tb import optional_writer

_EVAL_ROWS = 512  # held-out rows are padded to a multiple of this (one compiled shape)
EmbedFn = Callable[[jax.Array], np.ndarray]


def default_mesh(batch_size: int) -> Mesh:
    """A data-parallel mesh over the local devices: the most of them that split the batch."""
    devices = jax.local_devices()
    n = max(k for k in range(1, len(devices) + 1) if batch_size % k == 0)
    return sharding.make_mesh(data=n, devices=devices[:n])


@dataclasses.dataclass(frozen=True)
class FitResult:
    """Output of `fit_flow`.

    Attributes:
      params: the fitted params (the best held-out NLL when there is a held-out split).
      history: one dict per evaluation: step, epoch, train_nll (mean nats per row since the
        previous entry), val_nll (NaN without held-out rows), bpd (bits/dim of val_nll, else
        of train_nll).
      best_step: optimizer step of `params`.
      stopped_early: patience ran out before `max_epochs`.
      init_nll: NLL (nats per row) at initialisation: of the held-out rows, or without
        held-out rows, of the first training batch.
      note: non-empty when the fit deviated from the config (a smaller batch for few rows).
    """

    params: Any
    history: list[dict[str, float]]
    best_step: int
    stopped_early: bool
    init_nll: float
    note: str = ''


def _row_nll(model, params, x):
    return nll_nats(*model.apply({'params': params}, x, method='forward'))  # [rows] nats


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted programs of a fit, for one config, size and mesh."""

    init: Callable  # (key, x_init [rows, dim]) -> (params, opt_state)
    step: Callable  # (params, opt_state, batch [batch, dim]) -> (params, opt_state, mean NLL)
    eval_nll: Callable  # (params, x [rows, dim], mask [rows]) -> mean NLL of the unmasked rows
    state: Any  # ShapeDtypeStructs of (params, opt_state)


def compiled(config: FlowConfig, dim: int, mesh: Mesh) -> Programs:
    """The fit's programs for a config, size and mesh; cached so refitting (one flow per eval
    task, another epoch count or held-out fraction) compiles nothing new."""
    # Only the fields that shape the compiled programs key the cache.
    return _compiled(config.replace(name='', max_epochs=1, val_fraction=0.0, patience=1,
                                    evals_per_epoch=1, init_batch_size=2, dropout_noise=False),
                     dim, mesh)


class FlatParams:
    """The params tree <-> one flat float32 vector: the optimizer runs on the vector (one
    clip/Adam/decay chain, not one per leaf), the model on the tree (docs/performance.md)."""

    def __init__(self, abstract: Any):
        self.leaves, self.treedef = jax.tree.flatten(abstract)
        self.sizes = [int(np.prod(leaf.shape)) for leaf in self.leaves]

    def ravel(self, tree: Any) -> jax.Array:
        return jnp.concatenate([jnp.ravel(leaf).astype(jnp.float32)
                                for leaf in jax.tree.leaves(tree)])

    def unravel(self, flat: jax.Array) -> Any:
        ends = np.cumsum(self.sizes)
        return jax.tree.unflatten(self.treedef, [
            flat[end - size: end].reshape(leaf.shape)
            for end, size, leaf in zip(ends, self.sizes, self.leaves)])


@functools.lru_cache(maxsize=16)
def _compiled(config: FlowConfig, dim: int, mesh: Mesh):
    model = make_flow(config, dim)
    abstract = jax.eval_shape(lambda: model.init(
        jax.random.key(0), jnp.zeros((1, dim), jnp.float32), method='forward'))['params']
    flat = FlatParams(abstract)
    mask = jax.tree.leaves(decay_mask(abstract, config.weight_decay_exclude))
    tx = make_optimizer(config, mask=np.concatenate([np.full(n, m)
                                                     for n, m in zip(flat.sizes, mask)]))
    rep = NamedSharding(mesh, PartitionSpec())
    rows = sharding.batch_sharding(mesh, 2)  # [batch, dim]: batch over the data axes
    per_row = (1.0 / (dim * math.log(2.0))) if config.objective == 'bits_per_dim' else 1.0

    def init(key, x_init):
        params = model.init(key, x_init[:1], method='forward')['params']
        if config.data_init:
            _, v = model.apply({'params': params}, x_init, method='init_from_batch',
                               mutable=['params'])
            params = v['params']
        return params, tx.init(flat.ravel(params))

    def loss_fn(params, xb):
        nll = _row_nll(model, params, xb)  # [batch]
        return config.loss_scale * per_row * jnp.mean(nll), jnp.mean(nll)

    def train_step(params, opt_state, xb):
        xb = jax.lax.with_sharding_constraint(xb, rows)
        (_, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, xb)
        updates, opt_state = tx.update(flat.ravel(grads), opt_state, flat.ravel(params))
        return jax.tree.map(jnp.add, params, flat.unravel(updates)), opt_state, nll

    def eval_nll(params, x, mask):
        nll = _row_nll(model, params, x)
        return jnp.sum(jnp.where(mask, nll, 0.0)) / jnp.sum(mask)

    # Compile time is most of a cold fit: light optimization for what runs repeatedly, none
    # for the one-off init (see jaxsim.compile_options).
    devices = list(mesh.devices.flat)
    light = compile_options.for_effort(devices, 'light')
    once = compile_options.for_effort(devices, 'none')
    state = (abstract, jax.eval_shape(tx.init, jax.ShapeDtypeStruct((sum(flat.sizes),),
                                                                   jnp.float32)))
    return Programs(
        init=jax.jit(init, out_shardings=rep, compiler_options=once),
        step=jax.jit(train_step, in_shardings=(rep, rep, rows), out_shardings=rep,
                     compiler_options=light),
        eval_nll=jax.jit(eval_nll, in_shardings=rep, out_shardings=rep, compiler_options=light),
        state=state)


def _rng(key: jax.Array, *tags: int) -> np.random.Generator:
    """A NumPy generator seeded by a JAX key and integer tags (e.g. the epoch): host-side
    shuffles stay a pure function of the key without compiling device permutations."""
    seed = [int(v) for v in np.asarray(jax.random.key_data(key)).ravel()] + [int(t) for t in tags]
    return np.random.default_rng(seed)


def _zeros(shapes: Any, mesh: Mesh) -> Any:
    """Zeros shaped like a tree of ShapeDtypeStructs, replicated over the mesh (as the init's
    outputs are: the same argument signature, so the same compiled program)."""
    rep = NamedSharding(mesh, PartitionSpec())
    return jax.device_put(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes), rep)


def _run_once(calls: list[tuple[Callable, tuple]]) -> None:
    """Calls each jitted function once on placeholder arguments, discarding the results: the
    compiled programs stay in the functions' caches for the real calls."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))


def _padded(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [n, dim] with zero rows up to a multiple of _EVAL_ROWS, and the mask of its rows."""
    n = x.shape[0]
    total = -(-n // _EVAL_ROWS) * _EVAL_ROWS
    return np.concatenate([x, np.zeros((total - n, x.shape[1]), x.dtype)]), np.arange(total) < n


def _plan(n: int, config: FlowConfig, shards: int) -> tuple[int, int, int, str]:
    """(held-out rows, batch size, optimizer steps per epoch, note), checked before anything
    is compiled. Fewer training rows than `batch_size` shrink the batch to all of them (a
    multiple of the mesh's batch shards), with a note, rather than refusing the matrix."""
    if config.batch_size % shards:
        raise FlowError(f'flow batch_size={config.batch_size} cannot be split over the '
                        f'{shards} batch shards of the mesh; choose a multiple of {shards}')
    num_val = max(1, round(n * config.val_fraction)) if config.val_fraction > 0 else 0
    num_train = n - num_val
    batch, note = config.batch_size, ''
    if num_train < batch:
        batch = num_train // shards * shards
        if batch < 2:
            raise FlowError(f'flow fit: {n} rows minus {num_val} held out leave {num_train} '
                            f'training rows, too few for a batch over {shards} device(s)')
        note = (f'flow fit: only {num_train} training rows (of {n}, {num_val} held out): '
                f'batch {batch} instead of batch_size={config.batch_size}')
    return num_val, batch, num_train // batch, note


def fit_flow(x: Any, config: FlowConfig, key: jax.Array, *, embed: Optional[EmbedFn] = None,
             mesh: Optional[Mesh] = None, progress: bool = False,
             tb_dir: Optional[str] = None) -> FitResult:
    """Fits the flow of `config` by maximum likelihood on the rows of x.

    Args:
      x: [N, D] embeddings, finite (the clean, eval-mode vectors).
      config: architecture and fitting settings.
      key: PRNG key; all randomness derives from it.
      embed: `embed(key) -> [N, D]` returning freshly dropout-noised embeddings of the same N
        sentences (the encoder in train mode). Used when `config.dropout_noise` (then
        required): each epoch trains on `embed(fold_in(key, epoch))`, while the held-out NLL
        stays on the clean x. Ignored otherwise, so a caller can always offer it.
      mesh: the batch is split over its data axes (default: `default_mesh`).
      progress: show progress (a bar on a terminal, else periodic lines: no carriage
        returns in logs).
      tb_dir: TensorBoard scalars of each history entry at its step (`jaxsim.storage.tb`).

    Returns:
      A FitResult; `make_flow(config, D)` applies its params.

    Raises:
      FlowError: bad input or config (before compiling), or a diverged fit.
    """
    x = check_matrix(x, min_rows=2)
    n, dim = x.shape
    config.check_dim(dim)
    if config.dropout_noise and embed is None:
        raise FlowError(f'flow config {config.name!r} fits on dropout-noised embeddings '
                        '(dropout_noise=True): pass embed=callable(key) -> [N, D] vectors '
                        'from the encoder in train mode')
    mesh = mesh if mesh is not None else default_mesh(config.batch_size)
    num_val, batch, steps, note = _plan(n, config, sharding.batch_shards(mesh))
    programs = compiled(config, dim, mesh)
    # Compile the training (and evaluation) programs on another thread while this one draws
    # the keys, compiles and runs the init (and the first epoch's noised vectors).
    warm_ups = [(programs.step, (*_zeros(programs.state, mesh),
                                 np.zeros((batch, dim), np.float32)))]
    if num_val:
        warm_ups.append((programs.eval_nll, (_zeros(programs.state[0], mesh),
                                             *_padded(np.zeros((num_val, dim), np.float32)))))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        warm = pool.submit(_run_once, warm_ups)
        split_key, init_key, param_key, shuffle_key, noise_key = jax.random.split(key, 5)
        order = _rng(split_key).permutation(n)
        val_idx, train_idx = order[:num_val], order[num_val:]

        def epoch_rows(epoch: int) -> np.ndarray:
            if not config.dropout_noise:
                return x[train_idx]
            noised = check_matrix(embed(jax.random.fold_in(noise_key, epoch)),
                                  f'embed(key) at epoch {epoch}')
            if noised.shape != x.shape:
                raise FlowError(f'embed(key) returned shape {noised.shape}, expected '
                                f'{x.shape} (the same sentences as the clean embeddings)')
            return noised[train_idx]

        train_x = epoch_rows(0)
        init_rows = _rng(init_key).permutation(len(train_idx))[: config.init_batch_size]
        params, opt_state = programs.init(param_key, train_x[init_rows])
        warm.result()

    eval_x, eval_mask = _padded(x[val_idx]) if num_val else (None, None)
    # Without held-out rows the first step's NLL (taken before its update) is the NLL at
    # initialisation: no evaluation program to compile for a fit that never evaluates.
    init_nll = float(programs.eval_nll(params, eval_x, eval_mask)) if num_val else None
    if init_nll is not None:  # at its own start it can only be non-finite
        check_not_diverged(init_nll, init_nll, x, config, 'at initialisation')

    evals = {min(steps, round((i + 1) * steps / config.evals_per_epoch))
             for i in range(config.evals_per_epoch)} if num_val else {steps}
    best = (math.inf, params, 0)
    history: list[dict[str, float]] = []
    stopped_early, bad_evals, step = False, 0, 0
    bar = progress_bar(config.max_epochs * steps, 'flow fit', unit='step', enable=progress,
                       leave=False)
    with bar, optional_writer(tb_dir) or contextlib.nullcontext() as tb:
        for epoch in range(config.max_epochs):
            if epoch:
                train_x = epoch_rows(epoch)
            perm = _rng(shuffle_key, epoch).permutation(len(train_idx))
            batches = train_x[perm[: steps * batch]].reshape(steps, batch, dim)
            nlls = []  # device scalars, fetched at the next evaluation
            for k in range(steps):
                params, opt_state, nll = programs.step(params, opt_state, batches[k])
                nlls.append(nll)
                step += 1
                bar.update(1)
                if init_nll is None:
                    init_nll = float(nll)
                    check_not_diverged(init_nll, init_nll, x, config, 'at initialisation')
                if k + 1 not in evals:
                    continue
                train_nll = float(np.mean(jax.device_get(nlls)))
                nlls = []
                check_not_diverged(train_nll, init_nll, x, config,
                                   f'by step {step} (epoch {epoch})')
                val_nll = (float(programs.eval_nll(params, eval_x, eval_mask)) if num_val
                           else math.nan)
                history.append({'step': step, 'epoch': epoch, 'train_nll': train_nll,
                                'val_nll': val_nll, 'bpd': float(nats_to_bits_per_dim(
                                    val_nll if num_val else train_nll, dim))})
                if tb is not None:
                    tb.write(step, {k: history[-1][k] for k in ('train_nll', 'val_nll', 'bpd')})
                shown = {'train_nll': f'{train_nll:.2f}'}
                if num_val:  # no held-out rows (BERT-flow's setting): nothing to show
                    shown['val_nll'] = f'{val_nll:.2f}'
                bar.set_postfix(**shown)
                if not num_val:
                    best = (math.nan, params, step)
                elif val_nll < best[0]:
                    best, bad_evals = (val_nll, params, step), 0
                else:
                    bad_evals += 1
                    stopped_early = bad_evals >= config.patience
                    if stopped_early:
                        break
            if stopped_early:
                break
    return FitResult(params=jax.device_get(best[1]), history=history, best_step=best[2],
                     stopped_early=stopped_early, init_nll=init_nll, note=note)
