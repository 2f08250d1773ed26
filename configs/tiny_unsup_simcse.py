"""Tiny random BERT, unsupervised SimCSE: for tests and smoke runs (seconds on CPU).

The tokenizer is the bundled all-MiniLM-L6-v2 one; the architecture is 2 layers x 32 hidden
with odd-ish sizes so shape bugs show. `train_file` must be set by the caller.
"""
import ml_collections

from jaxsim.train_lib import base_config


def get_config() -> ml_collections.ConfigDict:
    c = base_config()
    c.model = 'bundled'
    c.random_init = True
    c.model_overrides = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=48, max_position_embeddings=64)
    c.dropout = 0.1
    c.pooler = 'cls'
    c.mlp_only_train = True
    c.objective = 'unsup'
    c.temp = 0.05
    c.train_file = ''
    c.data_format = 'text'
    c.max_len = 16
    c.batch_size = 16
    c.num_epochs = 1.0
    c.max_steps = 3
    c.learning_rate = 1e-3
    c.seed = 0
    c.senteval_root = ''  # no STS eval by default (fast)
    c.eval_every = 0
    c.eval_max_len = 32
    c.eval_batch_size = 16
    c.log_every = 1
    c.checkpoint = True
    c.fast_compile = True  # XLA -O0: compile time dominates such a tiny model
    return c
