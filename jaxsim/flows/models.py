"""A whole flow built from its config: levels of steps of registered layers, multi-scale split.

The latent z has the size of x and is laid out as BERT-flow's Glow returns it
(`tf.concat(eps + [z], -1)`): the half factored out after level 0, then the one after level 1,
..., then the last level's output. The prior is a standard normal on all of z.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxsim.flows.config import FlowConfig, FlowError
from jaxsim.flows.layers import FLOW_LAYERS, FlowOutput


def layer_keys(config: FlowConfig) -> list[list[str]]:
    """Per level, the submodule keys of its layers in application order (also param names)."""
    return [[f'l{l}_s{s}_{j}_{spec.layer}' for s in range(config.depth)
             for j, spec in enumerate(config.step)] for l in range(config.levels)]


class Flow(nn.Module):
    """`config.levels` levels of `config.depth` steps over [batch, dim] vectors.

    Level l works on dim / 2^l channels; after every level but the last, the second half of
    the channels is factored out to the prior (Glow's split, as in BERT-flow).

    Attributes:
      config: the flow config (layers by registry name).
      dim: the embedding size; must pass `config.check_dim`.
    """

    config: FlowConfig
    dim: int

    def setup(self):
        cfg = self.config
        layers = {}
        for keys, d in zip(layer_keys(cfg), cfg.level_dims(self.dim)):
            for key, spec in zip(keys, cfg.step * cfg.depth):
                layers[key] = FLOW_LAYERS.get(spec.layer)(features=d, **spec.kwargs())
        self.layers = layers  # param names: layers_l<level>_s<step>_<index>_<layer name>

    def _run(self, keys, x, init: bool):
        logdet = jnp.zeros(x.shape[:1], jnp.float32)
        for key in keys:
            layer = self.layers[key]
            if init and hasattr(layer, 'init_from_batch'):
                x, ld = layer.init_from_batch(x)
            else:
                x, ld = layer.forward(x)
            logdet = logdet + jnp.broadcast_to(ld, x.shape[:1])
        return x, logdet

    def _forward(self, x: jax.Array, init: bool) -> FlowOutput:
        eps = []  # factored-out halves, level 0 first
        logdet = jnp.zeros(x.shape[:1], jnp.float32)
        keys = layer_keys(self.config)
        for l in range(self.config.levels):
            x, ld = self._run(keys[l], x, init)
            logdet = logdet + ld
            if l < self.config.levels - 1:
                half = x.shape[-1] // 2
                x, out = x[:, :half], x[:, half:]
                eps.append(out)
        return FlowOutput(jnp.concatenate(eps + [x], axis=-1), logdet)

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch])."""
        return self._forward(x, init=False)

    def init_from_batch(self, x: jax.Array) -> FlowOutput:
        """Data-dependent init of the layers that have one, on x [batch, dim]; apply with
        mutable=['params']."""
        return self._forward(x, init=True)

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim]."""
        dims = self.config.level_dims(self.dim)
        keys = layer_keys(self.config)
        x = z[:, z.shape[-1] - dims[-1]:]
        for l in range(self.config.levels - 1, -1, -1):
            for key in reversed(keys[l]):
                x = self.layers[key].inverse(x)
            if l > 0:
                start = sum(dims[1:l])  # eps of level l-1 has dims[l] channels
                x = jnp.concatenate([x, z[:, start: start + dims[l]]], axis=-1)
        return x


def make_flow(config: FlowConfig, dim: int) -> Flow:
    """The flow of `config` for `dim`-channel inputs, checked before anything is compiled.

    Raises:
      FlowError: `dim` cannot be split by the levels, or a layer rejects its options (the
        message names the layer).
    """
    config.check_dim(dim)
    flow = Flow(config, dim)
    for keys, d in zip(layer_keys(config), config.level_dims(dim)):
        for key, spec in zip(keys[: len(config.step)], config.step):
            module = FLOW_LAYERS.get(spec.layer)
            try:
                # Abstract init of one layer: runs its setup (option checks) without compiling.
                jax.eval_shape(lambda m=module, s=spec, d=d: m(features=d, **s.kwargs()).init(
                    jax.random.key(0), jnp.zeros((2, d), jnp.float32), method='forward'))
            except (TypeError, ValueError) as e:
                raise FlowError(f'flow layer {spec.layer!r} with options {spec.kwargs()} on '
                                f'{d} channels: {e}') from None
    return flow
