"""eval.py end to end on tiny SentEval folders with the bundled model."""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

import jaxsim
from jaxsim.cli import eval as eval_cli
from jaxsim.eval import runner
from jaxsim.storage.paths import SENTEVAL_ROOT
from tests.conftest import HANG_GUARD_S, write_tiny_workdir
from tests.data.tiny_senteval import write_tiny_senteval

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def encode_calls(monkeypatch):
    """Counts `jaxsim.encode` calls made by the runner (each call: its sentences)."""
    calls = []
    real = jaxsim.encode

    def counting(model, sentences, **kwargs):
        calls.append(list(sentences))
        return real(model, sentences, **kwargs)

    monkeypatch.setattr(jaxsim, 'encode', counting)
    return calls


def test_default_data_is_the_shared_senteval_root():
    assert runner.DEFAULT_DATA == SENTEVAL_ROOT


def test_table_json_plots_and_single_encoding(tmp_path, encode_calls, capsys):
    root = write_tiny_senteval(tmp_path / 'data')
    out = tmp_path / 'res.json'
    rc = eval_cli.main(['--data', str(root), '--post', 'none', '--post', 'whitening',
                        '--post', 'sn', '--json', str(out), '--plots', str(tmp_path / 'plots')])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    table = captured.out
    assert 'aggregation: all' in table and 'pooler: avg' in table
    assert '| Post | STS12 | STS-B | SICK-R | Avg. (3) |' in table
    assert 'Avg. (3): the mean over STS12, STS-B, SICK-R only' in table
    assert f'data: STS12, STS-B, SICK-R from {root}' in table
    for label in ('none', 'whitening', 'sn'):
        assert f'\n| {label} | ' in table
    # Each note once, on stdout with the table, none on stderr.
    assert table.count('scoring') == 1 and 'SICK_trial.txt instead' in table
    assert table.count('null directions') == 1
    assert 'note:' not in captured.err
    # Each unique sentence was encoded once for the three rows.
    assert len(encode_calls) == 1 and len(encode_calls[0]) == len(set(encode_calls[0])) == 15

    rows = json.loads(out.read_text())
    assert [r['post'] for r in rows] == ['none', 'whitening', 'sn']
    none = rows[0]
    assert set(none) >= {'model', 'pooler', 'post', 'tasks', 'avg', 'avg_over', 'details'}
    assert none['avg_over'] == ['STS12', 'STSBenchmark', 'SICKRelatedness']
    assert none['avg'] == pytest.approx(np.mean(list(none['tasks'].values())))
    details = none['details']
    assert set(details['per_task']['STS12']['subsets']) == {'MSRpar', 'MSRvid'}
    assert set(details['aggregates']) == {'all', 'mean', 'wmean'}
    assert len(details['data_files']) == 6
    assert {'alignment', 'uniformity', 'mean_random_cosine', 'singular_values'} <= set(
        details['diagnostics'])
    assert details['timing']['sentences_encoded'] == 15
    assert rows[1]['details']['fit']['sets']['STS12']['sentences'] == 28
    for png in ('spectrum.png', 'align_uniform.png'):
        assert (tmp_path / 'plots' / png).read_bytes()[:4] == b'\x89PNG'


def test_two_roots_sick_test_from_the_second(tmp_path, capsys):
    a = write_tiny_senteval(tmp_path / 'a')  # SICK train + trial only
    b = write_tiny_senteval(tmp_path / 'b', sick_test=True, sts12=False, stsb=False, sick=False)
    out = tmp_path / 'r.json'
    rc = eval_cli.main(['--data', str(a), '--data', str(b), '--post', 'sn', '--fit-on', 'paper',
                        '--no-diagnostics', '--json', str(out)])
    table = capsys.readouterr().out
    assert rc == 0
    assert f'data: STS12, STS-B from {a}' in table and f'data: SICK-R from {b}' in table
    assert 'SICK_trial.txt instead' not in table and 'not found' not in table.split('note:')[0]
    record = json.loads(out.read_text())
    assert list(record['details']['per_task']['SICKRelatedness']['subsets']) == ['test']
    assert record['details']['data_sources']['SICKRelatedness'] == [str(b)]
    sick_fit = record['details']['fit']['sets']['SICKRelatedness']
    assert [p['split'] for p in sick_fit['parts']] == ['train', 'dev', 'test']
    assert record['details']['fit']['fit_on'] == 'paper'


@pytest.mark.parametrize('args, message', [
    (['--json', '{tmp}'], 'error: --json {tmp} is a folder'),
    (['--plots', '{tmp}/file.txt/plots'], 'error: --plots {tmp}/file.txt/plots: '
                                          '{tmp}/file.txt is not a folder'),
    (['--plots', '{tmp}/file.txt'], 'error: --plots {tmp}/file.txt is a file, not a folder'),
    (['--seeds', '1,x'], "error: --seeds '1,x': 'x' is not a non-negative integer"),
    (['--aggregate', 'median'], 'error: argument --aggregate: invalid choice'),
    (['--post', 'sn', '--fit-on', '{tmp}/none.txt'],
     'error: {tmp}/none.txt: sentence file not found'),
    (['--tasks', 'stsb,subj'], 'error: SUBJ: no task folder found'),
    (['--tasks', 'stsb,sts99'], "error: unknown task 'sts99'"),
    (['--model', 'bundled', '--model', 'bundled'],
     'error: --model bundled is given twice; name each model once'),
])
def test_bad_options_fail_before_any_work(tmp_path, monkeypatch, capsys, args, message):
    (tmp_path / 'file.txt').write_text('x\n')
    monkeypatch.setattr(jaxsim, 'load_pretrained', lambda *a, **k: pytest.fail('model loaded'))
    root = write_tiny_senteval(tmp_path / 'data')
    args = [a.format(tmp=tmp_path) for a in args]
    with pytest.raises(SystemExit) if args[0] == '--aggregate' else _no_raise() as exit_info:
        rc = eval_cli.main(['--data', str(root)] + args)
    rc = exit_info.value.code if args[0] == '--aggregate' else rc
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith(message.format(tmp=tmp_path)) and err.count('\n') == 1, err


def test_a_fit_file_too_small_names_the_file(tmp_path, capsys):
    root = write_tiny_senteval(tmp_path / 'data')
    one = tmp_path / 'one.txt'
    one.write_text('a single sentence\n')
    assert eval_cli.main(['--data', str(root), '--tasks', 'stsb', '--post', 'whitening',
                          '--fit-on', str(one)]) == 1
    assert capsys.readouterr().err == (f'error: fit on {one}: whitening: need at least 2 '
                                       f'sentences, got 1\n')


def test_empty_model_is_an_error_not_the_bundled_model(tmp_path, capsys):
    # `--model "$M"` with M unset: scoring the bundled model instead would go unnoticed.
    root = write_tiny_senteval(tmp_path / 'data')
    assert eval_cli.main(['--data', str(root), '--model', '', '--tasks', 'stsb']) == 1
    assert capsys.readouterr().err == ("error: the model path is empty; give a folder, a hub id "
                                       "or 'bundled'\n")


class _no_raise:
    value = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_aggregate_split_and_data_errors(tmp_path, capsys):
    root = write_tiny_senteval(tmp_path / 'data')
    assert eval_cli.main(['--data', str(root), '--split', 'dev', '--aggregate', 'wmean',
                          '--no-diagnostics']) == 0
    out = capsys.readouterr().out
    assert 'aggregation: wmean' in out and 'split: dev' in out
    assert '| Post | STS-B | Avg. (1) |' in out
    assert re.search(r'\| none \| (-?\d+\.\d\d) \| \1 \|', out)  # one task: Avg. = it

    # An explicit K above what the data supports fails clearly.
    assert eval_cli.main(['--data', str(root), '--tasks', 'stsb', '--post', 'whitening:256']) == 1
    assert 'cannot keep k=256 directions' in capsys.readouterr().err
    # Missing task folders and malformed lines are one-line errors naming what/where.
    assert eval_cli.main(['--data', str(root), '--tasks', 'sts12,sts14']) == 1
    assert 'STS14: no task folder found; looked for' in capsys.readouterr().err
    gs = root / 'STS' / 'STS12-en-test' / 'STS.gs.MSRpar.txt'
    gs.write_text('1\n2\nthree\n4\n')
    assert eval_cli.main(['--data', str(root)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {gs}:3: non-numeric score 'three'\n"
    assert eval_cli.main(['--data', str(root), '--post', 'natsv']) == 1
    assert capsys.readouterr().err == "error: calibration 'natsv' needs an argument, e.g. natsv:5\n"


def test_no_library_noise_on_stderr(tmp_path):
    """Without torch >= 2.6, transformers advises 'PyTorch was not found' on import; eval.py
    silences it. A fake old torch stands in for a machine without PyTorch."""
    fake = tmp_path / 'site'
    (fake / 'torch').mkdir(parents=True)
    # What libraries read of any torch: its version, and torch.Tensor (tensorboardX's writer).
    (fake / 'torch' / '__init__.py').write_text('__version__ = "1.0.0"\n\n\nclass Tensor:\n'
                                                '    pass\n')
    (fake / 'torch-1.0.0.dist-info').mkdir()
    (fake / 'torch-1.0.0.dist-info' / 'METADATA').write_text(
        'Metadata-Version: 2.1\nName: torch\nVersion: 1.0.0\n')
    env = {**os.environ, 'PYTHONPATH': f'{fake}{os.pathsep}{REPO}'}
    for var in ('TRANSFORMERS_VERBOSITY', 'TRANSFORMERS_NO_ADVISORY_WARNINGS'):
        env.pop(var, None)  # importing eval.py in this process set them
    plain = subprocess.run([sys.executable, '-c', 'import transformers'], env=env,
                           capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert 'PyTorch was not found' in plain.stderr  # the noise exists ...
    root = write_tiny_senteval(tmp_path / 'data', sts12=False, sick=False)
    run = subprocess.run([sys.executable, str(REPO / 'eval.py'), '--data', str(root),
                          '--no-diagnostics'], env=env, capture_output=True, text=True,
                         timeout=HANG_GUARD_S, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert '[transformers]' not in run.stderr and 'WARNING' not in run.stderr, run.stderr
    assert '| none |' in run.stdout


def _write_tiny_transfer(root: pathlib.Path) -> pathlib.Path:
    """MR and MRPC with a few clearly separable samples."""
    (root / 'MR').mkdir(parents=True)
    pos = [f'a {w} and {v} film .' for w in ('great', 'wonderful', 'superb', 'lovely')
           for v in ('moving', 'funny', 'warm')]
    neg = [f'a {w} and {v} film .' for w in ('awful', 'terrible', 'dreadful', 'boring')
           for v in ('dull', 'ugly', 'cold')]
    (root / 'MR' / 'rt-polarity.pos').write_text('\n'.join(pos) + '\n')
    (root / 'MR' / 'rt-polarity.neg').write_text('\n'.join(neg) + '\n')
    (root / 'MRPC').mkdir()
    head = 'Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n'

    def pairs(n, offset):
        rows = []
        for i in range(n):
            s = pos[(i + offset) % len(pos)]
            rows.append(f'1\t{i}\t{i}\t{s}\t{s}\n' if i % 2 else
                        f'0\t{i}\t{i}\t{s}\t{neg[(i + offset) % len(neg)]}\n')
        return ''.join(rows)

    (root / 'MRPC' / 'msr_paraphrase_train.txt').write_text(head + pairs(24, 0))
    (root / 'MRPC' / 'msr_paraphrase_test.txt').write_text(head + pairs(8, 5))
    return root


def test_transfer_tasks_table_and_json(tmp_path, capsys):
    root = _write_tiny_transfer(tmp_path / 'data')
    out = tmp_path / 't.json'
    rc = eval_cli.main(['--data', str(root), '--tasks', 'mr,mrpc', '--json', str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    table = captured.out
    assert 'Accuracy x100 of logistic regression' in table and 'pooler: avg' in table
    assert '| Model | MR | MRPC | MRPC F1 | Avg. (2) |' in table
    assert 'Avg. (2): the mean accuracy over MR, MRPC only' in table
    assert f'data: MR, MRPC from {root}' in table
    assert 'Spearman' not in table  # no STS task asked, no STS table
    record = json.loads(out.read_text())
    assert record['metric'] == 'accuracy x100' and record['avg_over'] == ['MR', 'MRPC']
    assert record['tasks']['MR'] > 80  # separable by construction
    assert record['avg'] == pytest.approx(np.mean(list(record['tasks'].values())))
    assert set(record['f1']) == {'MRPC'} and 0 <= record['f1']['MRPC'] <= 100
    assert re.search(rf'\| {re.escape(record["model"])} \| {record["tasks"]["MR"]:.2f} \|',
                     table)


def _tb_scalars(folder: pathlib.Path) -> dict:
    """tag -> [(step, value)] of one TensorBoard run folder, read by TensorBoard's reader."""
    acc = event_accumulator.EventAccumulator(str(folder), purge_orphaned_data=True)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()['scalars']}


def test_tb_scalars_match_the_json(tmp_path, bundled, capsys):
    sts_root = write_tiny_senteval(tmp_path / 'data', sick=False)
    transfer_root = _write_tiny_transfer(tmp_path / 'transfer')
    workdir = tmp_path / 'run'
    write_tiny_workdir(workdir, bundled.tokenizer, pooler='avg',
                       steps=((3, 0.2), (7, 0.8), (9, 0.1)))  # step 7: best on dev
    models = [str(workdir), str(jaxsim.bundled_model_path())]
    out, tb = tmp_path / 'res.json', tmp_path / 'tb'
    argv = ['--model', models[0], '--model', models[1], '--data', str(sts_root),
            '--data', str(transfer_root), '--tasks', 'sts12,stsb,mrpc', '--post', 'none',
            '--post', 'whitening:8', '--no-diagnostics', '--json', str(out), '--tb', str(tb)]
    assert eval_cli.main(argv) == 0, capsys.readouterr().err
    records = json.loads(out.read_text())
    runs = {'run': (models[0], 7), jaxsim.bundled_model_path().name: (models[1], 0)}
    assert sorted(p.name for p in tb.iterdir()) == sorted(runs)
    for run, (model, step) in runs.items():
        want = {}
        for r in records:
            if 'metric' in r:  # a transfer record, its model named with its checkpoint
                if r['model'].startswith(model):
                    want.update({f'transfer/{t}/accuracy': v for t, v in r['tasks'].items()})
                    want.update({f'transfer/{t}/f1': v for t, v in r['f1'].items()})
                    want['transfer/avg/accuracy'] = r['avg']
            elif r['model'] == model:
                post = r['post'].replace(':', '_')
                want.update({f'sts_test/{post}/{t}': v for t, v in r['tasks'].items()})
                want[f'sts_test/{post}/avg'] = r['avg']
        # (STS12, STS-B, avg) x 2 posts; MRPC's accuracy and F1, the accuracies' average.
        assert len(want) == 2 * 3 + 3
        got = _tb_scalars(tb / run)
        assert got.keys() == want.keys()
        for tag, value in want.items():
            assert [s for s, _ in got[tag]] == [step], tag
            assert got[tag][0][1] == pytest.approx(value, rel=1e-6, abs=1e-6), tag

    # The folder exists now: refused before any work, replaced whole with --overwrite.
    again = ['--model', models[0], '--data', str(sts_root), '--tasks', 'stsb',
             '--no-diagnostics', '--tb', str(tb)]
    capsys.readouterr()
    assert eval_cli.main(again) == 1
    assert capsys.readouterr().err == (f'error: --tb {tb} exists; pass --overwrite to replace '
                                       'it\n')
    assert eval_cli.main(again + ['--overwrite']) == 0
    assert [p.name for p in tb.iterdir()] == ['run']
    assert set(_tb_scalars(tb / 'run')) == {'sts_test/none/STSBenchmark', 'sts_test/none/avg'}


@pytest.mark.parametrize('target, message', [
    ('gs://bucket/tb', 'error: --tb must be a local folder, got gs://bucket/tb'),
    ('{tmp}/file.txt', 'error: --tb {tmp}/file.txt is a file, not a folder'),
    ('{tmp}', 'error: --tb {tmp} holds other files (data, file.txt); it is not replaced even '
              'with --overwrite'),
])
def test_tb_target_refused_before_any_work(tmp_path, monkeypatch, capsys, target, message):
    (tmp_path / 'file.txt').write_text('x\n')
    monkeypatch.setattr(jaxsim, 'load_pretrained', lambda *a, **k: pytest.fail('model loaded'))
    root = write_tiny_senteval(tmp_path / 'data')
    target = target.format(tmp=tmp_path)
    assert eval_cli.main(['--data', str(root), '--tb', target, '--overwrite']) == 1
    err = capsys.readouterr().err
    assert err.startswith(message.format(tmp=tmp_path)) and err.count('\n') == 1, err
