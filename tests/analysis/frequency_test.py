"""BERT-flow's frequency analysis against planted values and a brute-force NumPy/SciPy
version on the bundled model; the command line's files."""
from __future__ import annotations

import collections
import json

import numpy as np
import pytest
from scipy.spatial.distance import cdist

from jaxsim.analysis.frequency import (
    analyze,
    count_tokens,
    frequency_table,
    knn_distances,
    rank_tokens,
    token_embeddings,
)
from jaxsim.cli.main import main as jaxsim_main
from jaxsim.storage.paths import SENTEVAL_ROOT


def test_planted_norms_and_distances():
    rng = np.random.default_rng(0)
    vocab, dim = 60, 8
    counts = rng.permutation(np.arange(1, vocab + 1)) * 10  # distinct counts
    counts[[3, 7]] = 0  # never seen: left out
    ranked = rank_tokens(counts)
    assert len(ranked) == vocab - 2 and (np.diff(counts[ranked]) < 0).all()
    # Rank r's token gets norm 1 + r // 20 along a random direction: buckets of 20 ranks
    # have mean norms 1, 2, 3 exactly.
    table = np.zeros((vocab, dim), np.float32)
    directions = rng.standard_normal((vocab, dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    for r, token in enumerate(ranked):
        table[token] = (1 + r // 20) * directions[r]
    rows = frequency_table(table, ranked, buckets=(0, 20, 40, 100), k=2)
    assert [b.tokens for b in rows] == [20, 20, 18]
    np.testing.assert_allclose([b.mean_norm for b in rows], [1, 2, 3], rtol=1e-6)
    full = cdist(table[ranked].astype(np.float64), table[ranked].astype(np.float64))
    np.fill_diagonal(full, np.inf)
    knn = np.sort(full, axis=1)[:, :2].mean(axis=1)
    np.testing.assert_allclose([b.mean_knn_distance for b in rows],
                               [knn[:20].mean(), knn[20:40].mean(), knn[40:].mean()], rtol=1e-5)


def test_knn_needs_enough_tokens():
    with pytest.raises(ValueError, match="k must be in"):
        knn_distances(np.eye(3), 3)


def test_bundled_model_matches_brute_force(bundled):
    lines = (SENTEVAL_ROOT / "STS" / "STSBenchmark" / "sts-dev.csv").read_text().splitlines()
    sentences = [line.split("\t")[5] for line in lines[:300]]
    result = analyze(bundled, sentences, buckets=(0, 100, 500, 5000), k=3)

    tok = bundled.tokenizer
    counter = collections.Counter(i for s in sentences for i in tok.encode(
        s, add_special_tokens=False))
    for special in tok.all_special_ids:
        counter.pop(special, None)
    ranked = sorted(counter, key=lambda i: (-counter[i], i))
    np.testing.assert_array_equal(rank_tokens(count_tokens(tok, sentences)), ranked)
    emb = token_embeddings(bundled).astype(np.float64)[ranked]
    norms = np.linalg.norm(emb, axis=1)
    full = cdist(emb, emb)
    np.fill_diagonal(full, np.inf)
    knn = np.sort(full, axis=1)[:, :3].mean(axis=1)
    assert result["tokens_ranked"] == len(ranked) and result["tokens_counted"] == sum(
        counter.values())
    for b in result["buckets"]:
        part = slice(b["lo"], min(b["hi"], len(ranked)))
        assert b["tokens"] == len(norms[part])
        assert b["mean_norm"] == pytest.approx(norms[part].mean(), rel=1e-6)
        assert b["mean_knn_distance"] == pytest.approx(knn[part].mean(), rel=1e-4)


def test_command_writes_json_and_png_and_refuses_to_overwrite(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("A man plays a guitar.\nA dog runs in the park.\nTwo men talk.\n" * 3)
    out = tmp_path / "out"
    argv = ["analyze", "--corpus", str(corpus), "--out", str(out), "--k", "2",
            "--buckets", "0,5,1000"]
    assert jaxsim_main(argv) == 0
    result = json.loads((out / "frequency.json").read_text())
    assert [b["lo"] for b in result["buckets"]] == [0, 5] and result["k"] == 2
    assert (out / "frequency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "mean norm" in capsys.readouterr().out
    assert jaxsim_main(argv) == 1
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert jaxsim_main(argv[:-2] + ["--buckets", "5,0"]) == 1
    assert "--buckets must be at least two increasing" in capsys.readouterr().err
