"""Memory and time of the train step for BERT-base shapes under each `remat` setting, and with
cached-gradient micro-batches (`micro_batch_size`).

    python benchmarks/remat_memory.py [--batch 512] [--time-batch 8] [--json PATH]

For each setting the step is compiled for the global batch `--batch` (BERT-base: 12 layers,
hidden 768, random init, unsupervised SimCSE: 2 views x max_len 32 tokens per example) and
`compiled.memory_analysis()` gives the temporary (activation) bytes, without running it. The
step is then timed at `--time-batch` (a batch of 512 takes minutes per step on a small CPU
machine). Top-level "ratio": temp bytes of the smallest setting / temp bytes of remat='none'.

On XLA:CPU `remat` saves little: the CPU compiler expands the optimization barriers that keep
recomputation apart from the forward pass, so CSE and the scheduler largely undo it (BERT-base,
batch 512: 30.3 GB temp with none, 28.1 GB with full). The policy takes full effect on GPU and
TPU. Micro-batches bound the activations by construction (a loop over micro-batches), on
every backend (4.3 GB with micro-batches of 64).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from jaxsim import sharding  # noqa: E402
from jaxsim.cli import environment  # noqa: E402
from jaxsim.models.encoder import init_params  # noqa: E402
from jaxsim.objectives import get_objective  # noqa: E402
from jaxsim.train import build, optim  # noqa: E402
from jaxsim.train import state as state_lib
from jaxsim.train import step as step_lib
from jaxsim.train.config import TrainConfig  # noqa: E402

SETTINGS = [('none', 0), ('full', 0), ('dots', 0), ('none', 64)]


def _config(shape: str, batch: int, max_len: int, remat: str, micro: int,
            fast_compile: bool = False) -> TrainConfig:
    return TrainConfig(random_init=True, model_overrides=common.SHAPES[shape], dropout=0.1,
                       objective='unsup',
                       train_file='unused', batch_size=batch, max_len=max_len, max_steps=10,
                       remat=remat, micro_batch_size=micro, fast_compile=fast_compile)


def _build(cfg: TrainConfig, mesh):
    base = build.load_base(cfg)
    encoder = build.make_encoder(cfg, base.config)
    tx = optim.make_optimizer(cfg, cfg.max_steps)
    key = jax.random.key(cfg.seed)
    shardings = state_lib.state_shardings(state_lib.state_shape(encoder, tx, key), mesh)
    objective = get_objective(cfg.objective)
    train_step = step_lib.make_train_step(
        loss=step_lib.LossSpec(encoder=encoder,
                               objective=functools.partial(objective.loss, temp=0.05),
                               views=objective.views),
        update=step_lib.UpdateSpec(tx=tx),
        target=step_lib.CompileTarget(
            mesh=mesh, state_shardings=shardings,
            compiler_options=step_lib.compiler_options(cfg.fast_compile)),
        split=build.batch_split(cfg))
    return encoder, tx, key, shardings, train_step


def _batch_shapes(cfg: TrainConfig, mesh) -> dict:
    return {k: jax.ShapeDtypeStruct((cfg.batch_size, 1, cfg.max_len), jnp.int32, sharding=s)
            for k, s in step_lib.batch_shardings(mesh).items()}


def memory(cfg: TrainConfig, mesh) -> dict:
    """Compiles the step for abstract inputs (nothing allocated) and reads XLA's figures."""
    encoder, tx, key, shardings, train_step = _build(cfg, mesh)
    abstract = state_lib.abstract_state(state_lib.state_shape(encoder, tx, key), shardings)
    start = time.perf_counter()
    compiled = train_step.lower(abstract, _batch_shapes(cfg, mesh)).compile()
    m = compiled.memory_analysis()
    return {'temp_mb': round(m.temp_size_in_bytes / 2 ** 20, 1),
            'argument_mb': round(m.argument_size_in_bytes / 2 ** 20, 1),
            'compile_s': round(time.perf_counter() - start, 1)}


def step_time(cfg: TrainConfig, mesh, steps: int) -> float:
    """Median seconds per step (after one warm-up step) on random token ids."""
    encoder, tx, key, shardings, train_step = _build(cfg, mesh)
    params = init_params(encoder, jax.random.key(1), state_lib.param_shardings(encoder, mesh))
    state, _ = state_lib.create_state(params, tx, key, mesh)
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, (cfg.batch_size, 1, cfg.max_len)).astype(np.int32)
    batch = {'input_ids': ids, 'attention_mask': np.ones_like(ids),
             'token_type_ids': np.zeros_like(ids)}
    batch = {k: jax.device_put(v, s) for (k, v), s in
             zip(batch.items(), step_lib.batch_shardings(mesh).values())}
    state, metrics = train_step(state, batch)
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = train_step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--batch', type=int, default=512, help='global batch for the memory figures')
    p.add_argument('--time-batch', type=int, default=8,
                   help='global batch for step times (0: no timing)')
    p.add_argument('--max-len', type=int, default=32)
    p.add_argument('--shape', choices=sorted(common.SHAPES), default='bert-base',
                   help='encoder shapes (random init)')
    p.add_argument('--steps', type=int, default=1, help='timed steps per setting')
    p.add_argument('--fast-compile', action='store_true',
                   help='XLA -O0 (smoke tests: the figures are not those of a default compile)')
    p.add_argument('--json', type=Path, default=None)
    args = p.parse_args()
    environment.setup()
    step_lib.configure_jax()
    mesh = sharding.make_mesh()
    rows = []
    for remat, micro in SETTINGS:
        row = {'remat': remat, 'micro_batch_size': micro,
               **memory(_config(args.shape, args.batch, args.max_len, remat, micro,
                                 args.fast_compile), mesh)}
        time_micro = min(micro, args.time_batch // 2) if micro else 0
        row['time_batch'], row['time_micro_batch_size'] = args.time_batch, time_micro
        row['step_s'] = None
        if args.time_batch:
            row['step_s'] = round(step_time(_config(args.shape, args.time_batch, args.max_len,
                                                    remat, time_micro, args.fast_compile),
                                            mesh, args.steps), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    none = rows[0]['temp_mb']
    record = {'backend': jax.default_backend(), 'devices': jax.device_count(),
              'batch': args.batch, 'max_len': args.max_len, 'shape': args.shape,
              'fast_compile': args.fast_compile,
              'rows': rows, 'ratio': round(min(r['temp_mb'] for r in rows) / none, 3),
              'note': ('XLA:CPU expands the optimization barriers that keep recomputation '
                       'apart, so remat saves little temp memory on CPU; step times from a '
                       'shared CPU machine are noisy' if jax.default_backend() == 'cpu' else '')}
    print(f"{'remat':6s} {'micro':>5s} {'temp MB':>9s} {'step s':>7s}")
    for r in rows:
        step = '-' if r['step_s'] is None else f"{r['step_s']:.3f}"
        print(f"{r['remat']:6s} {r['micro_batch_size']:5d} {r['temp_mb']:9.1f} {step:>7s}")
    print(f"ratio (smallest temp / remat none): {record['ratio']}")
    common.write_json(args.json, record)


if __name__ == '__main__':
    main()
