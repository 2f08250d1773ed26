"""Coupling bijectors and their conditioner networks (registered in `FLOW_LAYERS`).

A coupling splits the channels into a conditioning part a and a transformed part b, and maps
b with shift/scale computed from a, so its inverse and log-det are cheap (Dinh et al. 2017).

Two conditioner networks:
  net='mlp'  Dense+ReLU layers (N(0, 1/fan_in) kernels, biases), zero-initialised last Dense.
  net='glow' what BERT-flow's `conv_stack` executes on a 1x1 image: twice
             [1x1 conv without bias (N(0, 0.05) kernel) -> actnorm -> ReLU], where that actnorm
             is (h + b) * exp(3 logs) with b, logs at TF's default glorot-uniform draw (its
             data-dependent init never runs), then a zero 1x1 conv whose output is
             (h W + b) * exp(3 logs) with W, b, logs zero-initialised.
Either way the last layer starts at zero, so a new additive coupling is the identity.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.flows.layers import (
    FLOW_LAYERS,
    FlowOutput,
    constant_logdet,
    host_normal,
    tf_default_uniform,
)

NETS = ('mlp', 'glow')
AFFINE_SCALES = ('tanh', 'sigmoid')
# Glow's / BERT-flow's actnorm and zero-conv scale: exp(LOGSCALE_FACTOR * logs).
LOGSCALE_FACTOR = 3.0
GLOW_KERNEL_STD = 0.05  # BERT-flow glow_ops.default_initializer


def coupling_indices(dim: int, mask: str, flip: bool) -> tuple[np.ndarray, np.ndarray]:
    """Static channel indices (conditioning part a, transformed part b) of a coupling.

    Args:
      dim: number of channels.
      mask: 'half' (first half conditions the second, Glow's channel split) or 'parity'
        (even channels condition odd ones, RealNVP's alternating mask on a 1x1 image).
      flip: swap the roles of the two parts.
    """
    if dim < 2:
        raise ValueError(f'a coupling needs at least 2 channels; got {dim}')
    idx = np.arange(dim)
    if mask == 'half':
        a, b = idx[: dim // 2], idx[dim // 2:]
    elif mask == 'parity':
        a, b = idx[0::2], idx[1::2]
    else:
        raise ValueError(f"coupling: mask={mask!r}, expected 'half' or 'parity'")
    return (b, a) if flip else (a, b)


class _Net(nn.Module):
    """A coupling's network: `hidden_layers` hidden layers of `width` units, then `out_features`
    outputs from a last layer that starts at zero."""

    width: int
    hidden_layers: int
    out_features: int


class MlpNet(_Net):
    """Dense+ReLU hidden layers."""

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        for _ in range(self.hidden_layers):
            h = nn.relu(nn.Dense(self.width, kernel_init=host_normal())(h))
        return nn.Dense(self.out_features, kernel_init=nn.initializers.zeros)(h)


class GlowNet(_Net):
    """BERT-flow's coupling network on vectors: conv+actnorm+ReLU hidden blocks (2 in BERT-flow;
    see the module docstring)."""

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        for i in range(self.hidden_layers):
            w = self.param(f'W_{i}', host_normal(GLOW_KERNEL_STD), (h.shape[-1], self.width))
            b = self.param(f'b_{i}', tf_default_uniform(self.width), (self.width,))
            logs = self.param(f'logs_{i}', tf_default_uniform(self.width), (self.width,))
            h = nn.relu((h @ w + b) * jnp.exp(LOGSCALE_FACTOR * logs))  # [batch, width]
        zeros = nn.initializers.zeros
        w = self.param('W_out', zeros, (h.shape[-1], self.out_features))
        b = self.param('b_out', zeros, (self.out_features,))
        logs = self.param('logs_out', zeros, (self.out_features,))
        return (h @ w + b) * jnp.exp(LOGSCALE_FACTOR * logs)  # [batch, out_features]


class _Coupling(nn.Module):
    """Shared plumbing: split channels into (a, b), transform b conditioned on a, reassemble."""

    features: int
    width: int = 32
    hidden_layers: int = 2
    mask: str = 'half'
    flip: bool = False
    net: str = 'mlp'

    def _make_net(self, out_features: int) -> nn.Module:
        if self.net not in NETS:
            raise ValueError(f'coupling: net={self.net!r}, expected one of {NETS}')
        cls = MlpNet if self.net == 'mlp' else GlowNet
        return cls(self.width, self.hidden_layers, out_features)

    def _num_b(self) -> int:
        return len(coupling_indices(self.features, self.mask, self.flip)[1])

    def _split(self, x):
        """x [batch, dim] -> (a [batch, n_a], b [batch, n_b])."""
        # Slices and reshapes instead of gathers: a gather's gradient is a scatter, slow on CPU.
        if self.mask == 'half':
            h = self.features // 2
            a, b = x[:, :h], x[:, h:]
        elif self.features % 2 == 0:
            pairs = x.reshape(x.shape[0], -1, 2)  # [batch, dim/2, (even, odd)]
            a, b = pairs[..., 0], pairs[..., 1]
        else:
            a_idx, b_idx = coupling_indices(self.features, self.mask, False)
            a, b = x[:, a_idx], x[:, b_idx]
        return (b, a) if self.flip else (a, b)

    def _merge(self, a, b):
        """The inverse of `_split`."""
        if self.flip:
            a, b = b, a
        if self.mask == 'half':
            return jnp.concatenate([a, b], axis=-1)
        if self.features % 2 == 0:
            return jnp.stack([a, b], axis=-1).reshape(a.shape[0], -1)
        order = np.concatenate(coupling_indices(self.features, self.mask, False))
        return jnp.concatenate([a, b], axis=-1)[:, np.argsort(order)]  # [a, b] in channel order


@FLOW_LAYERS.register('additive_coupling')
class AdditiveCoupling(_Coupling):
    """z_b = x_b + t(x_a), z_a = x_a; volume preserving (logdet 0), Glow's additive coupling.

    Attributes:
      features: channels; width / hidden_layers / net: the shift network; mask / flip: see
        `coupling_indices`.
    """

    def setup(self):
        self.shift_net = self._make_net(self._num_b())

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch] = 0)."""
        a, b = self._split(x)
        return FlowOutput(self._merge(a, b + self.shift_net(a)), constant_logdet(x, 0.0))

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim]."""
        a, b = self._split(z)
        return self._merge(a, b - self.shift_net(a))


@FLOW_LAYERS.register('affine_coupling')
class AffineCoupling(_Coupling):
    """Affine coupling, with one of two scale parameterisations.

    scale='tanh' (RealNVP, Dinh et al. 2017, bounded): z_b = x_b * exp(tanh(h_s)) + h_t, the net
      output being [h_s, h_t]; each step's scale stays in [1/e, e].
    scale='sigmoid' (Glow / BERT-flow `affine_coupling`): z_b = (x_b + h_t) * sigmoid(h_s + 2),
      with shift h_t = h[:, 0::2] and h_s = h[:, 1::2] interleaved; the scale starts at
      sigmoid(2) = 0.88, not 1.

    Attributes:
      features: channels; width / hidden_layers / net: the network; mask / flip: see
        `coupling_indices`; scale: 'tanh' or 'sigmoid'.
    """

    scale: str = 'tanh'

    def setup(self):
        if self.scale not in AFFINE_SCALES:
            raise ValueError(f'affine_coupling: scale={self.scale!r}, expected one of '
                             f'{AFFINE_SCALES}')
        self.scale_shift_net = self._make_net(2 * self._num_b())

    def _log_scale_shift(self, a):
        h = self.scale_shift_net(a)  # [batch, 2 * n_b]
        if self.scale == 'sigmoid':
            return jax.nn.log_sigmoid(h[:, 1::2] + 2.0), h[:, 0::2]
        n_b = h.shape[-1] // 2
        return jnp.tanh(h[:, :n_b]), h[:, n_b:]

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch])."""
        a, b = self._split(x)
        log_s, t = self._log_scale_shift(a)
        zb = (b + t) * jnp.exp(log_s) if self.scale == 'sigmoid' else b * jnp.exp(log_s) + t
        return FlowOutput(self._merge(a, zb), jnp.sum(log_s, axis=-1))

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim]."""
        a, b = self._split(z)
        log_s, t = self._log_scale_shift(a)
        xb = b * jnp.exp(-log_s) - t if self.scale == 'sigmoid' else (b - t) * jnp.exp(-log_s)
        return self._merge(a, xb)
