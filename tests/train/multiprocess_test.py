"""Multi-process training on loopback: 2 processes x 4 CPU devices == 1 process x 8 devices.

Each process reads and tokenizes only the rows of every global batch that its devices hold
(the streamed input, `jaxsim.data.pipeline`, asking `sharding.process_batch_rows`) and feeds
`jax.make_array_from_process_local_data`; CPU collectives go through gloo. Two meshes: data
parallel across the two processes (built as two slices, `mesh_dcn_data=2`), and a tensor axis
of 8 spanning both processes (each process then feeds the whole batch). The runs split the same
sums differently, so they agree up to reordered float32 summation (see sharding_test.py): SGD
keeps that a bound on the parameters too.
"""
import contextlib
import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxsim.formats.checkpoint import Checkpointer
from jaxsim.storage.paths import SENTEVAL_ROOT
from tests.conftest import HANG_GUARD_S, cpu_devices_env

REPO = Path(__file__).resolve().parents[2]
U = 2.0 ** -24
LR, STEPS, TOKENS = 0.1, 3, 16 * 2 * 16  # batch x views x max_len

_SCRIPT = textwrap.dedent('''
    import json, sys
    root, corpus, workdir, coord, nproc, pid, mesh = sys.argv[1:8]
    sys.path.insert(0, root)
    from jaxsim import distributed
    if int(nproc) > 1:
        distributed.initialize(coord, int(nproc), int(pid))
    import jax
    from configs.tiny_unsup_simcse import get_config
    from jaxsim.train.config import TrainConfig, base_config
    from jaxsim.train.loop import train_and_evaluate
    from jaxsim.train.step import configure_jax
    configure_jax()
    assert jax.device_count() == 8 and jax.process_count() == int(nproc)
    fields = {**base_config().to_dict(), **get_config().to_dict(), **json.loads(mesh)}
    fields['model_overrides']['num_hidden_layers'] = 1
    fields.update(train_file=corpus, max_steps=3, batch_size=16, optimizer='sgd',
                  learning_rate=0.1, max_grad_norm=0.0)
    r = train_and_evaluate(TrainConfig.from_dict(fields), workdir, progress=False)
    print('RESULT' + json.dumps({'pid': int(pid), 'steps': r.steps, 'loss': r.final_loss}),
          flush=True)
''')


@contextlib.contextmanager
def reserved_port(low: int = 0):
    """A loopback port held for the coordinator: the socket stays bound (SO_REUSEPORT, never
    listening) until the run ends, so no other program can take the port between choosing it
    and the coordinator's bind; gRPC servers bind with SO_REUSEPORT and share it. `low`: the
    first free port from there (0: any the OS picks)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        for port in ([0] if not low else range(low, 65536)):
            try:
                s.bind(('127.0.0.1', port))
                break
            except OSError:
                continue
        yield s.getsockname()[1]


def _launch(args, devices):
    # Fast compile: every program at XLA -O0 (the tiny config's train step already is), the one-
    # and the two-process runs compiled alike; the sharded init compiled for 2.5 s of a 3-step run.
    env = cpu_devices_env(devices)
    return subprocess.Popen([sys.executable, '-c', _SCRIPT, str(REPO), *map(str, args)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(workdir):
    return [json.loads(x) for x in (workdir / 'metrics.jsonl').read_text().splitlines()]


def _params(workdir):
    with Checkpointer(workdir / 'checkpoints', read_only=True) as ckpt:
        return [np.asarray(x) for x in jax.tree.leaves(ckpt.restore(STEPS).state['params'])]


# The vocabulary (30,522 rows) does not divide over 8: the tensor run replicates it, as allowed.
MESHES = {'data': {'mesh_dcn_data': 2},
          'tensor': {'mesh_data': 1, 'mesh_tensor': 8, 'replicate_indivisible': True},
          # Packed batches: each process packs its own shards, the processes agree on the rows.
          'data_packed': {'mesh_dcn_data': 2, 'pack_length': 32}}
# The one-process run each is compared with.
SINGLE = {'single': {}, 'single_packed': {'pack_length': 32}}
REFERENCE = {'data': 'single', 'tensor': 'single', 'data_packed': 'single_packed'}


def test_two_processes_match_one_process(tmp_path):
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('\n'.join((SENTEVAL_ROOT / 'SNLI' / 's2.dev').read_text().splitlines()[:64]))
    with reserved_port() as port_a, reserved_port() as port_b, reserved_port() as port_c:
        runs = {name: [_launch([corpus, tmp_path / name, 'none', 1, 0, json.dumps(fields)], 8)]
                for name, fields in SINGLE.items()}
        for (name, mesh), port in zip(MESHES.items(), (port_a, port_b, port_c)):
            runs[name] = [_launch([corpus, tmp_path / name, f'127.0.0.1:{port}', 2, pid,
                                   json.dumps(mesh)], 4) for pid in (0, 1)]
        outs = {name: [p.communicate(timeout=HANG_GUARD_S) for p in procs]
                for name, procs in runs.items()}
    for name, procs in runs.items():
        for p, (out, err) in zip(procs, outs[name]):
            assert p.returncode == 0, (name, err[-3000:])
            # The tensor-sharded programs (embedding gather included) compile as sharded.
            assert 'Involuntary full rematerialization' not in err, (name, err[-3000:])
    for name in MESHES:
        single_rows = _rows(tmp_path / REFERENCE[name])
        ps = _params(tmp_path / REFERENCE[name])
        count = sum(p.size for p in ps)
        grad_max = max(r['grad_norm'] for r in single_rows)
        tol = STEPS * (LR * 2 * TOKENS * U * grad_max + 2 * U * max(np.abs(p).max() for p in ps))
        assert single_rows[0]['loss'] != single_rows[-1]['loss']  # it trained
        results = [json.loads(o.split('RESULT')[1].splitlines()[0]) for o, _ in outs[name]]
        assert [r['steps'] for r in results] == [STEPS] * 2, name
        assert results[0]['loss'] == results[1]['loss']  # every process sees the global loss
        multi_rows = _rows(tmp_path / name)
        assert [r['step'] for r in single_rows] == [r['step'] for r in multi_rows] == [1, 2, 3]
        for a, b in zip(single_rows, multi_rows):
            assert abs(a['loss'] - b['loss']) <= 2 * TOKENS * U * abs(a['loss']), (name, a, b)
            # | ||g|| - ||g'|| | <= ||g - g'|| <= sqrt(count) max|g - g'|, and max|g| <= ||g||.
            grad_tol = 2 * TOKENS * U * a['grad_norm'] * np.sqrt(count)
            assert abs(a['grad_norm'] - b['grad_norm']) <= grad_tol, (name, a, b)
        pm = _params(tmp_path / name)
        assert max(float(np.abs(a - b).max()) for a, b in zip(ps, pm)) <= tol, name
        # Only process 0 writes the run record; it names both processes and the mesh.
        run = json.loads((tmp_path / name / 'config.json').read_text())['run']
        assert (run['processes'], run['devices']) == (2, 8)
        assert run['mesh'] == ({'data': 1, 'fsdp': 1, 'tensor': 8} if name == 'tensor'
                               else {'data': 8, 'fsdp': 1, 'tensor': 1})
    # Packing changed the run (its dropout masks), so the comparison above is not vacuous.
    assert _rows(tmp_path / 'single_packed') != _rows(tmp_path / 'single')


@pytest.mark.parametrize('differs', ['corpus', 'config'])
def test_processes_that_see_different_inputs_are_refused_in_one_line(tmp_path, differs):
    lines = (SENTEVAL_ROOT / 'SNLI' / 's2.dev').read_text().splitlines()[:64]
    for pid in (0, 1):
        # Each "host" has its own corpus.txt (read relative to its working folder): the same
        # config, and for 'corpus' a last line that differs on process 1.
        folder = tmp_path / f'host{pid}'
        folder.mkdir()
        changed = differs == 'corpus' and pid == 1
        (folder / 'corpus.txt').write_text('\n'.join(lines[:-1] + [lines[-1] + ' x' * changed]))
    env = dict(cpu_devices_env(4), PYTHONPATH=str(REPO))
    # 'config' starts as under SLURM (--distributed auto reads the job's variables; JAX takes
    # the coordinator port from the job id, in [61440, 65535]); 'corpus' with explicit flags.
    with reserved_port(61440 if differs == 'config' else 0) as port:
        def launch(pid):
            args, extra = ['--coordinator', f'127.0.0.1:{port}', '--num_processes', '2',
                           '--process_id', str(pid)], {}
            if differs == 'config':
                args = ['--distributed', 'auto', f'--config.learning_rate={0.001 * (1 + pid)}']
                extra = dict(SLURM_JOB_ID=str(port - 61440), SLURM_STEP_NODELIST='127.0.0.1',
                             SLURM_NTASKS='2', SLURM_PROCID=str(pid), SLURM_LOCALID=str(pid))
            return subprocess.Popen(
                [sys.executable, str(REPO / 'train.py'), '--config',
                 str(REPO / 'configs' / 'tiny_unsup_simcse.py'), '--workdir',
                 str(tmp_path / 'w'), '--noprogress', '--config.train_file=corpus.txt', *args],
                cwd=tmp_path / f'host{pid}', env={**env, **extra}, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)

        procs = [launch(pid) for pid in (0, 1)]
        outs = [p.communicate(timeout=HANG_GUARD_S) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 1, err[-3000:]
        assert err.strip().splitlines()[-1] == (
            f'error: process 1 of 2 sees a different {differs} than process 0; every process '
            f'must start the same run on the same data'), err[-3000:]
        assert 'Traceback' not in err
    assert not (tmp_path / 'w').exists()  # refused before anything was written
