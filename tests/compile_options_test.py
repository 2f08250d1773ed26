"""XLA compiler options by compile effort: what each effort asks of XLA:CPU, and that a
program compiled with them computes what the default compile computes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxsim import compile_options


def test_efforts_on_cpu():
    cpu = jax.local_devices()
    assert compile_options.for_effort(cpu, 'default') is None
    light = compile_options.for_effort(cpu, 'light')
    none = compile_options.for_effort(cpu, 'none')
    assert light['xla_backend_optimization_level'] == 1
    assert none['xla_backend_optimization_level'] == 0
    assert light['xla_cpu_use_fusion_emitters'] is False


def test_unknown_effort_is_refused():
    with pytest.raises(ValueError, match='compile effort'):
        compile_options.for_effort(jax.local_devices(), 'fast')


@pytest.mark.parametrize('effort', ['light', 'none'])
def test_same_results_as_the_default_compile(effort):
    def f(w, x):  # matmul, transcendental, reduction: the kinds of kernels a flow compiles
        h = jnp.tanh(x @ w) * jnp.exp(-0.5 * x[:, :8])
        return jnp.sum(jax.nn.relu(h), axis=-1), jax.grad(lambda w: jnp.sum(jnp.sin(x @ w)))(w)

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 8)).astype(np.float32)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    want = jax.jit(f)(w, x)
    got = jax.jit(f, compiler_options=compile_options.for_effort(jax.local_devices(), effort))(w, x)
    for a, b in zip(want, got):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
