"""`python -m jaxsim encode` and `eval.py` on 2 processes x 4 CPU devices (jax.distributed on
loopback) give what one process gives: each process feeds its devices' rows of every batch,
the vectors are gathered on all, and only process 0 prints and writes."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.conftest import HANG_GUARD_S, cpu_devices_env, write_run_data
from tests.train.multiprocess_test import reserved_port

REPO = Path(__file__).resolve().parents[1]


def _run(command, devices, launch=()):
    # Fast compile: a tiny model's programs at XLA -O0, the one-process and the two-process
    # runs compiled alike (their cost is nearly all compiling and start-up).
    env = cpu_devices_env(devices)
    return subprocess.Popen([sys.executable, *command, *launch], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


_GLOO = re.compile(r'\[Gloo\] Rank |\d+ is connected to \d+ peer ranks\. Expected number of '
                   r'connected peer ranks is : \d+\n?')


def _without_gloo(text: str) -> str:
    return _GLOO.sub('', text)


def _on_two_processes(command):
    with reserved_port() as port:
        procs = [_run(command(pid), 4, ['--coordinator', f'127.0.0.1:{port}',
                                        '--num_processes', '2', '--process_id', str(pid)])
                 for pid in (0, 1)]
        outs = [p.communicate(timeout=HANG_GUARD_S) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return outs


def test_encode_and_eval_on_two_processes_equal_one(tmp_path, tiny_model_dir):
    model, _ = tiny_model_dir('bert')
    data = write_run_data(tmp_path, 's1.dev', 150, 40)  # corpus.txt: 150 sentences
    # encode: the same --output named on both processes; process 0 alone writes it.
    single = _run(['-m', 'jaxsim', 'encode', '--model', str(model), '--input',
                   str(data / 'corpus.txt'), '--output', str(tmp_path / 'one.npy'),
                   '--batch-size', '16'], 8)
    assert single.wait(HANG_GUARD_S) == 0, single.stderr.read()[-3000:]
    _on_two_processes(lambda pid: ['-m', 'jaxsim', 'encode', '--model', str(model), '--input',
                                   str(data / 'corpus.txt'), '--output',
                                   str(tmp_path / 'two.npy'), '--batch-size', '16'])
    one, two = np.load(tmp_path / 'one.npy'), np.load(tmp_path / 'two.npy')
    assert one.shape == (150, 36)
    np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in tmp_path.glob('*.npy')) == ['one.npy', 'two.npy']

    # eval.py: STS-B (40 pairs) with whitening; one table and one JSON, from process 0.
    def eval_cmd(name):
        return ['eval.py', '--model', str(model), '--data', str(data / 'senteval'), '--tasks',
                'stsb', '--post', 'none', '--post', 'whitening', '--no-diagnostics',
                '--json', str(tmp_path / f'{name}.json')]

    single = _run(eval_cmd('one'), 8)
    out_one, err = single.communicate(timeout=HANG_GUARD_S)
    assert single.returncode == 0, err[-3000:]
    outs = _on_two_processes(lambda pid: eval_cmd('two'))
    # gloo, the CPU collectives library, writes its connection lines to stdout itself, from
    # its own threads: they may land inside a line of ours.
    printed = [[line for line in _without_gloo(out).splitlines() if 'peer ranks' not in line]
               for out, _ in outs]
    assert printed[0] == out_one.splitlines() and not any(x.strip() for x in printed[1])
    scores = [[(r['post'], r['tasks']) for r in json.loads((tmp_path / f'{n}.json').read_text())]
              for n in ('one', 'two')]
    assert scores[0] == scores[1] and len(scores[0]) == 2
