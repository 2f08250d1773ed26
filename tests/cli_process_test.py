"""Every command as a process, on a tiny random BERT and tiny data: `python -m jaxsim index /
search / encode / export`, `eval.py` and `train.py`, each run as a user runs it, its output
files checked against an in-process computation, and the flags the README documents that no
other test runs (--model, --pooler, --dtype, --normalize, --post flow:CONFIG, --fit-on,
--seeds, --allow-change)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

import jaxsim
from jaxsim.search import load_index
from tests.conftest import HANG_GUARD_S, write_run_data, write_tiny_model

REPO = Path(__file__).resolve().parents[1]
CORPUS = ["a man is playing a guitar .", "a woman slices an onion .", "the cat sat on the mat .",
          "two dogs run across a wide green field together .", "a child reads a book ."]


def run(*args):
    """Runs `python ARGS` from the repository root; fails the test on a non-zero exit."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random BERT folder (Hugging Face layout, the bundled tokenizer) and its model."""
    folder = tmp_path_factory.mktemp("cli") / "tiny-bert"
    write_tiny_model(folder, "bert", seed=3)
    return folder, jaxsim.load_pretrained(folder)


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_index_and_search(tiny, tmp_path):
    folder, model = tiny
    (tmp_path / "corpus.txt").write_text("\n".join(CORPUS) + "\n")
    run("-m", "jaxsim", "index", "--model", folder, "--pooler", "cls_before_pooler",
        "--input", tmp_path / "corpus.txt", "--out", tmp_path / "ix")
    index = load_index(tmp_path / "ix")
    want = _unit(jaxsim.encode(model, CORPUS, pooler="cls_before_pooler"))
    assert index.sentences == CORPUS and index.info.pooler == "cls_before_pooler"
    np.testing.assert_allclose(index.vectors, want, atol=1e-5)

    query = "a man plays the guitar ."
    proc = run("-m", "jaxsim", "search", "--index", tmp_path / "ix", "--model", folder,
               "--query", query, "--top-k", "3", "--threshold", "-1")
    got = [line.split("\t") for line in proc.stdout.splitlines()]
    q = _unit(jaxsim.encode(model, [query], pooler="cls_before_pooler"))[0]
    scores = want @ q
    best = np.argsort(-scores)[:3]
    assert [s for _, s in got] == [CORPUS[i] for i in best]
    np.testing.assert_allclose([float(x) for x, _ in got], scores[best], atol=1e-4)


def test_encode_writes_the_vectors(tiny, tmp_path):
    folder, model = tiny
    (tmp_path / "in.txt").write_text("\n".join(CORPUS[:3]) + "\n\n" + CORPUS[3] + "\n")
    out = tmp_path / "vectors.bin"  # written under exactly this name
    run("-m", "jaxsim", "encode", "--model", folder, "--input", tmp_path / "in.txt",
        "--output", out, "--pooler", "avg", "--normalize", "--dtype", "bfloat16",
        "--batch-size", "2", "--max-length", "16")
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (4, 36)
    want = jaxsim.encode(model, CORPUS[:4], pooler="avg", normalize=True, max_length=16,
                         dtype=jnp.bfloat16, batch_size=2)
    np.testing.assert_allclose(got, want, atol=1e-6)
    fp32 = jaxsim.encode(model, CORPUS[:4], pooler="avg", normalize=True, max_length=16)
    gap = np.abs(got - fp32).max()
    assert 0 < gap < 0.05  # bf16 really computed: close to, not equal to, float32


def test_export_folders_load_and_give_the_same_vectors(tiny, tmp_path):
    from sentence_transformers import SentenceTransformer

    folder, model = tiny
    run("-m", "jaxsim", "export", "--checkpoint", folder, "--out", tmp_path / "st",
        "--format", "sentence-transformers", "--pooler", "avg_first_last", "--normalize",
        "--max-length", "32")
    want = jaxsim.encode(model, CORPUS, pooler="avg_first_last", normalize=True, max_length=32)
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    np.testing.assert_allclose(st.encode(CORPUS, convert_to_numpy=True), want, atol=1e-5)
    reloaded = jaxsim.load_pretrained(tmp_path / "st")
    assert reloaded.pooler == "avg_first_last"
    np.testing.assert_allclose(jaxsim.encode(reloaded, CORPUS, max_length=32, normalize=True),
                               want, atol=1e-5)

    run("-m", "jaxsim", "export", "--model", folder, "--out", tmp_path / "hf", "--format", "hf",
        "--pooler", "cls")
    loaded = jaxsim.load_pretrained(tmp_path / "hf")
    assert loaded.pooler == "cls"
    np.testing.assert_allclose(jaxsim.encode(loaded, CORPUS),
                               jaxsim.encode(model, CORPUS, pooler="cls"), atol=1e-5)


TINY_FLOW = '''
from jaxsim.flows.config import FlowConfig, layer


def get_config():
    return FlowConfig(name="tiny", levels=1, depth=1,
                      step=(layer("actnorm"), layer("affine_coupling", width=8)),
                      data_init=True, max_epochs=1, batch_size=32, val_fraction=0.0)
'''


def test_eval_model_pooler_flow_fit_sets_and_seeds(tiny, tmp_path):
    folder, model = tiny
    data = write_run_data(tmp_path, "s1.dev", 8, 40) / "senteval"
    (tmp_path / "tiny_flow.py").write_text(TINY_FLOW)
    out = tmp_path / "res.json"
    run("eval.py", "--model", folder, "--pooler", "avg_first_last", "--data", data,
        "--tasks", "stsb", "--post", "none", "--post", f"flow:{tmp_path / 'tiny_flow.py'}",
        "--fit-on", "target", "--fit-on", "task", "--seeds", "0,1", "--no-diagnostics",
        "--json", out)
    rows = json.loads(out.read_text())
    by = {(r["post"].split(":")[0], (r["details"].get("fit") or {}).get("fit_on")): r
          for r in rows}
    assert set(by) == {("none", None), ("flow", "target"), ("flow", "task")}
    assert all(r["pooler"] == "avg_first_last" for r in rows)
    # The 'none' row is the model's own score under this pooler, computed here.
    pairs = [line.split("\t") for line in
             (data / "STS" / "STSBenchmark" / "sts-test.csv").read_text().splitlines()]
    a = jaxsim.encode(model, [p[5] for p in pairs], pooler="avg_first_last")
    b = jaxsim.encode(model, [p[6] for p in pairs], pooler="avg_first_last")
    cos = (_unit(a) * _unit(b)).sum(1)
    want = 100 * scipy.stats.spearmanr(cos, [float(p[4]) for p in pairs])[0]
    assert by[("none", None)]["tasks"]["STSBenchmark"] == pytest.approx(want, abs=1e-3)
    for fit_on in ("target", "task"):
        flow = by[("flow", fit_on)]
        assert np.isfinite(flow["tasks"]["STSBenchmark"])
        assert json.dumps(flow["details"]).count('"seed') >= 1
        assert "0" in json.dumps(flow["details"].get("seeds", flow["details"]))


def test_train_seeds_then_an_allowed_change(tmp_path):
    data = write_run_data(tmp_path, "s1.dev", 48, 24)
    args = ["train.py", "--config", REPO / "configs" / "tiny_unsup_simcse.py",
            "--workdir", tmp_path / "runs", f"--config.train_file={data / 'corpus.txt'}",
            "--config.model=bundled", "--config.pooler=avg", "--config.max_steps=2",
            "--seeds", "0,1", "--noprogress"]
    first = run(*args)
    assert jaxsim.load_pretrained(tmp_path / "runs" / "seed_1").pooler == "avg"
    results = {s: json.loads((tmp_path / "runs" / f"seed_{s}" / "result.json").read_text())
               for s in (0, 1)}
    assert [r["steps"] for r in results.values()] == [2, 2]
    assert results[0]["final_loss"] != results[1]["final_loss"]  # the seed took effect
    assert "seed" in first.stdout

    changed = [*args[:-3], "--config.max_steps=3", "--seeds", "0,1", "--noprogress"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    refused = subprocess.run([sys.executable, *map(str, changed)], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert refused.returncode == 1 and "--allow-change=max_steps" in refused.stderr
    run(*changed, "--allow-change=max_steps")
    for s in (0, 1):
        seed_dir = tmp_path / "runs" / f"seed_{s}"
        assert json.loads((seed_dir / "result.json").read_text())["steps"] == 3
        lines = (seed_dir / "metrics.jsonl").read_text().splitlines()
        steps = [json.loads(x)["step"] for x in lines]
        assert steps == [1, 2, 3]  # resumed at step 2, not trained again


def test_prepare_indexes_the_snli_splits_asked_for(tmp_path):
    from jaxsim.data.readers import build_snli_triplets

    snli = tmp_path / "SNLI"
    snli.mkdir()
    (snli / "s1.dev").write_text("p1\np1\np1\np2\np2\n")
    (snli / "s2.dev").write_text("e1\nc1\nn1\ne2\nc2\n")
    (snli / "labels.dev").write_text("entailment\ncontradiction\nneutral\nentailment\n"
                                     "contradiction\n")
    proc = run("-m", "jaxsim", "prepare", snli, "--format", "snli", "--snli-splits", "dev")
    want = len(build_snli_triplets(snli, ["dev"]))
    assert want == 2 and proc.stdout.startswith(f"{snli}: {want} examples, ")
