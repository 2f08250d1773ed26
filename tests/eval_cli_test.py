"""eval.py end to end on a tiny SentEval folder with the bundled model."""
from __future__ import annotations

import importlib
import json
import pathlib
import re

import numpy as np
import pytest

import eval as eval_cli
from jaxsim.eval import runner
from tests.senteval_test import write_tiny_senteval

# The module (the package re-exports a function under the same name).
encode_module = importlib.import_module('jaxsim.encode')
REPO = pathlib.Path(__file__).resolve().parents[1]


def test_default_data_is_shared_senteval_next_to_repo():
    assert runner.DEFAULT_DATA == REPO.parent / 'shared' / 'data' / 'senteval'


def test_table_json_plots_and_single_encoding(tmp_path, monkeypatch, capsys):
    root = write_tiny_senteval(tmp_path / 'data')
    calls = []
    real_encode = encode_module.encode

    def counting_encode(model, sentences, **kwargs):
        calls.append(list(sentences))
        return real_encode(model, sentences, **kwargs)

    monkeypatch.setattr(encode_module, 'encode', counting_encode)
    out = tmp_path / 'res.json'
    rc = eval_cli.main(['--data', str(root), '--post', 'none', '--post', 'whitening',
                        '--post', 'sn', '--json', str(out), '--plots', str(tmp_path / 'plots')])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    table = captured.out
    assert 'aggregation: all' in table and 'pooler: avg' in table
    assert '| Post | STS12 | STS-B | SICK-R | Avg. |' in table
    for label in ('none', 'whitening', 'sn'):
        assert f'\n| {label} | ' in table
    assert 'scoring SICK_trial.txt instead' in table  # the fallback is visible in the output
    # Each unique sentence was encoded once for the three rows.
    assert len(calls) == 1 and len(calls[0]) == len(set(calls[0])) == 15

    rows = json.loads(out.read_text())
    assert [r['post'] for r in rows] == ['none', 'whitening', 'sn']
    none = rows[0]
    assert set(none) >= {'model', 'pooler', 'post', 'tasks', 'avg', 'details'}
    assert set(none['tasks']) == {'STS12', 'STSBenchmark', 'SICKRelatedness'}
    assert none['avg'] == pytest.approx(np.mean(list(none['tasks'].values())))
    assert none['pooler'] == 'avg'
    details = none['details']
    assert set(details['per_task']['STS12']['subsets']) == {'A', 'B'}
    assert set(details['aggregates']) == {'all', 'mean', 'wmean'}
    assert len(details['data_files']) == 6
    assert all(h.startswith('sha256:') for h in details['data_files'].values())
    assert {'alignment', 'uniformity', 'mean_random_cosine', 'singular_values'} <= set(
        details['diagnostics'])
    assert details['timing']['sentences_encoded'] == 15
    # 15 sentences < 384 dims: whitening drops the null directions and says so.
    assert any('whitening' in n and 'null directions' in n for n in rows[1]['details']['notes'])
    for png in ('spectrum.png', 'align_uniform.png'):
        assert (tmp_path / 'plots' / png).read_bytes()[:4] == b'\x89PNG'


def test_aggregate_split_and_errors(tmp_path, capsys):
    root = write_tiny_senteval(tmp_path / 'data')
    assert eval_cli.main(['--data', str(root), '--split', 'dev', '--aggregate', 'wmean',
                          '--no-diagnostics']) == 0
    out = capsys.readouterr().out
    assert 'aggregation: wmean' in out and 'split: dev' in out
    assert '| Post | STS-B | Avg. |' in out
    assert re.search(r'\| none \| (-?\d+\.\d\d) \| \1 \|', out)  # one task: Avg. = it

    # An explicit K above what the data supports fails clearly (and after one encoding).
    assert eval_cli.main(['--data', str(root), '--tasks', 'stsb', '--post', 'whitening:256']) == 1
    assert 'cannot keep k=256' in capsys.readouterr().err

    # Missing task folders and malformed lines are one-line errors naming what/where.
    assert eval_cli.main(['--data', str(root), '--tasks', 'sts12,sts14']) == 1
    assert 'STS14: no task folder found; looked for' in capsys.readouterr().err
    gs = root / 'STS' / 'STS12-en-test' / 'STS.gs.A.txt'
    gs.write_text('1\n2\nthree\n4\n')
    assert eval_cli.main(['--data', str(root)]) == 1
    assert f"{gs}:3: non-numeric score 'three'" in capsys.readouterr().err
    assert eval_cli.main(['--data', str(root), '--post', 'natsv']) == 1
    assert 'natsv needs K' in capsys.readouterr().err
