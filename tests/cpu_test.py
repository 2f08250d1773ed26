"""jaxsim.cpu: reading the CPU's bf16 instructions, and the one warning that bf16 compute is
emulated (slower than float32) on a CPU without them."""
from __future__ import annotations

import logging
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxsim
from jaxsim import cpu
from jaxsim.search import SearchIndex


def _flags_in_proc() -> frozenset | None:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((frozenset(x.split(":", 1)[1].split()) for x in lines if x.startswith("flags")),
                None)


def test_cpu_flags_are_the_first_cpus_flags():
    assert cpu.cpu_flags() == _flags_in_proc()


@pytest.fixture
def host(monkeypatch):
    """Sets the flags and machine the module sees; resets the once-per-process warning."""
    def set_host(flags, machine="x86_64"):
        monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
        monkeypatch.setattr(cpu.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu, "_warned", False)
    return set_host


def test_bf16_is_emulated_only_on_x86_cpus_without_bf16_instructions(host):
    host(frozenset({"avx2", "fma"}))
    assert cpu.bf16_emulated(["cpu"])
    assert not cpu.bf16_emulated(["gpu"]) and not cpu.bf16_emulated(["tpu"])
    host(frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert not cpu.bf16_emulated(["cpu"])
    host(frozenset({"avx2", "amx_bf16"}))
    assert not cpu.bf16_emulated(["cpu"])
    host(None)  # flags unreadable: not claimed
    assert not cpu.bf16_emulated(["cpu"])
    host(frozenset({"fp", "asimd"}), machine="aarch64")
    assert not cpu.bf16_emulated(["cpu"])


def test_the_warning_is_logged_once_for_every_spelling_of_bf16(host, caplog):
    host(frozenset({"avx2"}))
    with caplog.at_level(logging.WARNING, logger="jaxsim.cpu"):
        assert not cpu.warn_if_bf16_emulated("float32", ["cpu"])
        assert not cpu.warn_if_bf16_emulated(jnp.float32, ["cpu"])
        for dtype in ("bfloat16", jnp.bfloat16, jnp.dtype(jnp.bfloat16)):
            assert cpu.warn_if_bf16_emulated(dtype, ["cpu"])
    assert [r.getMessage() for r in caplog.records] == [
        "bf16 compute is emulated on this CPU (no AVX512_BF16 or AMX): float32 runs faster here"]


def test_encode_in_bf16_warns_on_such_a_cpu(host, bundled, caplog):
    host(frozenset({"avx2"}))
    with caplog.at_level(logging.WARNING, logger="jaxsim.cpu"):
        vectors = jaxsim.encode(bundled, ["a sentence"], dtype=jnp.bfloat16)
        jaxsim.encode(bundled, ["a sentence"])
    assert np.isfinite(vectors).all()
    assert len([r for r in caplog.records if "emulated" in r.getMessage()]) == 1


def test_a_bf16_corpus_index_warns_on_such_a_cpu(host, caplog):
    host(frozenset({"avx2"}))
    vectors = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="jaxsim.cpu"):
        SearchIndex.from_vectors(vectors)
        assert not caplog.records  # a float32 corpus says nothing
        index = SearchIndex.from_vectors(vectors, corpus_dtype="bfloat16")
    assert [r.getMessage() for r in caplog.records] == [
        "bf16 compute is emulated on this CPU (no AVX512_BF16 or AMX): float32 runs faster here"]
    assert index.search_vectors(vectors[:3], top_k=1).rows[:, 0].tolist() == [0, 1, 2]
