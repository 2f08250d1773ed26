"""Whole flows: Glow (multi-level with split) and RealNVP, over [batch, dim] vectors.

Both expose `forward(x) -> FlowOutput(z, logdet)`, `inverse(z) -> x` and
`init_from_batch(x) -> FlowOutput` (data-dependent actnorm init, apply with
`mutable=['params']`). The latent z has the same size as x: Glow concatenates the channels split
off at every level with the last level's output (BERT-flow uses that full z as the embedding).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxsim.flows.config import FlowConfig
from jaxsim.flows.layers import (ActNorm, AdditiveCoupling, AffineCoupling, FlowOutput,
                                 InvertibleLinear, InvertibleLinearLU)


def _run_forward(layers, x, init: bool) -> FlowOutput:
    """Chains `layers` on x [batch, d]; with init=True actnorms initialise from x first."""
    logdet = jnp.zeros(x.shape[:1], jnp.float32)
    for layer in layers:
        if init and isinstance(layer, ActNorm):
            x, ld = layer.init_from_batch(x)
        else:
            x, ld = layer.forward(x)
        logdet = logdet + ld
    return FlowOutput(x, logdet)


def _run_inverse(layers, z):
    for layer in reversed(layers):
        z = layer.inverse(z)
    return z


class Glow(nn.Module):
    """Glow on a 1x1 image with `dim` channels (Kingma & Dhariwal 2018, as in BERT-flow).

    Level l works on d_l = dim / 2^l channels with `depth` steps of
    actnorm -> invertible linear (LU or dense) -> coupling (channel halves); between levels the
    second half of the channels is factored out to the standard-normal prior.

    Attributes:
      config: the architecture (`levels`, `depth`, `coupling`, `width`, `hidden_layers`, `lu`).
      dim: the embedding size; must pass `config.check_dim`.
    """

    config: FlowConfig
    dim: int

    def level_dims(self) -> list[int]:
        return [self.dim // 2 ** l for l in range(self.config.levels)]

    def setup(self):
        cfg = self.config
        cfg.check_dim(self.dim)
        coupling_cls = AdditiveCoupling if cfg.coupling == 'additive' else AffineCoupling
        linear_cls = InvertibleLinearLU if cfg.lu else InvertibleLinear
        levels = []
        for d in self.level_dims():
            steps = []
            for _ in range(cfg.depth):
                steps += [ActNorm(d), linear_cls(d),
                          coupling_cls(d, width=cfg.width, hidden_layers=cfg.hidden_layers)]
            levels.append(steps)
        # A list of lists: linen names them levels_<l>_<i>.
        self.levels = levels

    def _forward(self, x: jax.Array, init: bool) -> FlowOutput:
        outs = []  # factored-out halves, level 0 first
        logdet = jnp.zeros(x.shape[:1], jnp.float32)
        for l, steps in enumerate(self.levels):
            x, ld = _run_forward(steps, x, init)
            logdet = logdet + ld
            if l < len(self.levels) - 1:
                half = x.shape[-1] // 2
                x, out = x[:, :half], x[:, half:]
                outs.append(out)
        # z = [last level, ..., level-0 split]: each level's kept half stays in front.
        z = jnp.concatenate([x] + outs[::-1], axis=-1)
        return FlowOutput(z, logdet)

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch])."""
        return self._forward(x, init=False)

    def init_from_batch(self, x: jax.Array) -> FlowOutput:
        """Data-dependent actnorm init on x [batch, dim]; apply with mutable=['params']."""
        return self._forward(x, init=True)

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim]."""
        dims = self.level_dims()
        # Peel z back into the kept part and the split-off halves (see `_forward`).
        x = z[:, : dims[-1]]
        offset = dims[-1]
        for l in range(len(dims) - 1, -1, -1):
            x = _run_inverse(self.levels[l], x)
            if l > 0:
                out = z[:, offset: offset + dims[l]]
                offset += dims[l]
                x = jnp.concatenate([x, out], axis=-1)
        return x


class RealNVP(nn.Module):
    """RealNVP on vectors (Dinh et al. 2017): couplings with alternating parity masks.

    Each of the `num_couplings` steps is [actnorm ->] coupling whose mask flips parity every
    step, so every channel is transformed every other step. Actnorm replaces RealNVP's batch norm
    (same role, no batch statistics at inference).

    Attributes:
      config: `num_couplings`, `coupling`, `width`, `hidden_layers`, `actnorm_in_realnvp`.
      dim: the embedding size (>= 2).
    """

    config: FlowConfig
    dim: int

    def setup(self):
        cfg = self.config
        cfg.check_dim(self.dim)
        coupling_cls = AdditiveCoupling if cfg.coupling == 'additive' else AffineCoupling
        layers = []
        for i in range(cfg.num_couplings):
            if cfg.actnorm_in_realnvp:
                layers.append(ActNorm(self.dim))
            layers.append(coupling_cls(self.dim, width=cfg.width, hidden_layers=cfg.hidden_layers,
                                       mask='parity', flip=bool(i % 2)))
        self.layers = layers

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch])."""
        return _run_forward(self.layers, x, init=False)

    def init_from_batch(self, x: jax.Array) -> FlowOutput:
        """Data-dependent actnorm init on x [batch, dim]; apply with mutable=['params']."""
        return _run_forward(self.layers, x, init=True)

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim]."""
        return _run_inverse(self.layers, z)


def make_flow(config: FlowConfig, dim: int) -> nn.Module:
    """The flow module of `config` for `dim`-channel inputs; raises ValueError if dim won't fit."""
    config.check_dim(dim)
    return Glow(config, dim) if config.arch == 'glow' else RealNVP(config, dim)
