"""Under pytest-xdist, each worker's benchmark scripts run on a CPU of their own."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def own_cpu():
    """The scripts pin themselves to the first CPU they may use (`--threads 1`): two workers'
    runs would share CPU 0 and leave the other idle. Worker N's tests (and the processes they
    start) may use only the N-th CPU; outside xdist nothing changes."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not worker.startswith("gw") or len(cpus) < 2:
        yield
        return
    os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)
