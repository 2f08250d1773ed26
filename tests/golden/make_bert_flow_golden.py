"""Writes tests/golden/bert_flow_golden.npz: BERT-flow's TensorFlow flow, executed.

Runs bohanli/BERT-flow's own modules from a checkout (nothing of them is copied here): the Glow
of `flow/glow_1x1.py` + `flow/glow_ops_1x1.py` with `flow/config/config_l3_d3_w32.json`, built
as `run_siamese.py` builds it (inside the "bert" variable scope, once per side of a sentence
pair, `Glow.body(pooled, is_training=True)`, flow loss = the two sides' batch means added), and
trained by `optimization_bert_flow.create_optimizer` (its AdamWeightDecayOptimizer at
flow_learning_rate 1e-3, global-norm clipping at 1.0, weight decay 0.01). The encoder is a
stand-in variable outside bert/flow, so `create_optimizer` runs unchanged.

Recorded, for `--steps` optimizer steps on 64-dim embedding-like rows (16 pairs a step): the
rows, the reference's initial flow variables (TF's own draws), for each step before its
update the latent z, the per-row bits/dim objective and the flow loss, and the variables after
the first and after the last step. `logdet` is derived from the reference's outputs:
objective * D * ln 2 = -(log N(z; 0, I) + logdet).

The modules are written for TF 1.14. They are imported under `tf.compat.v1` through shims
installed at import time: `tensorflow` resolves to a module that forwards to `tf.compat.v1`,
plus `tf.contrib.framework`'s arg_scope / add_arg_scope (from tf-slim, their maintained home)
and `tf.estimator.SessionRunHook` (tf.compat.v1.train's).

Not run in CI. Regenerate, from the repository root:

  python3.11 -m venv /tmp/tfvenv
  /tmp/tfvenv/bin/pip install tensorflow-cpu==2.21.0 tf-slim==1.1.0 scipy==1.17.1 numpy
  git clone https://github.com/bohanli/BERT-flow /tmp/BERT-flow
  git -C /tmp/BERT-flow checkout 7fa8f6d4a1a73e2c2f8549799d9bafc9d6048d67
  /tmp/tfvenv/bin/python tests/golden/make_bert_flow_golden.py /tmp/BERT-flow
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pathlib
import subprocess
import sys
import types

import numpy as np

BERT_FLOW_COMMIT = '7fa8f6d4a1a73e2c2f8549799d9bafc9d6048d67'
HERE = pathlib.Path(__file__).resolve().parent
DIM = 64  # 3 levels: 64, 32 and 16 channels
PAIRS = 16  # sentence pairs per step: 32 rows
FLOW_PREFIX = 'bert/flow/'


def embedding_like_rows(rng: np.random.Generator, steps: int) -> np.ndarray:
    """[steps, 2 * PAIRS, DIM] rows shaped like pooled BERT vectors: a shared offset, a few
    dominant directions (anisotropy), two outlier channels, small per-row noise."""
    offset = rng.normal(0.0, 0.3, DIM)
    directions = rng.normal(0.0, 1.0, (4, DIM)) * np.array([0.8, 0.5, 0.3, 0.2])[:, None]
    n = steps * 2 * PAIRS
    x = offset + rng.normal(0.0, 1.0, (n, 4)) @ directions + rng.normal(0.0, 0.1, (n, DIM))
    x[:, [5, 40]] *= 4.0
    return x.reshape(steps, 2 * PAIRS, DIM).astype(np.float32)


@contextlib.contextmanager
def tf1_shims(tf):
    """`import tensorflow` inside the block yields a TF1-looking module (see the docstring)."""
    from tf_slim.ops import arg_scope as slim_arg_scope

    v1 = tf.compat.v1
    ops = types.ModuleType('tensorflow.contrib.framework.python.ops')
    ops.arg_scope = slim_arg_scope.arg_scope
    ops.add_arg_scope = slim_arg_scope.add_arg_scope
    framework = types.SimpleNamespace(arg_scope=ops.arg_scope, add_arg_scope=ops.add_arg_scope)
    shim = types.ModuleType('tensorflow')
    shim.contrib = types.SimpleNamespace(framework=framework)
    shim.estimator = types.SimpleNamespace(SessionRunHook=v1.train.SessionRunHook)
    shim.__getattr__ = lambda name: getattr(v1, name)
    names = ['tensorflow', 'tensorflow.contrib', 'tensorflow.contrib.framework',
             'tensorflow.contrib.framework.python', 'tensorflow.contrib.framework.python.ops']
    saved = {name: sys.modules.get(name) for name in names}
    sys.modules.update({'tensorflow': shim, 'tensorflow.contrib': types.ModuleType('c'),
                        'tensorflow.contrib.framework': types.ModuleType('f'),
                        'tensorflow.contrib.framework.python': types.ModuleType('p'),
                        'tensorflow.contrib.framework.python.ops': ops})
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def checkout_commit(checkout: pathlib.Path) -> str:
    try:
        return subprocess.run(['git', '-C', str(checkout), 'rev-parse', 'HEAD'], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return 'unknown'


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('checkout', type=pathlib.Path, help='bohanli/BERT-flow checkout')
    parser.add_argument('--config', default='config_l3_d3_w32', help='flow/config/NAME.json')
    parser.add_argument('--steps', type=int, default=5)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--out', type=pathlib.Path, default=HERE / 'bert_flow_golden.npz')
    args = parser.parse_args(argv)
    commit = checkout_commit(args.checkout)
    if commit not in (BERT_FLOW_COMMIT, 'unknown'):
        sys.exit(f'{args.checkout} is at {commit}, expected {BERT_FLOW_COMMIT}')

    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
    import tensorflow as tf

    v1 = tf.compat.v1
    v1.disable_v2_behavior()
    sys.path.insert(0, str(args.checkout))
    with tf1_shims(tf):
        glow_1x1 = importlib.import_module('flow.glow_1x1')
        optimization = importlib.import_module('optimization_bert_flow')

    config_text = (args.checkout / 'flow' / 'config' / f'{args.config}.json').read_text()
    rows = embedding_like_rows(np.random.default_rng(args.seed), args.steps)

    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(args.seed)
        sides = [v1.placeholder(tf.float32, [PAIRS, DIM]) for _ in range(2)]
        objectives, latents = [], []
        for i, pooled in enumerate(sides):  # run_siamese.create_model: side a, then side b
            with v1.variable_scope('bert', reuse=v1.AUTO_REUSE if i else None):
                hparams = glow_1x1.AttrDict(json.loads(config_text))
                hparams.is_training = True
                model = glow_1x1.Glow(hparams)
                objectives.append(model.body(pooled, True))  # [PAIRS] bits/dim per row
                latents.append(tf.squeeze(model.z, [1, 2]))  # [PAIRS, DIM]
        flow_loss = tf.add_n([tf.reduce_mean(o) for o in objectives])
        with v1.variable_scope('bert'):
            encoder = v1.get_variable('encoder_stand_in', [3], tf.float32)
        train_op = optimization.create_optimizer(
            tf.reduce_sum(tf.square(encoder)), flow_loss, init_lr=1e-5, init_flow_lr=1e-3,
            num_train_steps=1000, num_warmup_steps=0, use_tpu=False)
        flow_vars = v1.trainable_variables('bert/flow')
        objective = tf.concat(objectives, 0)
        z = tf.concat(latents, 0)
        init = v1.global_variables_initializer()

    threads = v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    out = {}

    def snapshot(tag):
        for var, value in zip(flow_vars, sess.run(flow_vars)):
            out[f'{tag}/{var.op.name[len(FLOW_PREFIX):]}'] = value

    zs, bpds, losses = [], [], []
    with v1.Session(graph=graph, config=threads) as sess:
        sess.run(init)
        snapshot('init')
        for k in range(args.steps):
            feed = {sides[0]: rows[k, :PAIRS], sides[1]: rows[k, PAIRS:]}
            z_k, bpd_k, loss_k = sess.run([z, objective, flow_loss], feed)
            zs.append(z_k)
            bpds.append(bpd_k)
            losses.append(loss_k)
            sess.run(train_op, feed)
            if k == 0:
                snapshot('step1')
        snapshot('final')

    z = np.stack(zs)
    bpd = np.stack(bpds)
    log_prior = -0.5 * np.sum(z.astype(np.float64) ** 2 + np.log(2 * np.pi), axis=-1)
    logdet = -bpd.astype(np.float64) * DIM * np.log(2.0) - log_prior
    np.savez_compressed(
        args.out, x=rows, z=z, bits_per_dim=bpd, flow_loss=np.array(losses, np.float32),
        logdet=logdet.astype(np.float32), steps=np.int32(args.steps),
        config_json=np.array(config_text), bert_flow_commit=np.array(BERT_FLOW_COMMIT),
        tensorflow_version=np.array(tf.__version__), seed=np.int32(args.seed), **out)
    print(f'flow loss per step: {np.round(losses, 4).tolist()}')
    print(f'{len(flow_vars)} flow variables; wrote {args.out} ({args.out.stat().st_size} bytes)')


if __name__ == '__main__':
    main()
