"""A conventional Glow for BERT-flow-style calibration (the alternative to flow_bert_flow.py).

2 levels of depth 3; each step: actnorm with data-dependent init (explicit, on 512 rows; bias
in output units, so channels with tiny spread stay stable) -> LU-parameterized invertible
linear map (Glow section 3.2) -> additive coupling with a width-32 ReLU MLP (zero-initialised
last layer). Adam (bias-corrected) at lr 1e-3 on the mean NLL in nats, no clipping or weight
decay; one epoch with 10% of the rows held out and the NLL checked 4 times for early stopping.
"""
from jaxsim.flows.config import FlowConfig, layer


def get_config() -> FlowConfig:
    return FlowConfig(
        name='glow',
        levels=2,
        depth=3,
        step=(
            layer('actnorm', initialization='data', logscale_factor=1.0, bias='output'),
            layer('linear_lu'),
            layer('additive_coupling', width=32, hidden_layers=2, net='mlp'),
        ),
        data_init=True,
        init_batch_size=512,
        objective='nats',
        loss_scale=1.0,
        optimizer='adam',
        learning_rate=1e-3,
        weight_decay=0.0,
        adam_eps=1e-8,
        clip_norm=0.0,
        batch_size=64,
        max_epochs=1,
        val_fraction=0.1,
        patience=2,
        evals_per_epoch=4,
    )
