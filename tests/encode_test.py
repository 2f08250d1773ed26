"""encode(): order, batch invariance, bucketing, edge cases and the command line."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import jaxsim
from jaxsim.encode import bucket_length

SENTENCES = [
    "a man is playing a guitar .",
    "",
    "the cat sat on the mat .",
    "a woman is slicing an onion with a very sharp knife in the kitchen .",
    "dogs .",
    "over-long " * 300,  # far beyond max_length: truncated, not an error
]


def test_bucket_lengths_are_few():
    buckets = {bucket_length(n, 512) for n in range(2, 513)}
    assert len(buckets) <= 20
    assert all(bucket_length(n, 512) >= n for n in range(2, 513))
    assert bucket_length(600, 256) == 256


def test_order_and_batch_invariance(bundled):
    full = jaxsim.encode(bundled, SENTENCES, pooler="avg", batch_size=64, max_length=128)
    assert full.shape == (len(SENTENCES), 384) and full.dtype == np.float32
    assert np.isfinite(full).all()
    # Batch size 1: every sentence padded only to its own bucket, alone in its batch.
    single = jaxsim.encode(bundled, SENTENCES, pooler="avg", batch_size=1, max_length=128)
    np.testing.assert_allclose(single, full, atol=1e-5)
    # Reversed input, odd batch size: same vectors, in the new order.
    rev = jaxsim.encode(bundled, SENTENCES[::-1], pooler="avg", batch_size=4, max_length=128)
    np.testing.assert_allclose(rev[::-1], full, atol=1e-5)
    # Distinct sentences give distinct vectors (the index bookkeeping did not mix rows).
    assert np.abs(full[0] - full[2]).max() > 1e-2


def test_matches_sentence_transformers_and_normalizes(bundled):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(bundled.path, device="cpu")
    ref = st.encode(SENTENCES, batch_size=3, convert_to_numpy=True, normalize_embeddings=True)
    ours = jaxsim.encode(bundled, SENTENCES, normalize=True)  # default pooler of the ST folder: avg
    assert bundled.default_pooler == "avg"
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_truncation_and_bf16(bundled):
    long = "word " * 1000
    a = jaxsim.encode(bundled, [long], max_length=32)
    b = jaxsim.encode(bundled, ["word " * 30], max_length=32)  # [CLS] + 30 + [SEP] = 32
    np.testing.assert_allclose(a, b, atol=1e-5)
    import jax.numpy as jnp
    half = jaxsim.encode(bundled, SENTENCES[:3], dtype=jnp.bfloat16)
    full = jaxsim.encode(bundled, SENTENCES[:3])
    cos = (half * full).sum(1) / np.linalg.norm(half, axis=1) / np.linalg.norm(full, axis=1)
    assert cos.min() > 0.99


def test_bad_arguments(bundled):
    with pytest.raises(TypeError, match=r"sentences\[1\] is a int"):
        jaxsim.encode(bundled, ["ok", 3])
    with pytest.raises(TypeError, match="single string"):
        jaxsim.encode(bundled, "not a list")
    with pytest.raises(ValueError, match="max_length"):
        jaxsim.encode(bundled, ["ok"], max_length=100000)
    assert jaxsim.encode(bundled, []).shape == (0, 384)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxsim", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_encode(tmp_path, bundled):
    src = tmp_path / "in.txt"
    src.write_text("a man is playing a guitar .\n\nthe cat sat on the mat .\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    proc = run_cli("encode", "--input", str(src), "--output", str(out), "--pooler", "avg",
                   "--normalize", "--batch-size", "2")
    assert proc.returncode == 0, proc.stderr
    vectors = np.load(out)
    assert vectors.shape == (3, 384)
    np.testing.assert_allclose(
        vectors, jaxsim.encode(bundled, src.read_text().splitlines(), normalize=True), atol=1e-5)


def test_cli_bad_input_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    proc = run_cli("encode", "--input", str(empty), "--output", str(tmp_path / "x.npy"))
    assert proc.returncode == 1 and "empty.txt: input file is empty" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli("encode", "--input", str(tmp_path / "missing.txt"), "--output", "x.npy")
    assert proc.returncode == 1 and "missing.txt: cannot read input file" in proc.stderr
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine line\nbad \xff byte\n")
    proc = run_cli("encode", "--input", str(bad), "--output", str(tmp_path / "x.npy"))
    assert proc.returncode == 1 and "bad.txt:2: not valid UTF-8" in proc.stderr
