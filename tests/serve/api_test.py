"""The HTTP API of `python -m jaxsim serve`, as a client meets it: a real server process on a
free localhost port, every route and every error, results checked against the library."""
from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import urllib.parse

import numpy as np
import pytest

import jaxsim
from jaxsim.search import load_index
from jaxsim.serve.app import create_app
from jaxsim.serve.service import ServeLimits
from tests.conftest import HANG_GUARD_S
from tests.serve.conftest import CORPUS_SIZE, call


@pytest.fixture(scope="module")
def local(served_index):
    """The same model and index, loaded in this process: the reference for every answer."""
    index_dir, model_dir, sentences = served_index
    return jaxsim.load_pretrained(model_dir), load_index(index_dir), sentences


def test_health_names_model_pooler_and_rows(server, served_index):
    _, model_dir, _ = served_index
    status, health = call(server.url, "/health")
    assert status == 200
    assert health["status"] == "ok"
    assert health["model"] == str(model_dir.resolve())
    assert health["pooler"] == "avg" and health["rows"] == CORPUS_SIZE and health["dim"] == 36
    assert health["batching"] is True and health["limits"]["max_top_k"] == 100


def test_the_compile_before_the_port_opens_is_announced(server):
    """Up to a minute of compiling on a CPU is said, not a silence until `serving ...`."""
    log = server.log.read_text()
    assert f"loaded {CORPUS_SIZE} sentences and model " in log
    assert log.index("compiling the encode shapes (--warm-up-tokens 12)") < log.index(
        "serving http://")


def test_search_matches_the_library(server, local):
    model, index, sentences = local
    queries = [sentences[3], "A dog runs through a field of flowers."]
    status, body = call(server.url, "/search", {"queries": queries, "top_k": 7,
                                                "threshold": None})
    assert status == 200
    expected = index.search(model, queries, threshold=None, top_k=7)
    assert len(body["results"]) == 2
    for got, want in zip(body["results"], expected):
        assert [h["sentence"] for h in got] == [s for s, _ in want]
        np.testing.assert_allclose([h["score"] for h in got], [s for _, s in want], atol=1e-5)
        assert [sentences[h["row"]] for h in got] == [h["sentence"] for h in got]
    assert body["results"][0][0]["sentence"] == sentences[3]
    assert body["results"][0][0]["score"] == pytest.approx(1.0, abs=1e-5)


def test_search_threshold_and_top_k(server):
    status, everything = call(server.url, "/search", {"queries": ["Two people talk."],
                                                      "top_k": 100, "threshold": None})
    assert status == 200 and len(everything["results"][0]) == CORPUS_SIZE  # top_k > rows
    scores = [h["score"] for h in everything["results"][0]]
    assert scores == sorted(scores, reverse=True)
    cut = scores[CORPUS_SIZE // 2]
    status, kept = call(server.url, "/search", {"queries": ["Two people talk."], "top_k": 100,
                                                "threshold": cut})
    assert status == 200
    assert kept["results"][0] == [h for h in everything["results"][0] if h["score"] >= cut]
    # The default threshold is the SimCSE tool's 0.6, and top_k's is 5.
    status, default = call(server.url, "/search", {"queries": ["Two people talk."]})
    assert default["results"][0] == [h for h in everything["results"][0][:5] if h["score"] >= 0.6]


def test_encode_and_similarity_match_the_library(server, local):
    model, _, sentences = local
    status, body = call(server.url, "/encode", {"sentences": sentences[:3]})
    assert status == 200 and body["dim"] == 36
    np.testing.assert_allclose(body["vectors"], jaxsim.encode(model, sentences[:3]), atol=1e-5)
    status, body = call(server.url, "/encode", {"sentences": sentences[:3], "normalize": True})
    np.testing.assert_allclose(np.linalg.norm(body["vectors"], axis=1), 1.0, atol=1e-5)
    status, body = call(server.url, "/similarity", {"queries": sentences[:2],
                                                    "keys": sentences[5:8]})
    assert status == 200
    np.testing.assert_allclose(body["scores"],
                               jaxsim.similarity(model, sentences[:2], sentences[5:8]), atol=1e-5)


def test_concurrent_requests_share_batches_and_keep_their_own_results(server, local):
    model, index, sentences = local
    _, before = call(server.url, "/health")
    queries = sentences[:24]
    with concurrent.futures.ThreadPoolExecutor(len(queries)) as pool:
        answers = list(pool.map(lambda q: call(server.url, "/search", {
            "queries": [q], "top_k": 3, "threshold": None}), queries))
    expected = index.search(model, queries, threshold=None, top_k=3)
    for (status, body), want in zip(answers, expected):
        assert status == 200
        assert [h["sentence"] for h in body["results"][0]] == [s for s, _ in want]
        np.testing.assert_allclose([h["score"] for h in body["results"][0]],
                                   [s for _, s in want], atol=1e-5)
    _, after = call(server.url, "/health")
    requests = after["served"]["requests"] - before["served"]["requests"]
    batches = after["served"]["batches"] - before["served"]["batches"]
    assert requests == len(queries)
    assert batches < requests and after["served"]["largest_batch"] > 1


def test_a_bad_request_among_concurrent_ones_fails_alone(server, local):
    model, index, sentences = local
    bodies = [{"queries": [q], "top_k": 2, "threshold": None} for q in sentences[:12]]
    bodies[5] = {"queries": ["\ud800"], "top_k": 2}  # would fail the tokenizer for its batch
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: call(server.url, "/search", b), bodies))
    assert answers[5][0] == 422 and answers[5][1]["field"] == "queries[0]"
    expected = index.search(model, sentences[:12], threshold=None, top_k=2)
    for i, ((status, body), want) in enumerate(zip(answers, expected)):
        if i != 5:
            assert status == 200, body
            assert [h["sentence"] for h in body["results"][0]] == [s for s, _ in want]


def _post_in_process(app, path: str, body: bytes) -> tuple[int, bytes]:
    """(status, body) of one POST through the ASGI app itself, no server."""
    sent, messages = [], []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    try:
        asyncio.run(app(scope, receive, send))
    except RuntimeError:
        pass  # the app answers, then re-raises the error for the server's log
    start = next(m for m in messages if m["type"] == "http.response.start")
    return start["status"], b"".join(m.get("body", b"") for m in messages[1:])


def test_an_unexpected_failure_is_a_json_500_without_traceback():
    class Broken:
        limits = ServeLimits()

        async def search(self, queries, top_k, threshold):
            raise RuntimeError("device lost")

    status, body = _post_in_process(create_app(Broken()), "/search", b'{"queries": ["a"]}')
    assert status == 500
    answer = json.loads(body)
    assert answer["error"].startswith("internal error (RuntimeError")
    assert "Traceback" not in body.decode()


def test_the_page_is_served(server):
    status, page = call(server.url, "/")
    assert status == 200 and '<form id="search-form">' in page and 'id="results"' in page


@pytest.mark.parametrize("path, body, status, field", [
    ("/search", {"queries": "a sentence"}, 422, "queries"),
    ("/search", {"queries": []}, 422, "queries"),
    ("/search", {"queries": ["a", 3]}, 422, "queries[1]"),
    ("/search", {"queries": ["a"] * 65}, 422, "queries"),
    ("/search", {"queries": ["a" * 2001]}, 422, "queries[0]"),
    ("/search", {"queries": ["a"], "top_k": 0}, 422, "top_k"),
    ("/search", {"queries": ["a"], "top_k": 101}, 422, "top_k"),
    ("/search", {"queries": ["a"], "top_k": "5"}, 422, "top_k"),
    ("/search", {"queries": ["a"], "threshold": "high"}, 422, "threshold"),
    ("/search", {"queries": ["a"], "top-k": 5}, 422, "top-k"),
    ("/search", {}, 422, "queries"),
    ("/search", [1, 2], 422, "body"),
    ("/encode", {"sentences": ["a"], "normalize": "yes"}, 422, "normalize"),
    ("/encode", {"sentence": ["a"]}, 422, "sentences"),
    ("/similarity", {"queries": ["a"]}, 422, "keys"),
    ("/similarity", {"queries": ["a"] * 40, "keys": ["b"] * 40}, 422, "queries + keys"),
    ("/search", {"queries": ["a", " "]}, 422, "queries[1]"),
    ("/search", {"queries": ["caf\udcff"]}, 422, "queries[0]"),  # a lone surrogate
    ("/encode", {"sentences": [""]}, 422, "sentences[0]"),
    ("/similarity", {"queries": ["a"], "keys": ["b", "\ud800"]}, 422, "keys[1]"),
])
def test_bad_requests_name_the_field(server, path, body, status, field):
    got, answer = call(server.url, path, body)
    assert got == status, answer
    assert answer["field"] == field and answer["error"].startswith(field + ": ")


def test_bad_bodies_get_json_errors(server):
    assert call(server.url, "/search", raw=b'{"queries": [') == (
        400, {"error": "body: not valid JSON", "field": "body"})
    status, answer = call(server.url, "/search", raw=b'{"queries": ["caf\xe9"]}')  # Latin-1
    assert status == 400 and answer["field"] == "body" and "UTF-8" in answer["error"], answer
    deep = b"[" * 100_000 + b"]" * 100_000  # valid UTF-8, past the parser's recursion limit
    assert call(server.url, "/search", raw=deep) == (
        400, {"error": "body: not valid JSON (nested too deeply)", "field": "body"})
    status, answer = call(server.url, "/search", raw=b'{"queries": ["a"], "threshold": NaN}')
    assert status == 422 and answer["field"] == "threshold"
    status, answer = call(server.url, "/search", raw=b"queries=a",
                          content_type="application/x-www-form-urlencoded")
    assert status == 415 and "application/json" in answer["error"]
    assert call(server.url, "/nowhere") == (404, {"error": "Not Found"})
    assert call(server.url, "/search") == (405, {"error": "Method Not Allowed"})


def test_bodies_over_the_limit_are_refused_unparsed(server):
    big = json.dumps({"queries": ["a" * 1_100_000]}).encode()
    status, answer = call(server.url, "/search", raw=big)
    assert status == 413 and answer["field"] == "body"
    # Chunked (no declared length): counted as it streams.
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=HANG_GUARD_S)
    conn.request("POST", "/search", body=iter([big[:600_000], big[600_000:]]),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())["field"] == "body"
    conn.close()
