"""benchmarks/input_scale.py end to end on small corpora: the record's ratio follows from its
runs (fastest start, largest peak per corpus), each corpus was indexed once before training,
and the corpora are the sizes asked for."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]


def test_small_run_writes_a_consistent_record(tmp_path):
    out = tmp_path / 'scale.json'
    proc = subprocess.run(
        [sys.executable, str(ROOT / 'benchmarks' / 'input_scale.py'), '--sizes', '2000,6000',
         '--steps', '3', '--repeats', '2', '--input-batches', '5', '--json', str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    small, large = record['runs']
    assert (small['lines'], large['lines']) == (2000, 6000)
    for row in (small, large):
        runs = row['all_runs']
        assert len(runs) == 2
        assert row['peak_rss_mb'] == max(r['peak_rss_mb'] for r in runs) > 100
        assert row['first_step_s'] == min(r['first_step_s'] for r in runs) > 0
        assert all(r['first_step_s'] < r['wall_s'] for r in runs)
        assert row['input_vs_step'] == pytest.approx(
            row['input_sentences_s'] / row['step_sentences_s'], rel=0.01)
        assert row['index_build_s'] > 0
    rss = large['peak_rss_mb'] / small['peak_rss_mb']
    start = large['first_step_s'] / small['first_step_s']
    assert record['rss_ratio'] == pytest.approx(rss, abs=1e-3)
    assert record['first_step_ratio'] == pytest.approx(start, abs=1e-3)
    assert record['ratio'] == pytest.approx(max(rss, start), abs=1e-3)
    assert 'indexed in' in proc.stderr and 'index reused' not in proc.stderr
