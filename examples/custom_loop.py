"""A training loop of your own from jaxsim.functional: the same losses as train.py, step for step.

  python examples/custom_loop.py corpus.txt --steps 20 [--config configs/tiny_unsup_simcse.py]

prints one JSON line per step ({"step": 1, "loss": ...}), as train.py's metrics.jsonl logs them.
"""
import argparse
import json
from pathlib import Path

import jax
import optax

from jaxsim import functional as F

p = argparse.ArgumentParser()
p.add_argument('train_file')
p.add_argument('--steps', type=int, default=20)
p.add_argument('--config', default=str(Path(__file__).parents[1] / 'configs/tiny_unsup_simcse.py'))
args = p.parse_args()

F.configure_jax()  # dropout masks independent of the device layout, as train.py sets
cfg = F.load_config(args.config, train_file=args.train_file, max_steps=args.steps)
model = F.initial_model(cfg)  # encoder, the parameters train.py starts from, tokenizer
loss, views = F.objective_loss(cfg)  # the configured objective, its kwargs bound
loss_fn = F.make_loss_fn(model.encoder, loss, views)  # (params, batch, key) -> (loss, aux)
tx = F.make_optimizer(total_steps=args.steps, **F.optimizer_hyperparameters(cfg))
key = F.dropout_key(cfg.seed, cfg.prng_impl)


@jax.jit
def train_step(params, opt_state, batch, step):
    (value, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, batch, F.step_key(key, step))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


params, opt_state = model.params, tx.init(model.params)
data = F.batches(cfg, model.tokenizer)  # train.py's batches, in its order
for step in range(args.steps):
    params, opt_state, value = train_step(params, opt_state, next(data), step)
    print(json.dumps({'step': step + 1, 'loss': float(value)}), flush=True)
data.close()
