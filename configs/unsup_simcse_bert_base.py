"""Unsupervised SimCSE, BERT-base, as the reference trains it (Gao et al. 2021, Table D.1;
princeton-nlp/SimCSE run_unsup_example.sh with the HF Trainer).

Wiki1M (one sentence a line), batch 64, lr 3e-5, max_len 32, 1 epoch, temp 0.05, 'cls' pooler
with the MLP head only in training, dropout 0.1, AdamW without weight decay, linear decay,
clipping at 1.0. Like the HF Trainer: the last partial batch of the epoch is kept
(last_batch='keep', steps = ceil(examples / batch)); STS-B dev is evaluated only at multiples
of 125 steps (no step-0 and no final-step evaluation), and the best of those is kept. The
reference runs on one GPU, so the gradient is that of the whole batch ('global_mean').
Needs an accelerator and bert-base-uncased (a local HF folder or hub id).
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model='bert-base-uncased',
        dropout=0.1,
        pooler='cls',
        # The reference trains with --fp16 (the HF Trainer's mixed precision); bf16 compute with
        # float32 master weights is its TPU counterpart.
        dtype='bfloat16',
        mlp_only_train=True,
        objective='unsup',
        objective_kwargs=dict(temp=0.05),
        train_file='data/wiki1m_for_simcse.txt',
        data_format='text',
        max_len=32,
        last_batch='keep',
        batch_size=64,
        num_epochs=1.0,
        learning_rate=3e-5,
        max_grad_norm=1.0,
        grad_reduction='global_mean',
        seed=42,
        eval_every=125,
        eval_at_start=False,
        eval_at_end=False,
        log_every=25,
    ))
