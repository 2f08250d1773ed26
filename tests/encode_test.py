"""encode(): order, batch invariance, bucketing, edge cases, meshes, dropout keys, and the
`python -m jaxsim encode` command line."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsim
from jaxsim.cli.main import main as cli_main
from jaxsim.data import encode_layout
from jaxsim.data.tokenize import bucket_length
from jaxsim.models.bert import BertConfig
from jaxsim.models.encoder import SentenceEncoder, init_params
from tests.conftest import HANG_GUARD_S, TINY_CONFIG, run_on_cpu_devices

REPO = Path(__file__).resolve().parents[1]
SENTENCES = [
    "a man is playing a guitar .",
    "",
    "the cat sat on the mat .",
    "a woman is slicing an onion with a very sharp knife in the kitchen .",
    "dogs .",
    "over-long " * 300,  # far beyond max_length: truncated, not an error
]


def tiny_model(tokenizer, pooler: str = "cls", mlp_only_train: bool = False, seed: int = 0):
    """A tiny random SentenceModel (dropout 0.1) with the bundled tokenizer."""
    config = BertConfig(vocab_size=len(tokenizer), **TINY_CONFIG)
    encoder = SentenceEncoder(config, pooler=pooler, mlp_only_train=mlp_only_train)
    return jaxsim.SentenceModel(encoder=encoder, params=init_params(encoder, jax.random.key(seed)),
                                tokenizer=tokenizer, path="tiny", max_seq_length=64)


def test_bucket_lengths_are_few():
    buckets = {bucket_length(n, 512) for n in range(2, 513)}
    assert len(buckets) <= 20
    assert all(bucket_length(n, 512) >= n for n in range(2, 513))
    assert bucket_length(600, 256) == 256


def test_cpu_batches_keep_to_the_token_budget(bundled):
    """Long texts get fewer rows a batch on CPU; every sentence is in exactly one batch, rows
    of a batch are a function of its bucket, and the vectors do not change."""
    import concurrent.futures
    import importlib

    encode_module = importlib.import_module("jaxsim.encode")
    rng = np.random.default_rng(0)
    words = "cat dog man runs the a red big in park river house".split()
    sents = [" ".join(rng.choice(words, rng.integers(1, 120))) for _ in range(90)]
    budget = encode_layout.token_budget(encode_module.default_mesh(), 1)
    assert budget == encode_layout.CPU_TOKENS_PER_BATCH  # one CPU device
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        batches = list(encode_module._batches(bundled, sents, 64, 128, executor, 1, budget))
    seen = np.concatenate([indices[indices >= 0] for indices, _ in batches])
    assert sorted(seen.tolist()) == list(range(len(sents)))
    rows_of = {}
    for indices, batch in batches:
        rows, length = batch.tokens.input_ids.shape
        real = int((indices >= 0).sum())
        assert (indices[:real] >= 0).all() and (indices[real:] < 0).all()
        assert rows * length <= budget or rows == 1
        assert rows == encode_layout.rows_per_batch(length, 64, 1, budget) >= real
        assert rows_of.setdefault(length, rows) == rows
        assert batch.tokens.attention_mask[:real].sum(1).max() > length - 16 or length <= 32
    assert max(rows_of.values()) == 64 and min(rows_of.values()) == 1024 // 128
    full = jaxsim.encode(bundled, sents, batch_size=64, max_length=128)
    one = jaxsim.encode(bundled, sents, batch_size=1, max_length=128)
    np.testing.assert_allclose(full, one, atol=1e-5)


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
    # The empty string is a sentence too: [CLS] [SEP], encoded like any other.
    alone = jaxsim.encode(bundled, [""], pooler="avg", max_length=128)
    np.testing.assert_allclose(alone[0], full[1], atol=1e-5)


def test_matches_sentence_transformers_and_normalizes(bundled):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(bundled.path, device="cpu")
    ref = st.encode(SENTENCES, batch_size=3, convert_to_numpy=True, normalize_embeddings=True)
    ours = jaxsim.encode(bundled, SENTENCES, normalize=True)  # its own pooler: avg
    assert bundled.pooler == "avg"
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_truncation_and_bf16(bundled):
    long = "word " * 1000
    a = jaxsim.encode(bundled, [long], max_length=32)
    b = jaxsim.encode(bundled, ["word " * 30], max_length=32)  # [CLS] + 30 + [SEP] = 32
    np.testing.assert_allclose(a, b, atol=1e-5)
    half = jaxsim.encode(bundled, SENTENCES[:3], dtype=jnp.bfloat16)
    full = jaxsim.encode(bundled, SENTENCES[:3])
    assert half.dtype == np.float32
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


def test_dropout_key(bundled):
    """A key runs the encoder in training mode (dropout on, the head applied); None does not."""
    model = tiny_model(bundled.tokenizer, pooler="cls", mlp_only_train=True)
    sents = SENTENCES[:5]
    plain = jaxsim.encode(model, sents)
    np.testing.assert_array_equal(jaxsim.encode(model, sents), plain)  # None: deterministic
    a = jaxsim.encode(model, sents, dropout_key=jax.random.key(1))
    np.testing.assert_array_equal(jaxsim.encode(model, sents, dropout_key=jax.random.key(1)), a)
    b = jaxsim.encode(model, sents, dropout_key=jax.random.key(2))
    assert np.abs(a - b).max() > 1e-3 and np.abs(a - plain).max() > 1e-3
    assert np.all(np.abs(a) <= 1.0)  # training mode applies the tanh head (mlp_only_train)
    assert np.abs(plain).max() > 1.0  # evaluation uses the raw [CLS]


_MESH_SCRIPT = """
import json, sys
import jax, numpy as np
from transformers import AutoTokenizer
import jaxsim
from jaxsim import sharding
from tests.encode_test import tiny_model
assert jax.device_count() == 8, jax.devices()
tok = AutoTokenizer.from_pretrained(str(jaxsim.bundled_model_path()))
rng = np.random.default_rng(0)
words = "cat dog man runs the a red big in park river house".split()
# 5-8 tokens: one length bucket, so one program to compile per mesh and mode.
sents = [" ".join(rng.choice(words, rng.integers(3, 7))) for _ in range(29)]
meshes = {"single": sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
          "data8": None,  # the default: every device on the data axis
          "data4_fsdp2": sharding.make_mesh(4, 2, 1)}
out = {}
for pooler in ("cls",):  # the pooler with parameters (split over fsdp on data4_fsdp2)
    model = tiny_model(tok, pooler=pooler)
    # batch_size 6 is rounded up to 8 on 8 batch shards: other batches than on one device,
    # the same vectors.
    runs = {name: jaxsim.encode(model, sents, batch_size=6, mesh=mesh)
            for name, mesh in meshes.items()}
    # Dropout masks follow the batch: the same batches (8 rows) must give the same vectors.
    keyed = {name: jaxsim.encode(model, sents, batch_size=8, mesh=mesh,
                                 dropout_key=jax.random.key(3)) for name, mesh in meshes.items()}
    out[pooler] = {name: float(np.abs(runs[name] - runs["single"]).max()) for name in runs}
    out[pooler + "+dropout"] = {name: float(np.abs(keyed[name] - keyed["single"]).max())
                                for name in keyed}
    out[pooler + "+dropout"]["vs_plain"] = float(np.abs(keyed["single"] - runs["single"]).max())
print("RESULT" + json.dumps(out))
"""


def test_mesh_of_8_devices_matches_one_device():
    result = run_on_cpu_devices(textwrap.dedent(_MESH_SCRIPT))
    for name, diffs in result.items():
        for mesh, diff in diffs.items():
            if mesh == "vs_plain":
                assert diff > 1e-3, (name, diffs)  # dropout really was on
            else:
                assert diff <= 1e-6, (name, mesh, diff)


# ---------------------------------------------------------------------------- command line
def _cli(capsys, *argv):
    capsys.readouterr()
    code = cli_main(["encode", *argv])
    return code, capsys.readouterr().err


def test_cli_encode(tmp_path, bundled, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a man is playing a guitar .\n\n  \nthe cat sat on the mat .\n",
                   encoding="utf-8")
    out = tmp_path / "vecs.bin"  # any name: written as named, never renamed to .npy
    old = os.umask(0o022)
    try:
        code, err = _cli(capsys, "--input", str(src), "--output", str(out), "--pooler", "avg",
                         "--normalize", "--batch-size", "2")
    finally:
        os.umask(old)
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "vecs.bin"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    # Blank lines are skipped, and said so: row i is the i-th non-blank line.
    assert "skipped 2 blank lines" in err and "warning" not in err
    vectors = np.load(out)
    assert vectors.shape == (2, 384) and vectors.dtype == np.float32
    want = jaxsim.encode(bundled, ["a man is playing a guitar .", "the cat sat on the mat ."],
                         normalize=True)
    np.testing.assert_allclose(vectors, want, atol=1e-5)
    # An existing output is never replaced without --overwrite.
    out.write_bytes(b"keep")
    code, err = _cli(capsys, "--input", str(src), "--output", str(out))
    assert code == 1 and err == f"error: --output {out} exists; pass --overwrite to replace it\n"
    assert out.read_bytes() == b"keep"
    code, err = _cli(capsys, "--input", str(src), "--output", str(out), "--overwrite")
    assert code == 0 and np.load(out).shape == (2, 384)


def test_cli_warns_once_about_truncation(tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("short one\n" + "word " * 40 + "\n" + "other " * 50 + "\nfine\n")
    code, err = _cli(capsys, "--input", str(src), "--output", str(tmp_path / "o.npy"),
                     "--max-length", "16")
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning")]
    assert warnings == ["warning: 2 of 4 sentences are longer than 16 tokens and are "
                        "truncated to 16"]


def test_cli_checks_the_output_before_loading_the_model(tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("hello\n")
    # The model does not exist either: the output error comes first, before any loading.
    for output, message in [(src / "o.npy", "in.txt is not a folder"),
                            (tmp_path, "is a folder")]:
        code, err = _cli(capsys, "--model", str(tmp_path / "missing-model"), "--input", str(src),
                         "--output", str(output))
        assert code == 1 and err.startswith("error: --output") and message in err, err
    code, err = _cli(capsys, "--input", str(src), "--output", str(tmp_path / "o.npy"),
                     "--batch-size", "0")
    assert code == 1 and "--batch-size must be positive" in err
    code, err = _cli(capsys, "--input", str(src), "--output", str(tmp_path / "o.npy"),
                     "--pooler", "max")
    assert code == 1 and err.startswith("error: argument --pooler: invalid choice: 'max'")
    assert not (tmp_path / "o.npy").exists()


def test_cli_bad_input_files(tmp_path, capsys):
    out = str(tmp_path / "x.npy")
    for content, message in [(b"", "empty.txt: no sentences"),
                             (b"\n  \n", "empty.txt: no sentences"),
                             (b"fine line\nbad \xff byte\n", "empty.txt:2: not valid UTF-8")]:
        (tmp_path / "empty.txt").write_bytes(content)
        code, err = _cli(capsys, "--input", str(tmp_path / "empty.txt"), "--output", out)
        assert code == 1 and message in err and err.count("\n") == 1, err
    code, err = _cli(capsys, "--input", str(tmp_path / "missing.txt"), "--output", out)
    assert code == 1 and "missing.txt: sentence file not found" in err
    # `--model "$M"` with M unset: an error, not the bundled model's vectors.
    (tmp_path / "ok.txt").write_text("a line\n")
    code, err = _cli(capsys, "--model", "", "--input", str(tmp_path / "ok.txt"), "--output", out)
    assert code == 1 and err == "error: the model path is empty; give a folder, a hub id or " \
                                "'bundled'\n", err
    assert not (tmp_path / "x.npy").exists()


# `python -m jaxsim` as in the JAX-only install (`make demo`), where transformers finds no
# PyTorch and would say so on every run.
_WITHOUT_TORCH = """
import importlib.util, runpy, sys
find_spec = importlib.util.find_spec  # how transformers looks for torch
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "torch" else (
    find_spec(name, *a))
sys.argv = ["jaxsim"] + sys.argv[1:]
runpy.run_module("jaxsim", run_name="__main__", alter_sys=True)
"""


def test_cli_entry_point_is_quiet(tmp_path):
    """The real entry point: a clean stderr (no transformers / absl / XLA noise)."""
    src = tmp_path / "in.txt"
    src.write_text("a man is playing a guitar .\n")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TF_CPP_MIN_LOG_LEVEL"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, "encode", "--input", str(src),
                           "--output", str(tmp_path / "o.npy")], capture_output=True, text=True,
                          env=env, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == f"wrote 1 x 384 vectors to {tmp_path / 'o.npy'}\n"
    proc = subprocess.run([sys.executable, "-m", "jaxsim", "decode"], capture_output=True,
                          text=True, env=env, timeout=HANG_GUARD_S)
    assert proc.returncode == 1 and proc.stderr.startswith("error: unknown command 'decode'")


def test_the_library_is_quiet_without_torch():
    """`import jaxsim` in a notebook, then a model: no transformers advice on stderr."""
    head = _WITHOUT_TORCH.split("sys.argv")[0]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for name in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY"):
        env.pop(name, None)
    plain = subprocess.run([sys.executable, "-c", head + "import transformers\n"],
                           capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert "PyTorch was not found" in plain.stderr  # the advice exists without jaxsim ...
    proc = subprocess.run([sys.executable, "-c", head + "import jaxsim\nimport transformers\n"
                           "jaxsim.load_pretrained('bundled')\n"],
                          capture_output=True, text=True, env=env, timeout=HANG_GUARD_S)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # ... and jaxsim drops it
