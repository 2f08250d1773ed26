"""RealNVP alternative to the reference Glow (Dinh et al. 2017) for BERT-flow.

Six affine couplings with alternating parity masks over the D channels, each preceded by an
actnorm (standing in for RealNVP's batch norm), width-64 scale/shift nets; Adam lr 1e-3.
"""
from jaxsim.flows.config import FlowConfig


def get_config() -> FlowConfig:
    return FlowConfig(
        arch='realnvp',
        num_couplings=6,
        coupling='affine',
        width=64,
        hidden_layers=2,
        actnorm_in_realnvp=True,
        learning_rate=1e-3,
        batch_size=64,
        max_epochs=1,
        val_fraction=0.1,
        patience=2,
        evals_per_epoch=4,
        init_batch_size=512,
    )
