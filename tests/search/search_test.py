"""Search: exact top-k against brute-force NumPy, mesh sharding, save/load, the model check,
threshold/top_k semantics of the official SimCSE tool, similarity, and the command lines.

The 8-device equivalence runs in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 set before JAX starts.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxsim
from jaxsim import sharding
from jaxsim.cli.main import main as cli_main
from jaxsim.search import (
    IndexFileError,
    IndexInfo,
    ModelMismatchError,
    SearchError,
    SearchIndex,
    VectorError,
    build_index,
    load_index,
    similarity,
    topk,
)
from jaxsim.storage.store import OutputExistsError
from tests.conftest import HANG_GUARD_S, run_on_cpu_devices, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _gaussian(n, dim, seed):
    return np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)


def _four_hot(n, dim, seed):
    """Rows with four entries 1: unit rows of 0.5s, so every cosine is an exact multiple of 0.25
    and equal scores are bit-identical (many ties)."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, dim), np.float32)
    for row in x:
        row[rng.choice(dim, 4, replace=False)] = 1.0
    return x


def _brute_force(corpus, queries, k):
    """float64 cosines; rows by descending score, equal scores lowest row first."""
    c = corpus.astype(np.float64)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    q = queries.astype(np.float64)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    scores = q @ c.T
    rows = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, rows, axis=1), rows


# --- exact search on one device -------------------------------------------------------------

# Whole-block selection, selection through group maxima, and blocks smaller than k.
@pytest.mark.parametrize("block_rows,k,grouped", [(64, 7, False), (256, 7, True), (48, 3, True),
                                                  (4, 7, False)])
def test_exact_search_equals_numpy_brute_force(block_rows, k, grouped):
    corpus, queries = _gaussian(1001, 24, 0), _gaussian(37, 24, 1)
    layout = topk.plan_layout(len(corpus), 24, 1, block_rows)
    assert bool(topk._group_size(layout.block_rows, min(k, layout.block_rows))) == grouped
    # Small blocks and query batches: many scan steps, a padded last block, several query calls.
    index = SearchIndex.from_vectors(corpus, block_rows=block_rows, query_batch=16)
    hits = index.search_vectors(queries, top_k=k)
    want_scores, want_rows = _brute_force(corpus, queries, k)
    np.testing.assert_array_equal(hits.rows, want_rows)
    np.testing.assert_allclose(hits.scores, want_scores, atol=2e-6, rtol=0)
    assert hits.scores.dtype == np.float32 and hits.rows.shape == (37, k)


@pytest.mark.parametrize("block_rows,k", [(16, 5), (256, 3)])  # whole block, group maxima
def test_padding_rows_never_outscore_real_rows(block_rows, k):
    # Every real row scores about -1 against the query, the zero padding rows would score 0: only
    # the mask keeps them out, in the block where the valid rows end and in the blocks past it.
    query = np.zeros((1, 16), np.float32)
    query[0, 0] = 1.0
    corpus = -query + 0.01 * _gaussian(90, 16, 4)
    corpus /= np.linalg.norm(corpus, axis=1, keepdims=True)
    mesh = sharding.make_mesh()
    layout = topk.plan_layout(300, 16, 1, block_rows)  # room for 300 rows, 90 in use
    assert layout.blocks >= 2 and layout.capacity - 90 > layout.block_rows
    placed = topk.place_corpus(corpus, mesh, layout)
    scores, rows = topk.top_k_search(placed, layout, mesh, len(corpus), query, k)
    want_scores, want_rows = _brute_force(corpus, query, k)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, atol=2e-6, rtol=0)
    assert (scores < -0.9).all()


@pytest.mark.parametrize("block_rows", [40, 2048])  # whole-block and group-maxima selection
def test_ties_come_out_lowest_row_first(block_rows):
    corpus, queries = _four_hot(500, 16, 2), _four_hot(20, 16, 3)
    index = SearchIndex.from_vectors(corpus, block_rows=block_rows)
    hits = index.search_vectors(queries, top_k=25)
    want_scores, want_rows = _brute_force(corpus, queries, 25)
    assert (np.diff(want_scores, axis=1) == 0).sum() > 100  # the data really has ties
    np.testing.assert_array_equal(hits.rows, want_rows)
    np.testing.assert_array_equal(hits.scores, want_scores.astype(np.float32))


def test_top_k_beyond_size_empty_index_and_empty_queries():
    corpus = _gaussian(10, 8, 4)
    index = SearchIndex.from_vectors(corpus)
    hits = index.search_vectors(corpus[3], top_k=50)  # a single [dim] query
    assert hits.rows.shape == (1, 10) and sorted(hits.rows[0]) == list(range(10))
    assert hits.rows[0, 0] == 3 and hits.scores[0, 0] == pytest.approx(1.0, abs=1e-6)
    assert np.all(np.diff(hits.scores[0]) <= 0)
    assert index.search_vectors(np.zeros((0, 8)), top_k=3).rows.shape == (0, 3)
    empty = SearchIndex(IndexInfo(dim=8))
    assert len(empty) == 0
    got = empty.search_vectors(corpus[:2], top_k=5)
    assert got.rows.shape == (2, 0) and got.scores.shape == (2, 0)


def test_bad_vectors_and_arguments_are_clear_errors():
    index = SearchIndex.from_vectors(_gaussian(20, 24, 5), sentences=[f"s{i}" for i in range(20)])
    bad = _gaussian(4, 24, 6)
    bad[2, 7] = np.nan
    with pytest.raises(VectorError, match="row 2 holds NaN"):
        index.add_vectors(bad, ["a", "b", "c", "d"])
    with pytest.raises(VectorError, match="row 2 holds NaN"):
        index.search_vectors(bad)
    with pytest.raises(VectorError, match="dimension 5 but the index has dimension 24"):
        index.search_vectors(np.ones((3, 5)))
    with pytest.raises(VectorError, match="dimension 5 but the index has dimension 24"):
        index.add_vectors(np.ones((1, 5)), ["x"])
    with pytest.raises(SearchError, match="2 vectors but 1 sentences"):
        index.add_vectors(np.ones((2, 24)), ["x"])
    with pytest.raises(SearchError, match="pass sentences"):
        index.add_vectors(np.ones((1, 24)))
    for k in (0, -1, 2.5, True):
        with pytest.raises(SearchError, match="top_k must be a positive integer"):
            index.search_vectors(np.ones(24), top_k=k)
    with pytest.raises(SearchError, match="bare vectors"):
        SearchIndex.from_vectors(np.ones((2, 24))).search(None, "query")
    assert len(index) == 20  # failed adds left the index untouched


def test_incremental_add_equals_building_at_once():
    corpus, queries = _gaussian(300, 12, 7), _gaussian(9, 12, 8)
    sentences = [f"sentence {i}" for i in range(300)]
    grown = SearchIndex(IndexInfo(dim=12), block_rows=32)
    for lo, hi in ((0, 5), (5, 100), (100, 300)):
        grown.add_vectors(corpus[lo:hi], sentences[lo:hi])
        partial = grown.search_vectors(queries, top_k=4)  # placed on the mesh between adds
        np.testing.assert_array_equal(partial.rows, _brute_force(corpus[:hi], queries, 4)[1])
    whole = SearchIndex.from_vectors(corpus, sentences, block_rows=32)
    np.testing.assert_array_equal(grown.vectors, whole.vectors)
    assert grown.sentences == sentences
    np.testing.assert_allclose(np.linalg.norm(grown.vectors, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(grown.search_vectors(queries, 6).rows,
                                  whole.search_vectors(queries, 6).rows)


def test_approximate_search_selects_with_the_recall_target(monkeypatch):
    # XLA:CPU lowers approx_max_k to an exact top-k, so on CPU the approximate search must
    # return the brute-force answer; the spy shows the recall target reaches the selection.
    targets = []
    real = jax.lax.approx_max_k

    def spy(operand, k, *args, recall_target=0.95, **kwargs):
        targets.append(recall_target)
        return real(operand, k, *args, recall_target=recall_target, **kwargs)

    monkeypatch.setattr(jax.lax, "approx_max_k", spy)
    corpus, queries = _gaussian(4000, 32, 9), _gaussian(64, 32, 10)
    index = SearchIndex.from_vectors(corpus, block_rows=512)
    approx = index.search_vectors(queries, top_k=10, approx_recall=0.93)
    assert targets and set(targets) == {0.93}
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(approx.rows, _brute_force(corpus, queries, 10)[1])
    found = approx.rows >= 0
    # Every returned score is the true cosine of the returned row.
    c = corpus / np.linalg.norm(corpus, axis=1, keepdims=True)
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    true = np.einsum("qd,qkd->qk", q, c[np.where(found, approx.rows, 0)])
    np.testing.assert_allclose(approx.scores[found], true[found], atol=2e-6)


# --- save / load ----------------------------------------------------------------------------

def test_save_load_round_trip(tmp_path):
    corpus, queries = _gaussian(50, 16, 11), _gaussian(5, 16, 12)
    sentences = [f"line {i}" for i in range(47)] + ["two\nlines", "tab\tand ünïcode ✓", ""]
    index = SearchIndex.from_vectors(corpus, sentences)
    index.save(tmp_path / "ix")
    loaded = load_index(tmp_path / "ix")
    assert loaded.info == index.info and loaded.sentences == sentences
    np.testing.assert_array_equal(loaded.vectors, index.vectors)
    a, b = index.search_vectors(queries, 8), loaded.search_vectors(queries, 8)
    np.testing.assert_array_equal(a.rows, b.rows)
    np.testing.assert_array_equal(a.scores, b.scores)
    loaded.add_vectors(corpus[:1], ["again"])  # a loaded index keeps growing
    assert len(loaded) == 51 and loaded.search_vectors(corpus[0], 2).rows[0].tolist() == [0, 50]

    bare = SearchIndex.from_vectors(corpus, normalize=False)
    with pytest.raises(OutputExistsError, match="ix exists; pass --overwrite"):
        bare.save(tmp_path / "ix")
    bare.save(tmp_path / "ix", overwrite=True)  # overwriting drops the old sentences file
    again = load_index(tmp_path / "ix")
    assert again.sentences is None and not again.info.normalize
    np.testing.assert_array_equal(again.vectors, corpus)


def test_load_refuses_broken_folders(tmp_path):
    with pytest.raises(IndexFileError, match="not a search index"):
        load_index(tmp_path / "nothing")
    SearchIndex.from_vectors(_gaussian(6, 4, 13), [str(i) for i in range(6)]).save(tmp_path)
    meta_path = tmp_path / "index.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, count=7)))
    with pytest.raises(IndexFileError, match=r"vectors.npy: holds float32 \(6, 4\), but "):
        load_index(tmp_path)
    meta_path.write_text(json.dumps(meta))
    lines = (tmp_path / "sentences.jsonl").read_text().splitlines()
    (tmp_path / "sentences.jsonl").write_text("\n".join(lines[:3] + ["not json"] + lines[4:]))
    with pytest.raises(IndexFileError, match=r"sentences.jsonl:4: not a JSON string"):
        load_index(tmp_path)
    meta_path.write_text('{"format": "jaxsim-search-index",\n "version": }')
    with pytest.raises(IndexFileError, match=r"index.json:2: malformed JSON"):
        load_index(tmp_path)



def test_load_refuses_a_nan_probe_and_a_folder_in_place_of_a_file(tmp_path):
    index = SearchIndex(IndexInfo(dim=4, model="m", pooler="avg", probe=(1.0, 0.0, 0.0, 0.0)))
    index.add_vectors(_gaussian(3, 4, 14), ["a", "b", "c"])
    index.save(tmp_path / "ix")
    meta_path = tmp_path / "ix" / "index.json"
    meta = json.loads(meta_path.read_text())
    # A NaN probe would pass every model check (NaN < 0.999 is false): refused on load.
    meta_path.write_text(json.dumps(dict(meta, probe=[float("nan"), 0.0, 0.0, 0.0])))
    with pytest.raises(IndexFileError, match=r"index.json: field 'probe' must hold 4 finite"):
        load_index(tmp_path / "ix")
    meta_path.write_text(json.dumps(meta))
    (tmp_path / "ix" / "sentences.jsonl").unlink()
    (tmp_path / "ix" / "sentences.jsonl").mkdir()
    with pytest.raises(IndexFileError, match=r"ix/sentences.jsonl: unreadable \(.*directory"):
        load_index(tmp_path / "ix")

# --- with the bundled model -----------------------------------------------------------------

CORPUS = ["A man is playing a guitar.", "A woman is slicing onions.", "A man plays the violin.",
          "Stock markets fell sharply today.", "A kitten sleeps on the sofa.",
          "Someone is strumming a guitar on stage.", "A chef chops vegetables.",
          "A man is playing a guitar."]  # a duplicate: its tie must come after row 0
QUERIES = ["A person plays guitar.", "Shares dropped on the exchange.", "Cutting an onion."]


def _expected(sims, threshold, top_k):
    """The official tool's rule: keep score >= threshold, sort descending, first top_k."""
    keep = [(i, s) for i, s in enumerate(sims) if threshold is None or s >= threshold]
    return sorted(keep, key=lambda x: (-x[1], x[0]))[:top_k]


def test_similarity_matches_encoded_cosines(bundled):
    vecs = jaxsim.encode(bundled, QUERIES + CORPUS, normalize=True)
    want = vecs[:3] @ vecs[3:].T
    np.testing.assert_allclose(similarity(bundled, QUERIES, CORPUS), want, atol=1e-5)
    row = similarity(bundled, QUERIES[0], CORPUS)
    assert row.shape == (8,)
    np.testing.assert_allclose(row, want[0], atol=1e-5)
    one = similarity(bundled, QUERIES[0], CORPUS[0])
    assert isinstance(one, float) and one == pytest.approx(float(want[0, 0]), abs=1e-5)
    raw = jaxsim.encode(bundled, CORPUS)  # unnormalized vectors as keys
    np.testing.assert_allclose(similarity(bundled, QUERIES, raw), want, atol=1e-5)
    np.testing.assert_allclose(similarity(None, raw[:2], raw), (vecs[3:] @ vecs[3:].T)[:2],
                               atol=1e-5)
    assert similarity(bundled, [], CORPUS).shape == (0, 8)
    with pytest.raises(VectorError, match="dimension 384 but key vectors have dimension 7"):
        similarity(bundled, QUERIES, np.ones((2, 7)))
    with pytest.raises(SearchError, match="needs a model"):
        similarity(None, "text", raw)


def test_search_threshold_and_top_k_semantics(bundled):
    index = build_index(bundled, CORPUS)
    sims = similarity(bundled, QUERIES, CORPUS)
    for threshold, top_k in ((0.6, 5), (None, 3), (0.0, 100), (0.3, 1), (0.999, 5)):
        got = index.search(bundled, QUERIES, threshold=threshold, top_k=top_k)
        assert len(got) == len(QUERIES)
        for q, results in enumerate(got):
            want = _expected(sims[q], threshold, top_k)
            assert [s for s, _ in results] == [CORPUS[i] for i, _ in want], (threshold, top_k)
            np.testing.assert_allclose([x for _, x in results], [x for _, x in want], atol=1e-5)
    single = index.search(bundled, QUERIES[0], threshold=None, top_k=3)  # one query: flat list
    assert isinstance(single, list) and isinstance(single[0], tuple)
    assert single[0][0] == CORPUS[0] and single[1][0] == CORPUS[7]  # tie: row 0 first
    assert index.search(bundled, []) == []
    assert SearchIndex(index.info).search(bundled, QUERIES, threshold=None) == [[], [], []]


def test_mismatched_model_is_refused(bundled, tmp_path):
    index = build_index(bundled, CORPUS[:4])
    index.save(tmp_path / "ix")
    reloaded = load_index(tmp_path / "ix")
    assert reloaded.search(bundled, QUERIES[0], threshold=None, top_k=1)[0][0] == CORPUS[0]
    # Same width, other weights (every tensor reversed along its first axis).
    other = bundled.with_params(jax.tree.map(lambda p: p[::-1], bundled.params))
    with pytest.raises(ModelMismatchError, match="not the model that built the index"):
        reloaded.search(other, QUERIES[0])
    with pytest.raises(ModelMismatchError, match="not the model that built the index"):
        reloaded.add(other, ["more"])
    with pytest.raises(ModelMismatchError, match="pooler cls_before_pooler"):
        reloaded.search(bundled, QUERIES, pooler="cls_before_pooler")
    narrow = SearchIndex(IndexInfo(dim=10, model="elsewhere", pooler="avg"))
    with pytest.raises(ModelMismatchError, match="384-dimensional vectors but the index holds "
                                                 "10-dimensional"):
        narrow.search(bundled, "query")
    reloaded.add(bundled, ["A man is playing a flute."])
    assert reloaded.sentences[-1] == "A man is playing a flute." and len(reloaded) == 5
    # An index remembers its pooler: searching without one uses it, not the model's default.
    cls_index = build_index(bundled, CORPUS[:4], pooler="cls_before_pooler")
    got = cls_index.search(bundled, QUERIES[0], threshold=None, top_k=4)
    want = similarity(bundled, QUERIES[0], CORPUS[:4], pooler="cls_before_pooler")
    np.testing.assert_allclose([x for _, x in got], np.sort(want)[::-1], atol=1e-5)
    with pytest.raises(ModelMismatchError, match="pooler avg"):
        cls_index.search(bundled, QUERIES[0], pooler="avg")



def test_blank_and_undecodable_queries_are_refused_by_position(bundled, tmp_path, capsys):
    index = build_index(bundled, CORPUS[:4])
    for queries, message in ((["A man.", "  "], r"queries\[1\] is blank"),
                             ("", r"queries\[0\] is blank"),
                             (["caf\udcff"], r"queries\[0\] is not valid Unicode")):
        with pytest.raises(SearchError, match=message):
            index.search(bundled, queries)
    with pytest.raises(SearchError, match=r"sentences\[1\] is not valid Unicode"):
        index.add(bundled, ["A dog.", "\ud800"])
    with pytest.raises(SearchError, match=r"sentences\[0\] is not valid Unicode"):
        SearchIndex.from_vectors(np.ones((1, 3)), ["\ud800"])
    with pytest.raises(SearchError, match=r"keys\[1\] is not valid Unicode"):
        similarity(bundled, "A man.", ["A dog.", "caf\udcff"])
    with pytest.raises(SearchError, match="queries must be a list of strings, got bytes"):
        index.search(bundled, b"A man.")
    with pytest.raises(SearchError, match="threshold must be a finite number or None, got '0.5'"):
        index.search(bundled, "A man.", threshold="0.5")
    assert len(index) == 4
    index.save(tmp_path / "ix")
    # A shell passes bytes that are not UTF-8 as surrogate escapes, e.g. --query $'caf\xff'.
    for query, message in (("", "queries[0] is blank"),
                           ("caf\udcff", "queries[0] is not valid Unicode")):
        assert cli_main(["search", "--index", str(tmp_path / "ix"), "--query", query]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err

def test_command_lines_end_to_end(tmp_path, capsys):
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("\n".join(CORPUS[:7]) + "\n\n", encoding="utf-8")
    out = tmp_path / "ix"
    assert cli_main(["index", "--input", str(corpus_file), "--out", str(out)]) == 0
    assert "indexed 7 sentences (dimension 384, pooler avg)" in capsys.readouterr().err

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-m", "jaxsim", "search", "--index", str(out),
                           "--query", QUERIES[0], "--top-k", "3", "--threshold", "0.2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [ln.split("\t") for ln in proc.stdout.splitlines()]
    model = jaxsim.load_pretrained(jaxsim.bundled_model_path())
    want = load_index(out).search(model, QUERIES[0], threshold=0.2, top_k=3)
    assert [(s, float(x)) for x, s in lines] == [(s, pytest.approx(x, abs=1e-4)) for s, x in want]
    assert len(lines) == 3

    assert cli_main(["search", "--index", str(out), "--query", QUERIES[1], "--query", QUERIES[2],
                     "--threshold", "-1", "--top-k", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"query: {QUERIES[1]}" and printed[3] == f"query: {QUERIES[2]}"
    assert printed[4].endswith("\t" + CORPUS[1]) and len(printed) == 6
    # No hit reaches the threshold: said on stderr (like the page), stdout keeps only results.
    assert cli_main(["search", "--index", str(out), "--query", "zebra quantum invoice",
                     "--threshold", "0.99"]) == 0
    assert capsys.readouterr() == ("", "no result: no cosine reaches --threshold 0.99 "
                                       "(--threshold -1 keeps every hit)\n")

    for argv, message in (
            (["search", "--index", str(tmp_path / "none"), "--query", "x"], "not a search index"),
            (["search", "--index", str(out), "--query", "x", "--top-k", "0"], "top_k must be"),
            (["search", "--index", str(out), "--query", "x", "--threshold", "2"],
             "--threshold must be in [-1, 1] (a cosine), got 2.0"),
            (["search", "--index", str(out), "--query", "x", "--threshold", "nan"],
             "--threshold must be in [-1, 1]"),
            (["index", "--input", str(tmp_path / "missing.txt"), "--out", str(out)],
             "missing.txt")):
        assert cli_main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err



def test_index_and_search_say_when_texts_are_truncated(tmp_path, capsys):
    corpus_file = tmp_path / "corpus.txt"
    long = " ".join(["guitar"] * 300)  # over all-MiniLM-L6-v2's 256 tokens
    corpus_file.write_text(f"{CORPUS[0]}\n\n{long}\n{CORPUS[1]}\n", encoding="utf-8")
    assert cli_main(["index", "--input", str(corpus_file), "--out", str(tmp_path / "ix")]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 blank line" in err
    assert "1 of 3 sentences are longer than 256 tokens and are truncated to 256" in err
    assert cli_main(["search", "--index", str(tmp_path / "ix"), "--query", long,
                     "--query", "A guitar."]) == 0
    assert "1 of 2 sentences are longer than 256 tokens" in capsys.readouterr().err


def test_a_moved_model_is_named_as_the_one_the_index_records(tmp_path, capsys):
    write_tiny_model(tmp_path / "model")
    build_index(jaxsim.load_pretrained(tmp_path / "model"), CORPUS[:3]).save(tmp_path / "ix")
    (tmp_path / "model").rename(tmp_path / "moved")
    capsys.readouterr()  # the tiny model's save output
    assert cli_main(["search", "--index", str(tmp_path / "ix"), "--query", "A man."]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such model folder" in err[0], err
    assert "the model the index records" in err[0] and "pass --model" in err[0], err
    assert cli_main(["search", "--index", str(tmp_path / "ix"), "--query", "A man.",
                     "--model", str(tmp_path / "moved")]) == 0

# --- sharded over 8 devices -----------------------------------------------------------------

_SHARDED = textwrap.dedent('''
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, sys.argv[1])
    from jaxsim import sharding
    from jaxsim.search import SearchIndex
    assert jax.device_count() == 8, jax.devices()
    data = np.load(sys.argv[2])
    meshes = {"single": sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
              "data8": sharding.make_mesh(8, 1, 1),
              "data4_fsdp2": sharding.make_mesh(4, 2, 1),
              "data2_tensor4": sharding.make_mesh(2, 1, 4)}
    out = {}
    for name, mesh in meshes.items():
        for kind in ("gauss", "ties"):
            index = SearchIndex.from_vectors(data[kind], mesh=mesh, block_rows=int(sys.argv[3]))
            hits = index.search_vectors(data[kind + "_q"], top_k=9)
            shard_rows = [s.data.shape[0] for s in index._placed[1].addressable_shards]
            out[name + "/" + kind] = {"rows": hits.rows.tolist(), "scores": hits.scores.tolist(),
                                      "shard_rows": shard_rows}
            low = SearchIndex.from_vectors(data[kind], mesh=mesh, corpus_dtype="bfloat16",
                                           block_rows=int(sys.argv[3]))
            out[name + "/" + kind + "/bf16"] = {
                "rows": low.search_vectors(data[kind + "_q"], top_k=9).rows.tolist()}
        approx = index.search_vectors(data["ties_q"], top_k=9, approx_recall=0.95)
        out[name + "/approx"] = {"rows": approx.rows.tolist()}
    print("RESULT" + json.dumps(out), flush=True)
''')


def test_sharded_search_equals_single_device(tmp_path):
    # 8 x 601 rows a device in blocks of 256 (3 blocks, the last part padding): group-maxima
    # selection, padded blocks and shard boundaries all in play.
    data = {"gauss": _gaussian(4801, 20, 14), "gauss_q": _gaussian(13, 20, 15),
            "ties": _four_hot(4777, 16, 16), "ties_q": _four_hot(13, 16, 17)}
    np.savez(tmp_path / "data.npz", **data)
    out = run_on_cpu_devices(_SHARDED, str(ROOT), str(tmp_path / "data.npz"), "256")
    for kind in ("gauss", "ties"):
        want_scores, want_rows = _brute_force(data[kind], data[kind + "_q"], 9)
        for mesh in ("single", "data8", "data4_fsdp2", "data2_tensor4"):
            got = out[f"{mesh}/{kind}"]
            np.testing.assert_array_equal(got["rows"], want_rows, err_msg=f"{mesh}/{kind}")
            np.testing.assert_allclose(got["scores"], want_scores, atol=2e-6, rtol=0)
            np.testing.assert_array_equal(out[f"{mesh}/{kind}/bf16"]["rows"], want_rows,
                                          err_msg=f"{mesh}/{kind}/bf16")
            if mesh != "single":  # really split: 8 equal row shards covering the corpus
                assert len(got["shard_rows"]) == 8 and len(set(got["shard_rows"])) == 1
                assert 0 <= sum(got["shard_rows"]) - len(data[kind]) < 8 * 256  # < a block each
    for mesh in ("data8", "data4_fsdp2"):
        approx, exact = np.array(out[f"{mesh}/approx"]["rows"]), out["single/ties"]["rows"]
        # Ties make the exact set ambiguous; the approximate rows must still be valid and distinct.
        assert approx.shape == np.shape(exact) and (approx >= 0).all()
        assert all(len(set(r)) == 9 for r in approx.tolist())
