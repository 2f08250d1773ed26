"""Bijectors over vectors, as Flax linen modules, and the registry flow configs name them by.

Every bijector maps data x [batch, dim] to a latent z [batch, dim] (the "normalizing" direction,
the one BERT-flow trains) and exposes

  forward(x) -> FlowOutput(z, logdet)   # logdet = log|det dz/dx| per row, [batch]
  inverse(z) -> x

and may expose `init_from_batch(x) -> FlowOutput` for data-dependent initialisation (applied with
`mutable=['params']`, never a side effect of a call). A sentence vector is treated as a 1x1
image with `dim` channels, so Glow's 1x1 convolution is a dim x dim matrix.

`FLOW_LAYERS` maps a name to a module class built as `cls(features=dim, **options)`; user code
adds a bijector with `@FLOW_LAYERS.register('name')` and names it in a flow config.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from typing import Iterator, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxsim.registry import Registry, describe


def _check_flow_layer(entry) -> Optional[str]:
    """A registered flow layer: a linen bijector built as `cls(features=dim, **options)`."""
    if not (inspect.isclass(entry) and issubclass(entry, nn.Module)):
        return f"must be a flax.linen Module class, got {describe(entry)}"
    missing = [m for m in ("forward", "inverse") if not callable(getattr(entry, m, None))]
    if missing:
        return (f"must define {' and '.join(f'{m}()' for m in missing)} (forward(x) -> "
                f"FlowOutput(z, logdet), inverse(z) -> x); {entry.__qualname__} does not")
    # Built as cls(features=dim, **options): its other fields may come from the flow config.
    if 'features' not in inspect.signature(entry).parameters:
        return f"must take a `features` field (the channels); {entry.__qualname__} does not"
    return None


FLOW_LAYERS: Registry = Registry('flow layer', check=_check_flow_layer)

# Data-dependent actnorm init standardizes only channels whose batch std exceeds this fraction of
# the median channel std. A channel below it is (near-)constant in the batch: it is centered but
# not amplified (gain 1). See `ActNorm.init_from_batch` for why amplifying it diverges.
ACTNORM_REL_FLOOR = 1e-3


class FlowOutput(flax.struct.PyTreeNode):
    """Result of a bijector's forward pass; unpacks like a tuple: `z, logdet = out`."""

    z: jax.Array  # [batch, dim] the transformed rows
    logdet: jax.Array  # [batch] log|det dz/dx| of each row

    def __iter__(self) -> Iterator[jax.Array]:
        yield self.z
        yield self.logdet


def constant_logdet(x: jax.Array, value) -> jax.Array:
    """[batch] float32 filled with `value` (a layer whose logdet does not depend on the row)."""
    return jnp.full(x.shape[:1], value, jnp.float32)


def tf_default_uniform(fan_out: int):
    """TF1's default variable initializer (glorot uniform) for a [1, 1, 1, C] variable.

    `tf.get_variable` without an initializer draws U(-l, l) with l = sqrt(6 / (fan_in +
    fan_out)); for Glow's (1, 1, 1, C) actnorm variables fan_in = 1 and fan_out = C. Drawn on
    the host (see `_host_init`).
    """
    limit = math.sqrt(6.0 / (1 + fan_out))
    return _host_init(lambda rng, shape: rng.uniform(-limit, limit, shape))


ACTNORM_INITS = ('data', 'zeros', 'tf_default')


@FLOW_LAYERS.register('actnorm')
class ActNorm(nn.Module):
    """Per-channel affine map (Glow's actnorm, Kingma & Dhariwal 2018).

    With s = logscale_factor * logs:
      bias='output': z = x * exp(s) + b   (bias in output units)
      bias='input':  z = (x + b) * exp(s) (Glow / BERT-flow: centre, then scale)

    Attributes:
      features: number of channels `dim`.
      initialization: 'data' (params start at the identity; `init_from_batch` standardizes a batch),
        'zeros' (identity, no data init) or 'tf_default' (BERT-flow as executed: its data
        init op is never run, so b and logs keep TF's default glorot-uniform draw).
      logscale_factor: s = factor * logs (Glow/BERT-flow use 3: faster convergence of the
        scale).
      bias: 'output' or 'input', see above.
    """

    features: int
    initialization: str = 'data'
    logscale_factor: float = 1.0
    bias: str = 'output'

    def setup(self):
        if self.initialization not in ACTNORM_INITS:
            raise ValueError(f'actnorm: initialization={self.initialization!r}, expected one '
                             f'of {ACTNORM_INITS}')
        if self.bias not in ('output', 'input'):
            raise ValueError(f"actnorm: bias={self.bias!r}, expected 'output' or 'input'")
        init = (tf_default_uniform(self.features) if self.initialization == 'tf_default'
                else nn.initializers.zeros)
        self.b = self.param('b', init, (self.features,))  # [dim]
        self.logs = self.param('logs', init, (self.features,))  # [dim]

    def _forward(self, x, b, logs) -> FlowOutput:
        s = self.logscale_factor * logs
        z = (x + b) * jnp.exp(s) if self.bias == 'input' else x * jnp.exp(s) + b
        return FlowOutput(z, constant_logdet(x, jnp.sum(s)))

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch])."""
        return self._forward(x, self.b, self.logs)

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim]."""
        s = self.logscale_factor * self.logs
        return z * jnp.exp(-s) - self.b if self.bias == 'input' else (z - self.b) * jnp.exp(-s)

    def init_from_batch(self, x: jax.Array) -> FlowOutput:
        """Sets b/logs so this batch comes out zero-mean, unit-variance per channel.

        A channel with (near-)zero spread in the batch is only centered, gain 1. In a flow
        whose couplings start as identities, a constant input channel stays constant through
        every layer at init, so each later actnorm would see zero spread and, if it divided by
        a floored std, get a huge gain (1e3 per layer). Once training moves a coupling shift
        by ~lr, that channel is no longer constant and the stacked gains multiply it: RealNVP
        (6 actnorms, nothing mixing channels) reached |z| ~ 1e15 and an NLL ~ 1e30 after one
        step. Gain 1 keeps every layer's Lipschitz constant at init independent of the data's
        degeneracy; the likelihood then grows the scale at the optimizer's pace.

        Apply with `mutable=['params']`; returns the forward pass with the new values.

        Args:
          x: [batch, dim] the initialisation batch.
        """
        if self.initialization != 'data':
            return self.forward(x)
        mean = jnp.mean(x, axis=0)  # [dim]
        std = jnp.std(x, axis=0)  # [dim]
        live = std > ACTNORM_REL_FLOOR * jnp.median(std)
        scale = jnp.where(live, std, 1.0)
        logs = -jnp.log(scale) / self.logscale_factor
        b = -mean if self.bias == 'input' else -mean / scale
        self.put_variable('params', 'b', b)
        self.put_variable('params', 'logs', logs)
        return self._forward(x, b, logs)


@FLOW_LAYERS.register('reverse')
class Reverse(nn.Module):
    """Fixed channel reversal z[:, j] = x[:, dim-1-j]: no params, logdet 0.

    This is what BERT-flow's `invertible_1x1_conv(permutation=True)` executes (its configs all
    set "permutation": true): a non-trainable 1x1 conv whose kernel is the anti-identity.
    """

    features: int

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch] = 0)."""
        return FlowOutput(x[:, ::-1], constant_logdet(x, 0.0))

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim]."""
        return z[:, ::-1]


@FLOW_LAYERS.register('linear')
class InvertibleLinear(nn.Module):
    """z = x @ W with a dense invertible W (Glow's 1x1 conv on a 1x1 image); O(D^3) logdet."""

    features: int

    def setup(self):
        # A random rotation: invertible, logdet 0 at init.
        self.kernel = self.param('kernel', _random_rotation,
                                 (self.features, self.features))  # [dim, dim]

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch])."""
        _, logabsdet = jnp.linalg.slogdet(self.kernel)
        return FlowOutput(x @ self.kernel, constant_logdet(x, logabsdet))

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim], solving x W = z."""
        return jnp.linalg.solve(self.kernel.T, z.T).T


def single_threaded_blas():
    """Limits host BLAS to one thread (its pool slows a small QR on a busy machine; figures in
    docs/performance.md). No-op without threadpoolctl."""
    try:
        import threadpoolctl
    except ImportError:
        return contextlib.nullcontext()
    return threadpoolctl.threadpool_limits(1, user_api='blas')


def _host_rng(key_data) -> np.random.Generator:
    return np.random.default_rng(np.asarray(key_data).astype(np.uint64))


def _host_init(draw):
    """Initializer computing `draw(generator, shape)` with NumPy through `pure_callback`, as
    float32: nothing per layer for XLA to compile (docs/performance.md, flow fit)."""

    def init(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
        del dtype
        return jax.pure_callback(lambda kd: draw(_host_rng(kd), shape).astype(np.float32),
                                 jax.ShapeDtypeStruct(shape, jnp.float32),
                                 jax.random.key_data(key))

    return init


def _host_rotation(rng: np.random.Generator, features: int) -> np.ndarray:
    """A Haar-random rotation [features, features] drawn on the host."""
    with single_threaded_blas():
        q, r = np.linalg.qr(rng.standard_normal((features, features)))
    return q * np.sign(np.diag(r))


# Initializer: a random rotation (invertible, logdet 0).
_random_rotation = _host_init(lambda rng, shape: _host_rotation(rng, shape[0]))


def host_normal(stddev: float | None = None):
    """Initializer: N(0, stddev^2) drawn on the host (default stddev 1/sqrt(fan_in))."""

    def draw(rng: np.random.Generator, shape) -> np.ndarray:
        return rng.standard_normal(shape) * (stddev if stddev is not None
                                             else 1.0 / math.sqrt(shape[0]))

    return _host_init(draw)


def _lu_init(key: jax.Array, features: int) -> dict[str, jax.Array]:
    """LU parameters of a random rotation: W = P L (U + diag(sign * exp(log_s)))."""

    def host(key_data):
        w = _host_rotation(_host_rng(key_data), features)
        import scipy.linalg  # on first use, not at every command's start-up
        with single_threaded_blas():
            p, lower, u = scipy.linalg.lu(w)
        s = np.diag(u)
        out = {
            'perm': p,  # [dim, dim] fixed permutation
            'lower': lower,  # [dim, dim] only the strict lower triangle is used
            'upper': np.triu(u, 1),  # [dim, dim] only the strict upper triangle is used
            'log_s': np.log(np.abs(s)),  # [dim]
            'sign_s': np.sign(s),  # [dim] fixed signs
        }
        return {k: v.astype(np.float32) for k, v in out.items()}

    mat = jax.ShapeDtypeStruct((features, features), jnp.float32)
    vec = jax.ShapeDtypeStruct((features,), jnp.float32)
    return jax.pure_callback(host, {'perm': mat, 'lower': mat, 'upper': mat, 'log_s': vec,
                                    'sign_s': vec}, jax.random.key_data(key))


@FLOW_LAYERS.register('linear_lu')
class InvertibleLinearLU(nn.Module):
    """LU-parameterized invertible linear map (Glow section 3.2): logdet = sum(log_s) in O(D).

    The permutation and the signs of the diagonal are fixed at init; they sit in the params tree
    (so they are saved) behind `stop_gradient`, so the optimizer never moves them.
    """

    features: int

    def setup(self):
        self.lu = self.param('lu', _lu_init, self.features)

    def _factors(self):
        perm = jax.lax.stop_gradient(self.lu['perm'])
        sign_s = jax.lax.stop_gradient(self.lu['sign_s'])
        eye = jnp.eye(self.features, dtype=jnp.float32)
        lower = jnp.tril(self.lu['lower'], -1) + eye  # unit lower triangular
        upper = jnp.triu(self.lu['upper'], 1) + jnp.diag(sign_s * jnp.exp(self.lu['log_s']))
        return perm, lower, upper

    def weight(self) -> jax.Array:
        """The dense matrix W [dim, dim]."""
        perm, lower, upper = self._factors()
        return perm @ lower @ upper

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch])."""
        perm, lower, upper = self._factors()
        # x P is a column gather; then two [batch, dim] x [dim, dim] products. Recomposing W
        # would cost 2 dim^3 per call, more than this whenever batch < dim.
        src = jnp.argmax(perm, axis=0)  # [dim] z[:, j] = x[:, src[j]]
        z = (x[:, src] @ lower) @ upper
        return FlowOutput(z, constant_logdet(x, jnp.sum(self.lu['log_s'])))

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim] by two triangular solves (x P L U = z)."""
        perm, lower, upper = self._factors()
        solve = jax.scipy.linalg.solve_triangular
        y = solve(upper.T, z.T, lower=True).T  # y = z U^-1
        y = solve(lower.T, y.T, lower=False, unit_diagonal=True).T  # y = z U^-1 L^-1
        return y @ perm.T
