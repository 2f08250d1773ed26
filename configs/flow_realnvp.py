"""RealNVP (Dinh et al. 2017) on vectors, an alternative to the Glow configs.

One level of 6 affine couplings with alternating parity masks (each channel is transformed
every other coupling), each preceded by an actnorm with data-dependent init (standing in for
RealNVP's batch norm); tanh-bounded scales, width-64 MLPs; Adam at lr 1e-3 on the mean NLL in
nats; one epoch, 10% held out for early stopping.
"""
from jaxsim.flows.config import FlowConfig, layer

_ACTNORM = layer('actnorm', initialization='data')


def get_config() -> FlowConfig:
    coupling = dict(width=64, hidden_layers=2, mask='parity', scale='tanh', net='mlp')
    return FlowConfig(
        name='realnvp',
        levels=1,
        depth=3,
        step=(_ACTNORM, layer('affine_coupling', flip=False, **coupling),
              _ACTNORM, layer('affine_coupling', flip=True, **coupling)),
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
