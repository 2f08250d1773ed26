"""The oneMKL bf16 product behind XLA's FFI: exact against a float64 product of the same bf16
operands, the same values and gradients as XLA's dot inside the encoder's matmul, and the
choice of kernel made as documented."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxsim.models import ops
from jaxsim.native import blas_gemm


def test_the_kernel_loads_here():
    # The test extra installs oneMKL and `make test` a C++ compiler: the kernel must load.
    assert blas_gemm.unavailable_reason() is None


def _bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _exact(a, b, transpose_a, transpose_b):
    a64 = np.asarray(a, np.float64)
    b64 = np.asarray(b, np.float64)
    return (a64.T if transpose_a else a64) @ (b64.T if transpose_b else b64)


@pytest.mark.parametrize("m,k,n", [(17, 33, 5), (1, 64, 300), (300, 200, 1), (640, 512, 96),
                                   (96, 2048, 700)])
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, False),
                                                      (False, True), (True, True)])
def test_product_equals_float64_product_of_the_same_operands(m, k, n, transpose_a,
                                                             transpose_b):
    # The larger shapes split into blocks over XLA's threads (rows or columns): a wrong offset
    # or leading dimension in any block shows here.
    rng = np.random.default_rng(m * 7 + n)
    a = _bf16(rng, (k, m) if transpose_a else (m, k))
    b = _bf16(rng, (n, k) if transpose_b else (k, n))
    got = jax.jit(lambda a, b: blas_gemm.bf16_gemm(a, b, transpose_a=transpose_a,
                                                   transpose_b=transpose_b))(a, b)
    want = _exact(a, b, transpose_a, transpose_b)
    assert got.dtype == jnp.float32 and got.shape == (m, n)
    # Products of bf16 values are exact in float32; only the float32 sums round.
    bound = 4 * k * np.finfo(np.float32).eps * np.abs(np.asarray(a, np.float64)).max() \
        * np.abs(np.asarray(b, np.float64)).max()
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=bound)


def test_empty_operands_and_shapes_are_checked():
    a = jnp.zeros((4, 0), jnp.bfloat16)
    b = jnp.zeros((0, 3), jnp.bfloat16)
    np.testing.assert_array_equal(blas_gemm.bf16_gemm(a, b), np.zeros((4, 3), np.float32))
    no_rows = blas_gemm.bf16_gemm(jnp.zeros((0, 5), jnp.bfloat16), jnp.ones((5, 3), jnp.bfloat16))
    assert no_rows.shape == (0, 3) and no_rows.dtype == jnp.float32
    with pytest.raises(ValueError, match="contraction sizes differ"):
        blas_gemm.bf16_gemm(jnp.zeros((4, 5), jnp.bfloat16), jnp.zeros((6, 3), jnp.bfloat16))


def test_concurrent_products_and_vmap():
    # Two independent products in one program may run at once on XLA's threads, each handing
    # blocks to the same pool: both must finish (no wait on a task that never starts).
    rng = np.random.default_rng(1)
    a, b = _bf16(rng, (1024, 384)), _bf16(rng, (384, 1536))
    c, d = _bf16(rng, (1536, 384)), _bf16(rng, (384, 1024))

    @jax.jit
    def two(a, b, c, d):
        return blas_gemm.bf16_gemm(a, b), blas_gemm.bf16_gemm(c, d)

    for _ in range(3):
        ab, cd = two(a, b, c, d)
    np.testing.assert_allclose(ab, _exact(a, b, False, False), rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(cd, _exact(c, d, False, False), rtol=1e-5, atol=1e-3)
    stack_a = _bf16(rng, (3, 40, 24))
    batched = jax.vmap(lambda x: blas_gemm.bf16_gemm(x, b[:24]))(stack_a)
    for i in range(3):
        np.testing.assert_allclose(batched[i], _exact(stack_a[i], b[:24], False, False),
                                   rtol=1e-5, atol=1e-4)


def _loss(x, w):
    return jnp.sum(jnp.tanh(ops.matmul(x, w, jnp.bfloat16)) * jnp.arange(w.shape[-1]))


def test_encoder_matmul_through_the_blas_equals_xla_values_and_gradients(monkeypatch):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((4, 48, 384)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((384, 3, 128)) * 0.05, jnp.float32)
    results = {}
    for mode in ("xla", "blas"):
        monkeypatch.setenv(blas_gemm.MODE_ENV, mode)
        step = jax.jit(jax.value_and_grad(_loss, argnums=(0, 1)))
        hlo = step.lower(x, w).as_text()
        # Forward, input gradient and weight gradient: three products through the kernel.
        assert hlo.count("jaxsim_bf16_gemm") == (3 if mode == "blas" else 0)
        results[mode] = step(x, w)
    for xla, blas in zip(jax.tree.leaves(results["xla"]), jax.tree.leaves(results["blas"])):
        scale = float(jnp.max(jnp.abs(xla)))
        # The input gradient is rounded to bf16 after its float32 sum: a different summation
        # order may land on the neighbouring bf16 value (2**-7 of the value at most). On a CPU
        # without bf16 instructions XLA emulates its bf16 dot and rounds at other points, so a
        # few elements that cancel differ by more (seen: 4e-5 of the leaf's largest value).
        np.testing.assert_allclose(blas, xla, rtol=2.0**-7, atol=2e-4 * scale)
        off = np.abs(np.asarray(blas) - np.asarray(xla)) > 1e-5 * scale
        assert off.mean() < 0.01  # only rare neighbours


def test_kernel_choice(monkeypatch):
    monkeypatch.setenv(blas_gemm.MODE_ENV, "blas")
    assert blas_gemm.use_blas_gemm(jnp.bfloat16)
    assert not blas_gemm.use_blas_gemm(jnp.float32)  # float32 products stay with XLA
    monkeypatch.setenv(blas_gemm.MODE_ENV, "xla")
    assert not blas_gemm.use_blas_gemm(jnp.bfloat16)
    monkeypatch.setenv(blas_gemm.MODE_ENV, "auto")
    assert blas_gemm.use_blas_gemm(jnp.bfloat16) == (jax.device_count() == 1
                                                      and blas_gemm._cpu_has_amx())
    monkeypatch.delenv(blas_gemm.MODE_ENV)
    assert not blas_gemm.use_blas_gemm(jnp.bfloat16)  # opt-in
    monkeypatch.setenv(blas_gemm.MODE_ENV, "fast")
    with pytest.raises(blas_gemm.NativeKernelError, match="JAXSIM_CPU_GEMM='fast'"):
        blas_gemm.use_blas_gemm(jnp.bfloat16)


def test_a_failed_build_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv(blas_gemm.DIR_ENV, str(tmp_path / "native"))
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(blas_gemm.NativeKernelError, match="building bf16_gemm.cc failed"):
        blas_gemm._compiled_library()
    assert not list((tmp_path / "native").glob("*.so"))  # nothing half-written is left


def test_hlo_cost_counts_the_kernels_products(monkeypatch):
    # XLA's cost analysis cannot see into a custom call; the benchmarks add these FLOPs back.
    monkeypatch.setenv(blas_gemm.MODE_ENV, "blas")
    x = jnp.ones((6, 10, 32), jnp.float32)
    w = jnp.ones((32, 24), jnp.float32)
    compiled = jax.jit(jax.grad(_loss, argnums=(0, 1))).lower(x, w).compile()
    cost = blas_gemm.hlo_cost(compiled.as_text())
    tokens = 6 * 10
    assert cost["flops"] == 3 * 2 * tokens * 32 * 24  # forward, input and weight gradients
    assert cost["bytes accessed"] == (2 * (tokens * 32 + 32 * 24) + 4 * tokens * 24
                                      + 2 * (tokens * 24 + 32 * 24) + 4 * tokens * 32
                                      + 2 * (tokens * 32 + tokens * 24) + 4 * 32 * 24)
