"""BERT-flow's reference flow (Li et al. 2020; bohanli/BERT-flow `config_l2_d3_w32`).

Glow on a 1x1 "image" with D channels: 2 levels of depth 3, each step actnorm (data-dependent
init) + invertible 1x1 conv (LU) + additive coupling with a width-32 ReLU shift net; half of the
channels split off to the standard-normal prior between levels; Adam lr 1e-3. One pass over the
target sentences, held-out NLL checked 4 times for early stopping.
"""
from jaxsim.flows.config import FlowConfig


def get_config() -> FlowConfig:
    return FlowConfig(
        arch='glow',
        levels=2,
        depth=3,
        coupling='additive',
        width=32,
        hidden_layers=2,
        lu=True,
        learning_rate=1e-3,
        batch_size=64,
        max_epochs=1,
        val_fraction=0.1,
        patience=2,
        evals_per_epoch=4,
        init_batch_size=512,
    )
