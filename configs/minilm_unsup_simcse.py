"""Unsupervised SimCSE from the bundled all-MiniLM-L6-v2, sized for a 2-core CPU (minutes).

Corpus: the deduplicated sentences of the shipped SentEval text files (SNLI, MR, CR, MPQA;
no STS data). Paper settings where they fit (max_len 32, lr 3e-5, temp 0.05, dropout 0.1), with a
CPU-sized batch of 32 and only `max_steps` steps, with STS-B dev every `eval_every` steps. The pooler
is 'avg', all-MiniLM-L6-v2's own (mean pooling); the MLP head is then unused.
"""
import ml_collections

from jaxsim.paths import SENTEVAL_ROOT
from jaxsim.train_lib import base_config


def get_config() -> ml_collections.ConfigDict:
    c = base_config()
    c.model = 'bundled'
    c.dropout = 0.1
    c.pooler = 'avg'
    c.mlp_only_train = True
    c.objective = 'unsup'
    c.temp = 0.05
    c.train_file = str(SENTEVAL_ROOT)
    c.data_format = 'senteval_corpus'
    c.max_len = 32
    c.batch_size = 32
    c.max_steps = 30
    c.learning_rate = 3e-5
    c.seed = 42
    c.senteval_root = str(SENTEVAL_ROOT)
    c.eval_every = 15
    c.eval_max_len = 64
    c.eval_batch_size = 128
    c.log_every = 5
    c.keep_checkpoints = 1
    return c
