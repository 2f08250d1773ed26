"""One unsupervised SimCSE step, jaxsim vs PyTorch, on all-MiniLM-L6-v2 (CPU).

Both sides: batch 64 sentences x 2 dropout views, max_len 32 (fixed padding), mean pooling,
cosine/0.05 InfoNCE, AdamW (lr 3e-5, linear decay), fp32. Inputs are pre-tokenized for both,
so only the step is timed. Prints steps/s of each and the ratio jaxsim / PyTorch.

  python benchmarks/train_speed.py [--steps 6] [--warmup 2] [--threads 2]
"""
import argparse
import functools
import os
import time
from pathlib import Path

import jax
import numpy as np

from jaxsim import sharding
from jaxsim.data.batching import to_global
from jaxsim.io.hf_folder import bundled_model_path, load_tokenizer
from jaxsim.models.encoder import init_params
from jaxsim.objectives import get_objective
from jaxsim.paths import SENTEVAL_ROOT as SENTEVAL
from jaxsim.train import build
from jaxsim.train.config import TrainConfig, load_config_file
from jaxsim.train.optim import make_optimizer, make_schedule
from jaxsim.train.state import create_state, param_shardings
from jaxsim.train.step import batch_shardings, configure_jax, make_loss_fn, make_train_step

ROOT = Path(__file__).resolve().parents[1]


def batch_arrays(tokenizer, batch, max_len):
    lines = (SENTEVAL / 'SNLI' / 's1.dev').read_text().splitlines()
    sents = list(dict.fromkeys(s.strip() for s in lines if s.strip()))[:batch]
    enc = tokenizer(sents, max_length=max_len, truncation=True, padding='max_length',
                    return_tensors='np')
    return enc['input_ids'].astype('int32'), enc['attention_mask'].astype('int32')


def time_steps(step, n_warmup, n_steps):
    for _ in range(n_warmup):
        step()
    t = time.perf_counter()
    for _ in range(n_steps):
        step()
    return n_steps / (time.perf_counter() - t)


def bench_jax(ids, mask, args):
    configure_jax()
    fields = load_config_file(str(ROOT / 'configs' / 'minilm_unsup_simcse.py'))
    fields.update(batch_size=args.batch, max_len=args.max_len, max_steps=1000, dtype=args.dtype)
    cfg = TrainConfig.from_dict(fields)
    base = build.load_base(cfg)
    encoder = build.make_encoder(cfg, base.config)
    mesh = sharding.make_mesh()
    params = init_params(encoder, jax.random.key(0), param_shardings(encoder, mesh),
                         base.bert_params)
    tx = make_optimizer(cfg, 1000)
    state, sh = create_state(params, tx, jax.random.key(1), mesh)
    loss = functools.partial(get_objective('unsup').loss, **cfg.objective_kwargs)
    step_fn = make_train_step(encoder, loss, tx, views=2, mesh=mesh, state_shardings=sh,
                              schedule=make_schedule(cfg, 1000))
    b = {'input_ids': ids[:, None], 'attention_mask': mask[:, None],
         'token_type_ids': np.zeros_like(ids)[:, None]}
    batch = to_global(b, batch_shardings(mesh))
    t = time.perf_counter()
    holder = {'state': state}

    def step():
        holder['state'], m = step_fn(holder['state'], batch)
        jax.block_until_ready(m['loss'])
    step()
    print(f'jaxsim: compile + first step {time.perf_counter() - t:.1f}s')
    sps = time_steps(step, args.warmup - 1, args.steps)

    # Where the time goes: the forward pass alone (dropout on, no grad, no update).
    loss_fn = jax.jit(make_loss_fn(encoder, loss, 2))
    key = jax.random.key(0)
    fwd = lambda: jax.block_until_ready(loss_fn(holder['state'].params, batch, key)[0])  # noqa
    fwd_sps = time_steps(fwd, 1, args.steps)
    return sps, fwd_sps


def bench_torch(ids, mask, args, model_path):
    import torch
    import torch.nn.functional as F
    from transformers import BertModel
    torch.manual_seed(0)
    model = BertModel.from_pretrained(str(model_path), add_pooling_layer=False)
    model.config.hidden_dropout_prob = 0.1
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-5, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / 1000))
    ids_t = torch.from_numpy(ids).long().repeat_interleave(2, 0)   # [2B, L], views adjacent
    mask_t = torch.from_numpy(mask).long().repeat_interleave(2, 0)

    def step():
        out = model(input_ids=ids_t, attention_mask=mask_t).last_hidden_state
        m = mask_t.unsqueeze(-1).float()
        z = ((out * m).sum(1) / m.sum(1)).view(-1, 2, out.shape[-1])
        z1, z2 = z[:, 0], z[:, 1]
        sim = F.cosine_similarity(z1.unsqueeze(1), z2.unsqueeze(0), dim=-1) / 0.05
        loss = F.cross_entropy(sim, torch.arange(len(z1)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    sps = time_steps(step, args.warmup, args.steps)

    def fwd():
        with torch.no_grad():
            model(input_ids=ids_t, attention_mask=mask_t)
    fwd_sps = time_steps(fwd, 1, args.steps)
    return sps, fwd_sps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--steps', type=int, default=6)
    ap.add_argument('--warmup', type=int, default=2)
    ap.add_argument('--batch', type=int, default=64)
    ap.add_argument('--max_len', type=int, default=32)
    ap.add_argument('--threads', type=int, default=2)
    ap.add_argument('--dtype', default='float32')
    args = ap.parse_args()
    import torch
    torch.set_num_threads(args.threads)
    path = bundled_model_path()
    ids, mask = batch_arrays(load_tokenizer(path), args.batch, args.max_len)
    print(f'batch {args.batch} x 2 views, max_len {args.max_len}, {args.dtype}, '
          f'{args.threads} torch threads, {os.cpu_count()} CPUs')
    torch_sps, torch_fwd = bench_torch(ids, mask, args, path)
    print(f'pytorch: {torch_sps:.3f} steps/s  (forward only {torch_fwd:.3f}/s)')
    jax_sps, jax_fwd = bench_jax(ids, mask, args)
    print(f'jaxsim:  {jax_sps:.3f} steps/s  (forward only {jax_fwd:.3f}/s)')
    print(f'ratio jaxsim/pytorch: {jax_sps / torch_sps:.2f}x  '
          f'(forward only {jax_fwd / torch_fwd:.2f}x)')


if __name__ == '__main__':
    main()
