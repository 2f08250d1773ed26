"""Supervised SimCSE from the bundled all-MiniLM-L6-v2 on SentEval's SNLI dev+test triplets,
sized for a 2-core CPU (minutes).

(premise, entailment, contradiction) triplets are built from SentEval's SNLI files (about
6.5k; `train_file=''` means the SentEval root's SNLI folder). Paper settings where they fit
(lr 5e-5, max_len 32, temp 0.05) with a CPU-sized batch of 32 triplets (96 sequences a step),
`max_steps` steps and STS-B dev every `eval_every`. The pooler is 'avg', all-MiniLM-L6-v2's
own.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model='bundled',
        dropout=0.1,
        pooler='avg',
        mlp_only_train=False,
        objective='sup',
        objective_kwargs=dict(temp=0.05, hard_negative_weight=0.0),
        data_format='snli',
        snli_splits=['dev', 'test'],
        max_len=32,
        batch_size=32,
        max_steps=30,
        learning_rate=5e-5,
        seed=42,
        eval_every=15,
        eval_max_len=64,
        eval_batch_size=128,
        log_every=5,
        keep_checkpoints=1,
    ))
