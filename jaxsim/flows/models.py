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


def step_keys(config: FlowConfig) -> list[str]:
    """Keys of one step's layers in application order (param names: layers_<key>)."""
    return [f'{j}_{spec.layer}' for j, spec in enumerate(config.step)]


class Step(nn.Module):
    """One flow step: the config's `step` layers applied in order on `features` channels (those
    of its level)."""

    config: FlowConfig
    features: int

    def setup(self):
        self.layers = {key: FLOW_LAYERS.get(spec.layer)(features=self.features, **spec.kwargs())
                       for key, spec in zip(step_keys(self.config), self.config.step)}

    def _run(self, x, init: bool) -> FlowOutput:
        logdet = jnp.zeros(x.shape[:1], jnp.float32)
        for key in step_keys(self.config):
            layer = self.layers[key]
            init_here = init and hasattr(layer, 'init_from_batch')
            x, ld = layer.init_from_batch(x) if init_here else layer.forward(x)
            logdet = logdet + jnp.broadcast_to(ld, x.shape[:1])
        return FlowOutput(x, logdet)

    def forward(self, x: jax.Array) -> FlowOutput:
        return self._run(x, init=False)

    def init_from_batch(self, x: jax.Array) -> FlowOutput:
        return self._run(x, init=True)

    def inverse(self, z: jax.Array) -> jax.Array:
        for key in reversed(step_keys(self.config)):
            z = self.layers[key].inverse(z)
        return z


class Flow(nn.Module):
    """`config.levels` levels of `config.depth` steps over [batch, dim] vectors.

    Level l works on dim / 2^l channels; after every level but the last, the second half of
    the channels is factored out to the prior (Glow's split, as in BERT-flow). The steps of a
    level share one structure, so their params are stacked ([depth, ...] leaves under
    'l<level>') and the level runs as a `lax.scan` over them: the compiled program holds one
    step per level, not `depth`, which keeps the fit's compilation cheap.

    Attributes:
      config: the flow config (layers by registry name).
      dim: the embedding size; must pass `config.check_dim`.
    """

    config: FlowConfig
    dim: int

    def _step(self, level: int) -> Step:
        # parent=None: a detached module applied functionally to one slice of the stack.
        return Step(self.config, self.config.level_dims(self.dim)[level], parent=None)

    def setup(self):
        def init_level(key, level):
            step = self._step(level)
            x = jnp.zeros((1, step.features), jnp.float32)
            one = lambda k: step.init(k, x, method='forward').get('params', {})  # noqa: E731
            return jax.lax.map(one, jax.random.split(key, self.config.depth))

        self.stacks = [self.param(f'l{level}', init_level, level)
                       for level in range(self.config.levels)]

    def _level(self, level: int, x: jax.Array, init: bool) -> FlowOutput:
        step = self._step(level)

        def body(carry, params):
            x, logdet = carry
            if init:
                out, v = step.apply({'params': params}, x, method='init_from_batch',
                                    mutable=['params'])
                return (out.z, logdet + out.logdet), v.get('params', {})
            out = step.apply({'params': params}, x, method='forward')
            return (out.z, logdet + out.logdet), None

        (x, logdet), new = jax.lax.scan(body, (x, jnp.zeros(x.shape[:1], jnp.float32)),
                                        self.stacks[level], length=self.config.depth)
        if init:
            self.put_variable('params', f'l{level}', new)
        return FlowOutput(x, logdet)

    def _forward(self, x: jax.Array, init: bool) -> FlowOutput:
        eps = []  # factored-out halves, level 0 first
        logdet = jnp.zeros(x.shape[:1], jnp.float32)
        for level in range(self.config.levels):
            x, ld = self._level(level, x, init)
            logdet = logdet + ld
            if level < self.config.levels - 1:
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
        x = z[:, z.shape[-1] - dims[-1]:]
        for level in range(self.config.levels - 1, -1, -1):
            step = self._step(level)
            x, _ = jax.lax.scan(
                lambda x, params: (step.apply({'params': params}, x, method='inverse'), None),
                x, self.stacks[level], length=self.config.depth, reverse=True)
            if level > 0:
                start = sum(dims[1:level])  # eps of level l-1 has dims[l] channels
                x = jnp.concatenate([x, z[:, start: start + dims[level]]], axis=-1)
        return x


def make_flow(config: FlowConfig, dim: int) -> Flow:
    """The flow of `config` for `dim`-channel inputs, checked before anything is compiled.

    Raises:
      FlowError: `dim` cannot be split by the levels, or a layer rejects its options (the
        message names the layer).
    """
    config.check_dim(dim)
    flow = Flow(config, dim)
    for d in config.level_dims(dim):
        for spec in config.step:
            module = FLOW_LAYERS.get(spec.layer)
            try:
                # Abstract init of one layer: runs its setup (option checks) without compiling.
                jax.eval_shape(lambda m=module, s=spec, d=d: m(features=d, **s.kwargs()).init(
                    jax.random.key(0), jnp.zeros((2, d), jnp.float32), method='forward'))
            except (TypeError, ValueError) as e:
                raise FlowError(f'flow layer {spec.layer!r} with options {spec.kwargs()} on '
                                f'{d} channels: {e}') from None
    return flow
