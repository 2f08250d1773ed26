"""Unsupervised SimCSE, BERT-base, the paper's hyperparameters (Gao et al. 2021, Table D.1).

Wiki1M corpus (one sentence per line), batch 64, lr 3e-5, max_len 32, 1 epoch, temp 0.05,
'cls' pooler with the MLP head only in training, STS-B dev every 125 steps, best kept.
Needs an accelerator and the bert-base-uncased weights (a local HF folder or hub id).
"""
import ml_collections

from jaxsim.paths import SENTEVAL_ROOT
from jaxsim.train_lib import base_config


def get_config() -> ml_collections.ConfigDict:
    c = base_config()
    c.model = 'bert-base-uncased'
    c.dropout = 0.1
    c.pooler = 'cls'
    c.mlp_only_train = True
    c.objective = 'unsup'
    c.temp = 0.05
    c.train_file = 'data/wiki1m_for_simcse.txt'
    c.data_format = 'text'
    c.max_len = 32
    c.batch_size = 64
    c.num_epochs = 1.0
    c.learning_rate = 3e-5
    c.max_grad_norm = 1.0
    c.seed = 42
    c.senteval_root = str(SENTEVAL_ROOT)
    c.eval_every = 125
    c.log_every = 25
    return c
