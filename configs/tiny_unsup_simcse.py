"""Tiny random BERT, unsupervised SimCSE: for tests and smoke runs (seconds on CPU).

The tokenizer is the bundled all-MiniLM-L6-v2 one; the architecture is 2 layers x 32 hidden
with odd-ish sizes so shape bugs show. `train_file` must be set by the caller.
"""
import ml_collections


def get_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        model='bundled',
        random_init=True,
        model_overrides=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=48, max_position_embeddings=64),
        dropout=0.1,
        pooler='cls',
        mlp_only_train=True,
        objective='unsup',
        objective_kwargs=dict(temp=0.05),
        data_format='text',
        max_len=16,
        batch_size=16,
        max_steps=3,
        learning_rate=1e-3,
        seed=0,
        senteval_root='',  # no STS evaluation by default (fast)
        eval_every=0,
        eval_max_len=32,
        eval_batch_size=16,
        log_every=1,
        fast_compile=True,  # XLA -O0: compile time dominates such a tiny model
    ))
