"""The output rule and clean interrupts of every command line: an existing output is refused and
left byte-identical, nothing is written half, SIGINT/SIGTERM at any moment end in one line with
exit 130/143; plus the checks that run before any work."""
from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxsim
from jaxsim.cli import eval as eval_cli
from jaxsim.cli.main import main as cli_main
from jaxsim.encode import NonFiniteVectorsError
from jaxsim.search import IndexFileError, SearchIndex, load_index
from jaxsim.storage.paths import SENTEVAL_ROOT
from tests.conftest import HANG_GUARD_S, write_tiny_model
from tests.data.tiny_senteval import write_tiny_senteval

REPO = Path(__file__).resolve().parents[1]


def tree_digest(folder: Path) -> dict:
    """Every file under `folder` (names, modes, bytes) as {relative path: (mode, sha256)}."""
    return {str(p.relative_to(folder)): (p.stat().st_mode,
                                         hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob('*')) if p.is_file()} | {
        str(p.relative_to(folder)) + '/': (p.stat().st_mode, None)
        for p in folder.rglob('*') if p.is_dir()}


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and err.startswith('error: '), err
    return err


# ------------------------------------------------------------------------- output rule
def test_index_refuses_an_existing_folder_and_leaves_it_byte_identical(tmp_path, capsys):
    """A user's folder (a 12 MB vectors.npy in the report) is never written into."""
    corpus = tmp_path / 'a.txt'
    corpus.write_text('a man plays a guitar .\na dog runs .\n')
    user = tmp_path / 'mine'
    user.mkdir()
    np.save(user / 'vectors.npy', np.arange(12, dtype=np.float32))
    (user / 'notes.txt').write_text('mine\n')
    before = tree_digest(user)
    code = cli_main(['index', '--input', str(corpus), '--out', str(user)])
    assert code == 1
    assert f'--out {user} exists; pass --overwrite' in one_error_line(capsys)
    assert tree_digest(user) == before
    # --overwrite does not delete a folder that is not an index either.
    assert cli_main(['index', '--input', str(corpus), '--out', str(user), '--overwrite']) == 1
    assert 'not a previous index' in one_error_line(capsys)
    assert tree_digest(user) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ['a.txt', 'mine']  # no temp left


def test_index_over_an_index_needs_overwrite(tmp_path, capsys):
    """An index of 6 sentences silently became one of 3: now refused, replaced only when asked."""
    six, three = tmp_path / 'six.txt', tmp_path / 'three.txt'
    six.write_text(''.join(f'sentence number {i} .\n' for i in range(6)))
    three.write_text(''.join(f'other sentence {i} .\n' for i in range(3)))
    out = tmp_path / 'ix'
    assert cli_main(['index', '--input', str(six), '--out', str(out)]) == 0
    capsys.readouterr()
    before = tree_digest(out)
    assert cli_main(['index', '--input', str(three), '--out', str(out)]) == 1
    one_error_line(capsys)
    assert tree_digest(out) == before and len(load_index(out)) == 6
    assert cli_main(['index', '--input', str(three), '--out', str(out), '--overwrite']) == 0
    assert len(load_index(out)) == 3


def test_eval_json_refuses_an_existing_file_byte_identical(tmp_path, capsys, monkeypatch):
    root = write_tiny_senteval(tmp_path / 'data')
    existing = tmp_path / 'results.json'
    existing.write_bytes(b'{"earlier": "results"}\n')
    os.chmod(existing, 0o640)
    before = (existing.read_bytes(), existing.stat().st_mode, existing.stat().st_mtime_ns)
    monkeypatch.setattr(jaxsim, 'load_pretrained', lambda *a, **k: pytest.fail('model loaded'))
    assert eval_cli.main(['--data', str(root), '--json', str(existing)]) == 1
    assert f'--json {existing} exists; pass --overwrite' in one_error_line(capsys)
    assert (existing.read_bytes(), existing.stat().st_mode, existing.stat().st_mtime_ns) == before
    plots = tmp_path / 'plots'
    plots.mkdir()
    (plots / 'spectrum.png').write_bytes(b'earlier figure')
    assert eval_cli.main(['--data', str(root), '--plots', str(plots)]) == 1
    assert f'--plots {plots} exists; pass --overwrite' in one_error_line(capsys)
    assert (plots / 'spectrum.png').read_bytes() == b'earlier figure'


def test_an_input_is_never_an_output_even_with_overwrite(tmp_path, capsys, monkeypatch):
    """--overwrite replaces an earlier output, never what the command reads: a test set of
    --data, a file inside --model, the --input sentences (also through a symlink or a hard
    link)."""
    root = write_tiny_senteval(tmp_path / 'data')
    test_set = next(root.rglob('sts-test.csv'))
    sentences = tmp_path / 'f.txt'
    sentences.write_text('a man plays a guitar .\n')
    link = tmp_path / 'link.txt'
    link.symlink_to(sentences)
    hard = tmp_path / 'hard.txt'
    os.link(sentences, hard)
    model = tmp_path / 'model'
    model.mkdir()
    (model / 'config.json').write_text('{}')
    before = tree_digest(tmp_path)
    monkeypatch.setattr(jaxsim, 'load_pretrained', lambda *a, **k: pytest.fail('model loaded'))
    assert eval_cli.main(['--data', str(root), '--tasks', 'stsb', '--json', str(test_set),
                          '--overwrite']) == 1
    assert one_error_line(capsys) == (f'error: --json {test_set} would overwrite an input '
                                      f'(--data {root}); name another file\n')
    assert eval_cli.main(['--data', str(root), '--model', str(model), '--json',
                          str(model / 'config.json'), '--overwrite']) == 1
    assert f'would overwrite an input (--model {model})' in one_error_line(capsys)
    for output in (sentences, link, hard):
        assert cli_main(['encode', '--input', str(sentences), '--output', str(output),
                         '--overwrite']) == 1
        assert one_error_line(capsys) == (f'error: --output {output} would overwrite an input '
                                          f'(--input {sentences}); name another file\n')
    assert tree_digest(tmp_path) == before


def test_eval_overwrite_replaces_json_and_plots_whole(tmp_path, capsys):
    root = write_tiny_senteval(tmp_path / 'data')
    out, plots = tmp_path / 'r.json', tmp_path / 'plots'
    out.write_text('old')
    plots.mkdir()
    (plots / 'spectrum.png').write_bytes(b'old')
    assert eval_cli.main(['--data', str(root), '--tasks', 'stsb', '--json', str(out),
                          '--plots', str(plots), '--overwrite']) == 0
    record = json.loads(out.read_text())
    assert record['avg'] == pytest.approx(record['tasks']['STSBenchmark'])
    assert (plots / 'spectrum.png').read_bytes()[:4] == b'\x89PNG'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['data', 'plots', 'r.json']


def test_index_rows_reordered_after_saving_are_refused(tmp_path):
    vectors = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    SearchIndex.from_vectors(vectors, [f's{i}' for i in range(5)]).save(tmp_path / 'ix')
    lines = (tmp_path / 'ix' / 'sentences.jsonl').read_text().splitlines()
    (tmp_path / 'ix' / 'sentences.jsonl').write_text('\n'.join(lines[::-1]) + '\n')
    with pytest.raises(IndexFileError, match='changed since the index was saved'):
        load_index(tmp_path / 'ix')
    SearchIndex.from_vectors(vectors, [f's{i}' for i in range(5)]).save(tmp_path / 'iy')
    stored = np.load(tmp_path / 'iy' / 'vectors.npy')
    np.save(tmp_path / 'iy' / 'vectors.npy', stored[[1, 0, 2, 3, 4]])
    with pytest.raises(IndexFileError, match='checksum mismatch'):
        load_index(tmp_path / 'iy')


# python -m jaxsim, with files that stop growing past 100 kB as on a full disk: writes then fail
# (EFBIG, or numpy's short write) instead of the process being killed by SIGXFSZ.
_FULL_DISK = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
sys.argv = ['jaxsim'] + sys.argv[1:]
runpy.run_module('jaxsim', run_name='__main__', alter_sys=True)
"""


def test_a_full_disk_is_one_line_naming_the_output(tmp_path):
    """'115200 requested and 42976 written' or '[Errno 28]' alone named no file."""
    write_tiny_model(tmp_path / 'tiny')
    sentences = tmp_path / 's.txt'
    sentences.write_text(''.join(f'sentence number {i} .\n' for i in range(2000)))
    env = dict(os.environ, JAX_PLATFORMS='cpu', JAX_ENABLE_COMPILATION_CACHE='false',
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get('PYTHONPATH', ''))
    for option, output, command in (
            ('--output', tmp_path / 'v.npy', 'encode'), ('--out', tmp_path / 'ix', 'index')):
        proc = subprocess.run(
            [sys.executable, '-c', _FULL_DISK, command, '--model', str(tmp_path / 'tiny'),
             '--input', str(sentences), option, str(output)], cwd=REPO, env=env,
            capture_output=True, text=True, timeout=HANG_GUARD_S)
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert proc.stderr.startswith(f'error: {option} {output}: cannot be written: ')
        assert proc.stderr.count('\n') == 1 and proc.stderr.endswith(
            'the earlier content, if any, is kept\n'), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ['s.txt', 'tiny']  # nothing half


# ------------------------------------------------------------------ checks before work
@pytest.mark.parametrize('args, message', [
    (['--seeds', '99999999999999999999'], 'is larger than 4294967295'),
    (['--fit-on', 'task'], '--fit-on task has no effect'),
    (['--post', 'whitening', '--seeds', '1,2'], '--seeds 1,2 has no effect'),
    (['--flow-checkpoint', 'cal'], '--flow-checkpoint cal has no effect without --post flow'),
    (['--tasks', 'mr', '--post', 'whitening'], '--post whitening has no effect: calibrations '
                                               'apply to STS tasks'),
    (['--tasks', 'mr,cr', '--split', 'dev'], '--split dev has no effect'),
    # An empty `--tasks $T` is not every task (minutes of work nobody asked for).
    (['--tasks', ''], "--tasks '' names no task"),
    (['--tasks', ' , '], "--tasks ' , ' names no task"),
])
def test_eval_refuses_flags_without_effect_before_loading(tmp_path, capsys, monkeypatch, args,
                                                          message):
    root = write_tiny_senteval(tmp_path / 'data')
    monkeypatch.setattr(jaxsim, 'load_pretrained', lambda *a, **k: pytest.fail('model loaded'))
    assert eval_cli.main(['--data', str(root)] + args) == 1
    assert message in one_error_line(capsys)


def test_prepare_refuses_snli_splits_without_the_snli_format(tmp_path, capsys):
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('a man plays a guitar .\n')
    assert cli_main(['prepare', str(corpus), '--snli-splits', 'dev']) == 1
    assert one_error_line(capsys).startswith(
        'error: --snli-splits dev has no effect: it goes with --format snli (the files are read '
        'as --format text)')
    assert sorted(p.name for p in tmp_path.iterdir()) == ['corpus.txt']  # no index built


def test_eval_refuses_a_calibration_wider_than_the_model_before_encoding(tmp_path, capsys,
                                                                         monkeypatch):
    root = write_tiny_senteval(tmp_path / 'data')
    monkeypatch.setattr(jaxsim, 'encode', lambda *a, **k: pytest.fail('encoded'))
    assert eval_cli.main(['--data', str(root), '--post', 'whitening:99999']) == 1
    assert 'whitening:99999: 99999 is more than the 384 dimensions' in one_error_line(capsys)


def test_nan_weights_are_an_error_naming_the_first_sentence(bundled, tmp_path, capsys):
    params = jax.tree.map(np.asarray, bundled.params)
    params['bert']['embeddings']['word_embeddings']['embedding'] = np.where(
        np.arange(params['bert']['embeddings']['word_embeddings']['embedding'].shape[0])[:, None]
        == bundled.tokenizer.convert_tokens_to_ids('dog'), np.nan,
        params['bert']['embeddings']['word_embeddings']['embedding'])
    broken = bundled.with_params(params)
    with pytest.raises(NonFiniteVectorsError,
                       match=r"for 2 of 3 sentences, the first for sentence 2: 'a dog runs \.'"):
        jaxsim.encode(broken, ['a cat sleeps .', 'a dog runs .', 'the dog barks .'])
    out = jaxsim.encode(broken, ['a cat sleeps .', 'a dog runs .'], finite=False)
    assert np.isfinite(out[0]).all() and not np.isfinite(out[1]).all()


# --------------------------------------------------------------------------- interrupts
def _signalled(args, signum, phase, tmp_path):
    """Runs `python ARGS` in tmp_path, the process sending itself `signum` at `phase`
    (tests/signal_phases.py: no timing involved); checks that it landed there."""
    env = dict(os.environ, JAX_PLATFORMS='cpu',
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get('PYTHONPATH', ''))
    proc = subprocess.run([sys.executable, '-c', 'from tests.signal_phases import main; main()',
                           phase, signal.Signals(signum).name, *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=HANG_GUARD_S)
    lines = proc.stderr.splitlines()
    assert [x[len('PHASE '):] for x in lines if x.startswith('PHASE ')] == [phase], proc.stderr
    return proc.returncode, proc.stdout, '\n'.join(x for x in lines if not x.startswith('PHASE '))


@pytest.fixture(scope='module')
def long_input(tmp_path_factory):
    """Enough sentences that encoding outlasts every signal below."""
    path = tmp_path_factory.mktemp('long') / 'in.txt'
    lines = (SENTEVAL_ROOT / 'SNLI' / 's1.test').read_text().splitlines()
    path.write_text('\n'.join(lines * 4) + '\n')
    return path


# start-up: JAX still importing, before any handler could be installed; gc callback: inside
# JAX's garbage-collection callback, which swallowed a KeyboardInterrupt raised there;
# encoding: the model loaded and encoding.
@pytest.mark.parametrize('signum, phase', [(signal.SIGINT, 'start-up'),
                                           (signal.SIGINT, 'gc callback'),
                                           (signal.SIGTERM, 'gc callback'),
                                           (signal.SIGINT, 'encoding')])
def test_encode_interrupted_at_any_moment_is_one_line(long_input, tmp_path, signum, phase):
    code, out, err = _signalled(['-m', 'jaxsim', 'encode', '--input', str(long_input),
                                 '--output', 'v.npy'], signum, phase, tmp_path)
    name = signal.Signals(signum).name
    assert code == 128 + signum, err
    assert err.strip().splitlines()[-1] == f'interrupted by {name}; no output file written'
    assert 'Traceback' not in err and 'Exception ignored' not in err, err
    assert list(tmp_path.iterdir()) == []  # neither the output nor a temporary file


@pytest.mark.parametrize('signum, phase', [(signal.SIGINT, 'start-up'),
                                           (signal.SIGINT, 'gc callback'),
                                           (signal.SIGTERM, 'encoding')])
def test_eval_interrupted_is_one_line_and_writes_nothing(tmp_path, signum, phase):
    code, out, err = _signalled([str(REPO / 'eval.py'), '--json', 'r.json', '--plots', 'p'],
                                signum, phase, tmp_path)
    assert code == 128 + signum, err
    assert err.strip().splitlines() == [
        f'interrupted by {signal.Signals(signum).name}; no output file written'], err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------ more inputs
class _Stdin:
    def __init__(self, data: bytes):
        self.buffer = io.BytesIO(data)

    def isatty(self):
        return False


def test_encode_and_index_read_standard_input_and_search_reads_a_query_file(
        bundled, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, 'stdin', _Stdin(b'a man plays a guitar .\n\n  \na dog runs .\n'))
    assert cli_main(['encode', '--input', '-', '--output', str(tmp_path / 'v.npy')]) == 0
    assert 'note: <stdin>: skipped 2 blank lines' in capsys.readouterr().err
    want = jaxsim.encode(bundled, ['a man plays a guitar .', 'a dog runs .'])
    np.testing.assert_allclose(np.load(tmp_path / 'v.npy'), want, atol=1e-5)

    corpus = ['a man plays a guitar .', 'a dog runs in the park .', 'the stock market fell .']
    monkeypatch.setattr(sys, 'stdin', _Stdin('\n'.join(corpus).encode()))
    assert cli_main(['index', '--input', '-', '--out', str(tmp_path / 'ix')]) == 0
    (tmp_path / 'q.txt').write_text('someone plays music\n\na puppy is running\n')
    capsys.readouterr()
    assert cli_main(['search', '--index', str(tmp_path / 'ix'), '--queries',
                     str(tmp_path / 'q.txt'), '--top-k', '1', '--threshold', '-1']) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == 'query: someone plays music' and lines[1].endswith('\t' + corpus[0])
    assert lines[2] == 'query: a puppy is running' and lines[3].endswith('\t' + corpus[1])
    assert cli_main(['search', '--index', str(tmp_path / 'ix')]) == 1
    assert 'no query: pass --query TEXT' in one_error_line(capsys)
