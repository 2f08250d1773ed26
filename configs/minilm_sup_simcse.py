"""Supervised SimCSE from the bundled all-MiniLM-L6-v2 on SentEval's SNLI dev+test triplets,
sized for a 2-core CPU (minutes).

(premise, entailment, contradiction) triplets are built from SentEval's SNLI files (about
6.5k). Paper settings where they fit (lr 5e-5, max_len 32, temp 0.05) with a CPU-sized batch
of 32 triplets (96 sequences per step) and `max_steps` steps, STS-B dev every `eval_every`.
The pooler is 'avg', all-MiniLM-L6-v2's own.
"""
import ml_collections

from jaxsim.paths import SENTEVAL_ROOT
from jaxsim.train_lib import base_config


def get_config() -> ml_collections.ConfigDict:
    c = base_config()
    c.model = 'bundled'
    c.dropout = 0.1
    c.pooler = 'avg'
    c.mlp_only_train = False
    c.objective = 'sup'
    c.temp = 0.05
    c.hard_negative_weight = 0.0
    c.train_file = str(SENTEVAL_ROOT / 'SNLI')
    c.data_format = 'snli'
    c.snli_splits = ['dev', 'test']
    c.max_len = 32
    c.batch_size = 32
    c.max_steps = 30
    c.learning_rate = 5e-5
    c.seed = 42
    c.senteval_root = str(SENTEVAL_ROOT)
    c.eval_every = 15
    c.eval_max_len = 64
    c.eval_batch_size = 128
    c.log_every = 5
    c.keep_checkpoints = 1
    return c
