"""The request batcher with stand-in encode/search functions: what is merged, what is split,
the bounded queue, shutdown, and the disable flag."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from jaxsim.serve.batcher import Batcher, BatcherBusy, BatcherClosed
from tests.conftest import HANG_GUARD_S

CORPUS = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32)


class Device:
    """Records every call; encode maps a sentence to a vector by its length and first letter."""

    def __init__(self, gate: threading.Event | None = None):
        self.encodes, self.searches, self.gate = [], [], gate

    def encode(self, sentences):
        if self.gate is not None:
            self.gate.wait(HANG_GUARD_S)
        self.encodes.append(list(sentences))
        return np.array([[len(s), ord(s[0]), 1.0, -len(s)] for s in sentences], np.float32)

    def search(self, vectors, k):
        self.searches.append((len(vectors), k))
        scores = vectors @ CORPUS.T
        rows = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(scores, rows, axis=1), rows


def brute_force(sentences, k):
    device = Device()
    return device.search(device.encode(sentences), k)


def test_waiting_requests_share_one_encode_and_one_top_k():
    device = Device()
    batcher = Batcher(device.encode, device.search, window_s=0.05)
    # Queued before the worker starts: all of them are waiting when it takes its first batch.
    futures = [batcher.submit(["a", "bb"], top_k=3), batcher.submit(["ccc"]),
               batcher.submit(["dddd"], top_k=5)]
    with batcher:
        results = [f.result(HANG_GUARD_S) for f in futures]
    assert device.encodes == [["a", "bb", "ccc", "dddd"]]
    assert device.searches == [(3, 5)]  # the searching rows only, with the largest top_k
    assert batcher.stats.batches == 1 and batcher.stats.requests == 3
    scores, rows = brute_force(["a", "bb"], 3)
    np.testing.assert_array_equal(results[0].rows, rows)
    np.testing.assert_allclose(results[0].scores, scores)
    assert results[1].rows is None and results[1].vectors.shape == (1, 4)
    scores, rows = brute_force(["dddd"], 5)
    np.testing.assert_array_equal(results[2].rows, rows)
    np.testing.assert_allclose(results[2].vectors, Device().encode(["dddd"]))


def test_batches_stop_at_max_batch_without_splitting_a_request():
    device = Device()
    batcher = Batcher(device.encode, device.search, window_s=0.05, max_batch=4)
    futures = [batcher.submit(s) for s in (["a", "b"], ["c"], ["d", "e"], ["f"])]
    with batcher:
        for f in futures:
            f.result(HANG_GUARD_S)
    assert device.encodes == [["a", "b", "c"], ["d", "e", "f"]]


def test_disabled_serves_one_request_per_call():
    device = Device()
    batcher = Batcher(device.encode, device.search, enabled=False)
    futures = [batcher.submit([s], top_k=2) for s in "abc"]
    with batcher:
        for f in futures:
            f.result(HANG_GUARD_S)
    assert device.encodes == [["a"], ["b"], ["c"]] and device.searches == [(1, 2)] * 3


def test_a_full_queue_refuses_and_close_fails_the_waiting():
    gate = threading.Event()  # holds the worker inside its first encode
    device = Device(gate)
    batcher = Batcher(device.encode, device.search, window_s=0, max_queue=2).start()
    first = batcher.submit(["a"])
    while batcher.queued():  # the worker has taken the first request
        pass
    waiting = [batcher.submit(["b"]), batcher.submit(["c"])]
    with pytest.raises(BatcherBusy, match="2 requests are waiting"):
        batcher.submit(["d"])
    closer = threading.Thread(target=batcher.close)
    closer.start()
    for f in waiting:
        with pytest.raises(BatcherClosed):
            f.result(HANG_GUARD_S)
    gate.set()  # the batch in flight still completes
    assert first.result(HANG_GUARD_S).vectors.shape == (1, 4)
    closer.join(HANG_GUARD_S)
    with pytest.raises(BatcherClosed):
        batcher.submit(["e"])


def test_an_encode_failure_reaches_every_caller_of_that_batch_only():
    calls = []

    def encode(sentences):
        calls.append(sentences)
        if "boom" in sentences:
            raise RuntimeError("device lost")
        return np.ones((len(sentences), 4), np.float32)

    batcher = Batcher(encode, Device().search, window_s=0.05, max_batch=2)
    futures = [batcher.submit(["boom"]), batcher.submit(["x"]), batcher.submit(["y", "z"])]
    with batcher:
        for f in futures[:2]:
            with pytest.raises(RuntimeError, match="device lost"):
                f.result(HANG_GUARD_S)
        assert futures[2].result(HANG_GUARD_S).vectors.shape == (2, 4)


@pytest.mark.parametrize("window_s", [float("nan"), float("inf"), -0.001])
def test_a_window_that_would_never_end_is_refused(window_s):
    # NaN passes `< 0`; with it (or inf) the worker would wait for ever for a lone request.
    with pytest.raises(ValueError, match="window_s must be a finite number >= 0"):
        Batcher(Device().encode, Device().search, window_s=window_s)
