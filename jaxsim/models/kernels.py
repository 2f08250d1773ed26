"""Which form of the encoder layer's hot operations a model runs: 'xla', 'cpu' or 'auto'.

  xla   plain JAX: products in the compute dtype (bf16 operands and result, as flax Dense and
        PyTorch autocast), JAX's own gradients, attention on the token-major layout. What XLA's
        TPU and GPU compilers fuse best.
  cpu   the custom-VJP forms of `jaxsim.models.ops` and `attention_ops`, written for XLA:CPU:
        float32 product results, bf16 operands, head-major attention. On CPU they are faster;
        compiled for TPU they move more bytes (see below).
  auto  'cpu' when JAX's default backend is the CPU, else 'xla'. The plan command compiles
        for TPU from a CPU process, so it resolves 'auto' as 'xla' itself.

Both forms compute the same function; under float32 compute they are the same arithmetic up
to rounding. Why two: compiled for TPU, the 'cpu' form's head-major layout costs transposes
and its float32 product results cost bytes (the plan command's figures: docs/pod.md); on a
CPU with bf16 instructions it encodes faster (docs/performance.md, "The CPU forms kept").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxsim.errors import ConfigError
from jaxsim.models import ops

KERNELS = ('auto', 'xla', 'cpu')


def use_cpu_forms(kernels: str) -> bool:
    """True where the layer runs the custom-VJP CPU forms."""
    if kernels not in KERNELS:
        raise ConfigError(f"kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
    return jax.default_backend() == 'cpu' if kernels == 'auto' else kernels == 'cpu'


def dense_bias(x: jax.Array, w: jax.Array, b: jax.Array, dtype, kernels: str) -> jax.Array:
    """x @ w + b: float32 in the 'cpu' form, `dtype` in the 'xla' form."""
    if use_cpu_forms(kernels):
        return ops.dense_bias(x, w, b, dtype)
    return jnp.dot(x.astype(dtype), w.astype(dtype)) + b.astype(dtype)


def dense_bias_gelu(x: jax.Array, w: jax.Array, b: jax.Array, dtype,
                    kernels: str) -> jax.Array:
    """Exact (erf) GELU of x @ w + b, in `dtype`."""
    if use_cpu_forms(kernels):
        return ops.dense_bias_gelu(x, w, b, dtype)
    return jax.nn.gelu(dense_bias(x, w, b, dtype, kernels), approximate=False)


def matmul(x: jax.Array, w: jax.Array, dtype, kernels: str) -> jax.Array:
    """x [..., in] @ w [in, *out]: float32 in the 'cpu' form, `dtype` in the 'xla' form."""
    if use_cpu_forms(kernels):
        return ops.matmul(x, w, dtype)
    out = jnp.dot(x.astype(dtype), w.reshape(w.shape[0], -1).astype(dtype))
    return out.reshape(x.shape[:-1] + w.shape[1:])
