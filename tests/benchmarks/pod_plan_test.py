"""benchmarks/pod_plan.py: one plan process per row, its JSON read back into the table."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / 'benchmarks'))
import pod_plan  # noqa: E402


def test_a_row_is_the_plan_commands_json(monkeypatch):
    monkeypatch.setitem(pod_plan.MODELS, 'tiny', 'bundled')
    monkeypatch.setitem(pod_plan.CASES, 'tiny-16', ('tiny_unsup_simcse.py', 16, 0))
    monkeypatch.setitem(pod_plan.CASES, 'tiny-6', ('tiny_unsup_simcse.py', 6, 0))
    monkeypatch.setitem(pod_plan.TOPOLOGIES, 'v5e-4', ('v5e:2x2', 1))
    row = pod_plan.plan_one('tiny', 'tiny-16', 'v5e-4', False, lambda m: None)
    assert row['fits'] is True and row['mesh'] == {'data': 4, 'fsdp': 1, 'tensor': 1}
    assert row['recommended'] == 'as configured: mesh data=4'
    assert 0 < row['hbm_gib'] < row['capacity_gib'] == pytest.approx(16, rel=0.01)
    assert 0 < row['mfu_ceiling'] <= 1 and row['step_s_estimate'] > 0
    assert row['collectives']['all-reduce'] >= 1  # the gradient reduction
    # A batch the mesh cannot divide: the row is the plan of the mesh the refusal names.
    small = pod_plan.plan_one('tiny', 'tiny-6', 'v5e-4', False, lambda m: None)
    assert small['as_configured'].startswith('error:') and '6' in small['as_configured']
    assert small['mesh'] == {'data': 2, 'fsdp': 1, 'tensor': 2} and small['fits'] is True
    assert small['recommended'] == '--config.mesh_data=2 --config.mesh_tensor=2'
    # Any other refusal is the command's one-line error, kept in the row.
    monkeypatch.setitem(pod_plan.MODELS, 'unknown', 'no-such-model')
    bad = pod_plan.plan_one('unknown', 'tiny-16', 'v5e-4', False, lambda m: None)
    assert bad['error'].startswith('error:') and 'no-such-model' in bad['error'], bad
    table = pod_plan.markdown([row, small, bad]).splitlines()
    assert table[2].startswith('| tiny | tiny-16 | v5e-4 | yes | ')
    assert f"{row['collectives']['all-reduce']} AR" in table[2].split(' | ')[7]
    assert table[3].startswith('| tiny | tiny-6 | v5e-4 | yes | ')
    assert table[4].startswith('| unknown | tiny-16 | v5e-4 | - |') and 'error:' in table[4]


def test_unknown_names_are_refused(capsys):
    with pytest.raises(SystemExit):
        pod_plan.main(['--topologies', 'v9-1'])
    assert '--topologies: unknown v9-1' in capsys.readouterr().err
