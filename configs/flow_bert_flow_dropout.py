"""BERT-flow exactly as its code executes it, including the input it trains on.

Identical to configs/flow_bert_flow.py except `dropout_noise=True`: run_siamese.py builds the
flow on top of BERT in TRAIN mode (`is_training=True`), so each training batch is pooled from
a dropout-noised forward pass (hidden and attention dropout 0.1) of the frozen encoder, fresh
at every step. Here each epoch fits on a fresh dropout-noised encoding of the fit sentences
(one epoch, as the reference: every sentence is seen once, under one dropout draw); the
calibration is then applied to the clean (eval-mode) vectors, as the reference predicts with
`is_training=False`. Needs the encoder: the fit takes `embed=key -> vectors` (eval.py passes
it).
"""
import pathlib

from jaxsim.flows.config import FlowConfig, load_config_file


def get_config() -> FlowConfig:
    base = load_config_file(pathlib.Path(__file__).with_name('flow_bert_flow.py'))
    return base.replace(name='bert_flow_dropout', dropout_noise=True)
