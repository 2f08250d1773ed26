"""Unsupervised SimCSE from the bundled all-MiniLM-L6-v2, sized for a 2-core CPU (minutes).

Corpus: the deduplicated sentences of the shipped SentEval text files (SNLI, MR, CR, MPQA;
no STS data; `train_file=''` means the SentEval root). Paper settings where they fit (max_len
32, lr 3e-5, temp 0.05, dropout 0.1), with a CPU-sized batch of 32, `max_steps` steps and
STS-B dev every `eval_every` steps. The pooler is 'avg', all-MiniLM-L6-v2's own (mean
pooling); the MLP head is then unused.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model='bundled',
        dropout=0.1,
        pooler='avg',
        mlp_only_train=True,
        objective='unsup',
        objective_kwargs=dict(temp=0.05),
        data_format='senteval_corpus',
        max_len=32,
        batch_size=32,
        max_steps=30,
        learning_rate=3e-5,
        seed=42,
        eval_every=15,
        eval_max_len=64,
        eval_batch_size=128,
        log_every=5,
        keep_checkpoints=1,
    ))
