"""Approximate search through faiss (method ivf / hnsw): recall against the exact search,
scores that are the true cosines of the rows returned, save/load, the model check, errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxsim.cli.main import main as jaxsim_main
from jaxsim.search import IndexFileError, ModelMismatchError, SearchError, build_index, load_index
from jaxsim.search.index import SearchIndex


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    """Unit rows around 50 centres: sentence vectors cluster; uniform noise does not."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((50, dim)).astype(np.float32)
    x = centres[rng.integers(50, size=n)] + 0.6 * rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def data():
    return clustered(4000, 32, 0), clustered(100, 32, 1)


def recall_at(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(found, exact)]))


@pytest.mark.parametrize("method", ["ivf", "hnsw"])
def test_recall_and_scores_against_brute_force(data, method):
    corpus, queries = data
    index = SearchIndex.from_vectors(corpus, method=method)
    found = index.search_vectors(queries, top_k=10)
    exact = np.argsort(-(queries @ corpus.T), axis=1, kind="stable")[:, :10]
    assert recall_at(found.rows, exact) >= 0.95
    # Every score is the true cosine of its row, best first.
    true = np.take_along_axis(queries @ corpus.T, found.rows, axis=1)
    np.testing.assert_allclose(found.scores, true, atol=1e-5)
    assert (np.diff(found.scores, axis=1) <= 1e-6).all()


def test_a_corpus_too_small_for_two_cells_is_one_cell_found_whole_without_a_warning(capfd):
    """Under 78 rows the IVF index is one cell (faiss's 39 training rows a cell): every row is
    scanned, so it is exact, and faiss's k-means warning has nothing to warn about."""
    corpus = clustered(5, 32, 2)
    index = SearchIndex.from_vectors(corpus, method="ivf")
    found = index.search_vectors(corpus[:2], top_k=5)
    assert capfd.readouterr().err == ""
    exact = np.argsort(-(corpus[:2] @ corpus.T), axis=1, kind="stable")
    np.testing.assert_array_equal(found.rows, exact)


def test_few_probes_lose_recall_and_more_probes_restore_it(data, tmp_path):
    corpus, queries = data
    exact = np.argsort(-(queries @ corpus.T), axis=1, kind="stable")[:, :10]
    index = SearchIndex.from_vectors(corpus, method="ivf", ann_options={"nlist": 64, "nprobe": 1})
    assert recall_at(index.search_vectors(queries, 10).rows, exact) < 0.9  # really approximate
    index.tune(nprobe=64)  # every cell: exact, same structure
    assert recall_at(index.search_vectors(queries, 10).rows, exact) == 1.0
    index.save(tmp_path / "ix")
    assert load_index(tmp_path / "ix")._ann_options.nprobe == 64
    with pytest.raises(SearchError, match="tune takes nprobe / ef_search"):
        index.tune(nlist=8)


@pytest.mark.parametrize("method", ["ivf", "hnsw"])
def test_save_and_load_keep_the_structure(data, method, tmp_path):
    corpus, queries = data
    index = SearchIndex.from_vectors(corpus, method=method, ann_options={"nprobe": 4})
    before = index.search_vectors(queries, 10)
    index.save(tmp_path / "ix")
    meta = json.loads((tmp_path / "ix" / "index.json").read_text())
    assert meta["method"] == method and meta["ann"] == {"nprobe": 4}
    assert (tmp_path / "ix" / "ann.faiss").is_file()
    loaded = load_index(tmp_path / "ix")
    assert loaded.info.method == method and loaded._ann is not None  # read, not rebuilt
    after = loaded.search_vectors(queries, 10)
    np.testing.assert_array_equal(after.rows, before.rows)
    np.testing.assert_allclose(after.scores, before.scores)


def test_a_structure_of_another_index_is_refused(data, tmp_path):
    corpus, _ = data
    SearchIndex.from_vectors(corpus, method="hnsw").save(tmp_path / "big")
    SearchIndex.from_vectors(corpus[:100], method="hnsw").save(tmp_path / "small")
    (tmp_path / "small" / "ann.faiss").write_bytes((tmp_path / "big" / "ann.faiss").read_bytes())
    with pytest.raises(IndexFileError, match=r"ann.faiss: holds 4000 rows .* says 100"):
        load_index(tmp_path / "small")


def test_an_index_saved_before_methods_existed_loads_as_exact(data, tmp_path):
    corpus, queries = data
    SearchIndex.from_vectors(corpus[:500]).save(tmp_path / "ix")
    meta_file = tmp_path / "ix" / "index.json"
    meta = json.loads(meta_file.read_text())
    del meta["method"], meta["ann"]
    meta_file.write_text(json.dumps(meta))
    loaded = load_index(tmp_path / "ix")
    assert loaded.info.method == "exact"
    exact = np.argsort(-(queries @ corpus[:500].T), axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(loaded.search_vectors(queries, 5).rows, exact)


def test_added_rows_are_found(data):
    corpus, _ = data
    index = SearchIndex.from_vectors(corpus[:2000], method="hnsw")
    index.search_vectors(corpus[:1], 1)  # builds the structure
    index.add_vectors(corpus[2000:])
    hits = index.search_vectors(corpus[3000:3010], 1)
    np.testing.assert_array_equal(hits.rows[:, 0], np.arange(3000, 3010))


def test_sentences_model_check_and_errors(bundled, tmp_path):
    sentences = [f"Sentence number {i} is about {w}." for i, w in
                 enumerate(["cats", "dogs", "music", "rain", "trains", "tea"] * 10)]
    index = build_index(bundled, sentences, method="ivf")
    assert index.search(bundled, sentences[7], threshold=None, top_k=1)[0][0] == sentences[7]
    with pytest.raises(ModelMismatchError, match="pooler cls"):
        index.search(bundled, "a query", pooler="cls")
    with pytest.raises(SearchError, match="approx_recall applies to the exact method"):
        index.search_vectors(np.ones(index.dim), approx_recall=0.9)
    with pytest.raises(SearchError, match="method must be one of exact, ivf, hnsw"):
        build_index(bundled, sentences, method="lsh")
    with pytest.raises(SearchError, match="unknown ann option"):
        build_index(bundled, sentences, method="ivf", ann_options={"probes": 3})
    with pytest.raises(SearchError, match="nprobe must be a positive integer"):
        SearchIndex.from_vectors(np.eye(4), method="ivf", ann_options={"nprobe": 0})


def test_index_command_builds_an_approximate_index(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Sentence {i} is about {w}.\n" for i, w in
                              enumerate(["cats", "dogs", "music", "rain"] * 10)))
    assert jaxsim_main(["index", "--input", str(corpus), "--out", str(tmp_path / "ix"),
                        "--method", "hnsw"]) == 0
    loaded = load_index(tmp_path / "ix")
    assert loaded.info.method == "hnsw" and (tmp_path / "ix" / "ann.faiss").is_file()
    assert len(loaded) == 40
