"""Supervised SimCSE, BERT-base, the paper's hyperparameters (Gao et al. 2021, Table D.1).

NLI triplets (sent0, sent1, hard_neg CSV), batch 512, lr 5e-5, max_len 32, 3 epochs,
temp 0.05, 'cls' pooler with the MLP head kept at evaluation, STS-B dev every 125 steps.
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
    c.mlp_only_train = False
    c.objective = 'sup'
    c.temp = 0.05
    c.hard_negative_weight = 0.0
    c.train_file = 'data/nli_for_simcse.csv'
    c.data_format = 'csv'
    c.max_len = 32
    c.batch_size = 512
    c.num_epochs = 3.0
    c.learning_rate = 5e-5
    c.max_grad_norm = 1.0
    c.seed = 42
    c.senteval_root = str(SENTEVAL_ROOT)
    c.eval_every = 125
    c.log_every = 25
    return c
