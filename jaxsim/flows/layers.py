"""Bijectors for flows over vectors, as Flax linen modules.

Every bijector maps data x [batch, dim] to a latent z [batch, dim] ("normalizing" direction, the
direction BERT-flow trains: log p(u) = log p_Z(f^-1(u)) + log|det d f^-1(u) / du|) and exposes

  forward(x) -> FlowOutput(z, logdet)   # logdet = log|det dz/dx| per row, [batch]
  inverse(z) -> x

A sentence vector is treated as a 1x1 image with `dim` channels, so Glow's 1x1 convolution is a
dim x dim matrix and its couplings split channels. Data-dependent actnorm initialisation is the
explicit `init_from_batch` method (run with `mutable=['params']`), never a side effect of a call.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

# Actnorm divides by the batch std, floored at this fraction of the median channel std (plus an
# absolute epsilon) so constant channels stay finite and well conditioned.
_ACTNORM_REL_FLOOR = 1e-3
_ACTNORM_EPS = 1e-12


class FlowOutput(flax.struct.PyTreeNode):
    """Result of a bijector's forward pass.

    Unpacks like a tuple: `z, logdet = layer.forward(x)`.

    Attributes:
      z: [batch, dim] the transformed rows.
      logdet: [batch] log|det dz/dx| of each row.
    """

    z: jax.Array
    logdet: jax.Array

    def __iter__(self) -> Iterator[jax.Array]:
        yield self.z
        yield self.logdet


def _zeros_logdet(x: jax.Array) -> jax.Array:
    return jnp.zeros(x.shape[:1], jnp.float32)


class ActNorm(nn.Module):
    """Per-channel affine map z = x * exp(logscale) + bias (Glow's actnorm, Kingma & Dhariwal 2018).

    Unlike Glow's (x + bias) * exp(logscale), the bias lives in output units: sentence vectors
    have channels with tiny spread (all-MiniLM-L6-v2 avg has exactly constant ones), where an
    input-unit bias turns each Adam step of 1e-3 into a jump of 1e-3 / std in z and diverges.

    Attributes:
      features: number of channels `dim`.
    """

    features: int

    def setup(self):
        self.bias = self.param('bias', nn.initializers.zeros, (self.features,))  # [dim]
        self.logscale = self.param('logscale', nn.initializers.zeros, (self.features,))  # [dim]

    def _forward(self, x, bias, logscale) -> FlowOutput:
        z = x * jnp.exp(logscale) + bias
        return FlowOutput(z, jnp.full(x.shape[:1], jnp.sum(logscale), jnp.float32))

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch])."""
        return self._forward(x, self.bias, self.logscale)

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim]."""
        return (z - self.bias) * jnp.exp(-self.logscale)

    def init_from_batch(self, x: jax.Array) -> FlowOutput:
        """Sets bias/logscale so that this batch comes out zero-mean, unit-variance per channel.

        Must be applied with `mutable=['params']`; returns the forward pass with the new values.

        Args:
          x: [batch, dim] the initialisation batch.
        """
        mean = jnp.mean(x, axis=0)
        std = jnp.std(x, axis=0)
        # Floor (near-)constant channels relative to the typical spread: dividing by ~0 makes
        # the channel's density unbounded and the fit diverge.
        std = jnp.maximum(std, _ACTNORM_REL_FLOOR * jnp.median(std) + _ACTNORM_EPS)
        logscale = -jnp.log(std)
        bias = -mean / std
        self.put_variable('params', 'bias', bias)
        self.put_variable('params', 'logscale', logscale)
        return self._forward(x, bias, logscale)


class InvertibleLinear(nn.Module):
    """z = x @ W with a dense invertible W (Glow's 1x1 conv on a 1x1 image); O(D^3) logdet.

    Attributes:
      features: number of channels `dim`.
    """

    features: int

    def setup(self):
        # A random rotation: invertible, logdet 0 at init.
        self.kernel = self.param('kernel', _random_rotation,
                                 (self.features, self.features))  # [dim, dim]

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch])."""
        _, logabsdet = jnp.linalg.slogdet(self.kernel)
        return FlowOutput(x @ self.kernel, jnp.full(x.shape[:1], logabsdet, jnp.float32))

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim], solving x W = z."""
        return jnp.linalg.solve(self.kernel.T, z.T).T


def _single_threaded_blas():
    """Limits host BLAS to one thread: on a busy machine OpenBLAS's thread pool makes a 384x384
    QR 50x slower (seconds instead of milliseconds). No-op without threadpoolctl."""
    try:
        import threadpoolctl
    except ImportError:
        return contextlib.nullcontext()
    return threadpoolctl.threadpool_limits(1)


def _host_rotation(key_data: np.ndarray, features: int) -> np.ndarray:
    """A Haar-random rotation [features, features] drawn on the host from raw key data."""
    rng = np.random.default_rng(np.asarray(key_data).astype(np.uint64))
    with _single_threaded_blas():
        q, r = np.linalg.qr(rng.standard_normal((features, features)))
    return q * np.sign(np.diag(r))


def _random_rotation(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
    """Initializer: a random rotation computed with NumPy through `pure_callback`.

    XLA needs seconds to compile a QR (and an LU) per layer on CPU; on the host it is
    milliseconds, which keeps flow fitting cheap next to encoding.
    """
    del dtype
    return jax.pure_callback(
        lambda kd: _host_rotation(kd, shape[0]).astype(np.float32),
        jax.ShapeDtypeStruct(shape, jnp.float32), jax.random.key_data(key))


def _host_lecun_normal(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
    """N(0, 1/fan_in) kernel drawn on the host (same reason as `_random_rotation`)."""
    del dtype

    def host(kd):
        rng = np.random.default_rng(np.asarray(kd).astype(np.uint64))
        return (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)

    return jax.pure_callback(host, jax.ShapeDtypeStruct(shape, jnp.float32),
                             jax.random.key_data(key))


def _lu_init(key: jax.Array, features: int) -> dict[str, jax.Array]:
    """LU parameters of a random rotation: W = P L (U + diag(sign * exp(log_s)))."""

    def host(key_data):
        w = _host_rotation(key_data, features)
        with _single_threaded_blas():
            p, l, u = scipy.linalg.lu(w)
        s = np.diag(u)
        out = {
            'perm': p,  # [dim, dim] fixed permutation
            'lower': l,  # [dim, dim] only the strict lower triangle is used
            'upper': np.triu(u, 1),  # [dim, dim] only the strict upper triangle is used
            'log_s': np.log(np.abs(s)),  # [dim]
            'sign_s': np.sign(s),  # [dim] fixed signs
        }
        return {k: v.astype(np.float32) for k, v in out.items()}

    mat, vec = (features, features), (features,)
    shapes = {'perm': mat, 'lower': mat, 'upper': mat, 'log_s': vec, 'sign_s': vec}
    return jax.pure_callback(
        host, {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes.items()},
        jax.random.key_data(key))


class InvertibleLinearLU(nn.Module):
    """LU-parameterized invertible linear map (Glow section 3.2): logdet = sum(log_s) in O(D).

    The permutation and the signs of the diagonal are fixed at init; they sit in the params tree
    (so they are saved) behind `stop_gradient`, so Adam never moves them (zero gradients give
    zero Adam updates).

    Attributes:
      features: number of channels `dim`.
    """

    features: int

    def setup(self):
        self.lu = self.param('lu', _lu_init, self.features)

    def _factors(self):
        d = self.features
        perm = jax.lax.stop_gradient(self.lu['perm'])
        sign_s = jax.lax.stop_gradient(self.lu['sign_s'])
        eye = jnp.eye(d, dtype=jnp.float32)
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
        logdet = jnp.sum(self.lu['log_s'])
        return FlowOutput(z, jnp.full(x.shape[:1], logdet, jnp.float32))

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim] by two triangular solves (x P L U = z)."""
        perm, lower, upper = self._factors()
        solve = jax.scipy.linalg.solve_triangular
        y = solve(upper.T, z.T, lower=True).T  # y = z U^-1
        y = solve(lower.T, y.T, lower=False, unit_diagonal=True).T  # y = z U^-1 L^-1
        return y @ perm.T


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
        raise ValueError(f"mask={mask!r}, expected 'half' or 'parity'")
    return (b, a) if flip else (a, b)


class CouplingNet(nn.Module):
    """ReLU MLP whose last layer starts at zero, so a new coupling is the identity (Glow's
    ZeroConv2d).

    Attributes:
      width: hidden width.
      hidden_layers: number of hidden Dense+ReLU layers.
      out_features: output size.
    """

    width: int
    hidden_layers: int
    out_features: int

    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        for _ in range(self.hidden_layers):
            h = nn.relu(nn.Dense(self.width, kernel_init=_host_lecun_normal)(h))
        return nn.Dense(self.out_features, kernel_init=nn.initializers.zeros)(h)


class _Coupling(nn.Module):
    """Shared plumbing: split channels into (a, b), transform b conditioned on a, reassemble."""

    features: int
    width: int = 32
    hidden_layers: int = 2
    mask: str = 'half'
    flip: bool = False

    def _split(self, x):
        """x [batch, dim] -> (a [batch, n_a], b [batch, n_b], merge info, n_b)."""
        d, h = self.features, self.features // 2
        # Slices and reshapes instead of gathers: a gather's gradient is a scatter, slow on CPU.
        if self.mask == 'half':
            a, b = x[:, :h], x[:, h:]
            return (b, a, 'half_flip', h) if self.flip else (a, b, 'half', d - h)
        if d % 2 == 0:
            pairs = x.reshape(x.shape[0], h, 2)  # [batch, dim/2, (even, odd)]
            a, b = pairs[..., 0], pairs[..., 1]
            return (b, a, 'pairs_flip', h) if self.flip else (a, b, 'pairs', h)
        a_idx, b_idx = coupling_indices(d, self.mask, self.flip)
        # inv puts the concatenation [a, b] back into channel order.
        inv = np.argsort(np.concatenate([a_idx, b_idx]))
        return x[:, a_idx], x[:, b_idx], inv, len(b_idx)

    @staticmethod
    def _merge(a, b, how):
        if isinstance(how, str):
            if how.endswith('_flip'):
                a, b = b, a
            if how.startswith('half'):
                return jnp.concatenate([a, b], axis=-1)
            return jnp.stack([a, b], axis=-1).reshape(a.shape[0], -1)
        return jnp.concatenate([a, b], axis=-1)[:, how]


class AdditiveCoupling(_Coupling):
    """z_b = x_b + t(x_a), z_a = x_a; volume preserving (logdet 0), Glow's additive coupling.

    Attributes:
      features: channels; width / hidden_layers: the shift net; mask / flip: see
        `coupling_indices`.
    """

    def setup(self):
        _, b_idx = coupling_indices(self.features, self.mask, self.flip)
        self.net = CouplingNet(self.width, self.hidden_layers, len(b_idx))

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch] = 0)."""
        a, b, inv, _ = self._split(x)
        return FlowOutput(self._merge(a, b + self.net(a), inv), _zeros_logdet(x))

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim]."""
        a, b, inv, _ = self._split(z)
        return self._merge(a, b - self.net(a), inv)


class AffineCoupling(_Coupling):
    """z_b = x_b * exp(s(x_a)) + t(x_a) with s = tanh(.) bounded (RealNVP, Dinh et al. 2017).

    tanh keeps each step's scale in [1/e, e] so early training cannot blow up; actnorm handles
    the large per-channel rescaling.

    Attributes:
      features: channels; width / hidden_layers: the scale/shift net; mask / flip: see
        `coupling_indices`.
    """

    def setup(self):
        _, b_idx = coupling_indices(self.features, self.mask, self.flip)
        self.net = CouplingNet(self.width, self.hidden_layers, 2 * len(b_idx))

    def _scale_shift(self, a, n_b):
        h = self.net(a)  # [batch, 2 * n_b]
        return jnp.tanh(h[:, :n_b]), h[:, n_b:]

    def forward(self, x: jax.Array) -> FlowOutput:
        """x: [batch, dim] -> FlowOutput(z [batch, dim], logdet [batch])."""
        a, b, inv, n_b = self._split(x)
        log_s, t = self._scale_shift(a, n_b)
        z = self._merge(a, b * jnp.exp(log_s) + t, inv)
        return FlowOutput(z, jnp.sum(log_s, axis=-1))

    def inverse(self, z: jax.Array) -> jax.Array:
        """z: [batch, dim] -> x [batch, dim]."""
        a, b, inv, n_b = self._split(z)
        log_s, t = self._scale_shift(a, n_b)
        return self._merge(a, (b - t) * jnp.exp(-log_s), inv)
