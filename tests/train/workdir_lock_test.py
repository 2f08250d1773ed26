"""Two runs on one workdir: the second is refused in one line before it writes anything, and
the first keeps every metrics row.

The first run stops itself (SIGSTOP, tests/signal_phases.py) right after its first metrics row,
holding the workdir: the second starts while the first is certainly under way, with no clock
or polling involved."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from jaxsim.cli import train
from tests.conftest import HANG_GUARD_S, write_run_data

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / 'configs' / 'tiny_unsup_simcse.py')


def _snapshot(folder: Path) -> dict:
    """The files a run writes before its first step (the first run keeps writing the others:
    metrics.jsonl, checkpoints/, tb/)."""
    own = ('.lock', 'config.json', 'model.json', 'result.json', 'tokenizer')
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob('*'))
            if p.is_file() and p.relative_to(folder).parts[0] in own}


def test_second_run_on_a_held_workdir_is_refused_and_the_first_loses_nothing(tmp_path, capsys):
    data = write_run_data(tmp_path, 's1.dev', 64, 40)
    workdir = tmp_path / 'run'
    steps = 100_000  # the first run is interrupted long before its end
    args = ['--config', TINY, '--workdir', str(workdir), '--noprogress',
            f'--config.train_file={data / "corpus.txt"}', f'--config.max_steps={steps}',
            '--config.checkpoint_every=5']
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    first = subprocess.Popen([sys.executable, '-c', 'from tests.signal_phases import main; main()',
                              'logged step', 'SIGSTOP', 'train.py', *args], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Read its stderr up to the phase line: it then holds the lock, has logged a step and
        # stops itself there (or ended early: the pipe closes and the assert says why).
        seen = []
        for line in first.stderr:
            seen.append(line)
            if line.strip() == 'PHASE logged step':
                break
        else:
            raise AssertionError(f'the first run logged no step: {"".join(seen)[-3000:]}')
        holder = json.loads((workdir / '.lock').read_text())
        assert holder['pid'] == first.pid
        before = _snapshot(workdir)
        assert train.main(args) == 1
        err = capsys.readouterr().err
        assert err.count('\n') == 1 and err.startswith('error: --workdir ')
        assert f'in use by pid {first.pid} on ' in err
        assert first.poll() is None, 'the first run ended before the second was refused'
        assert _snapshot(workdir) == before  # nothing a refused run could touch has changed
        logged = len((workdir / 'metrics.jsonl').read_text().splitlines())
        first.send_signal(signal.SIGINT)  # delivered when it continues
        first.send_signal(signal.SIGCONT)
        out, err = first.communicate(timeout=HANG_GUARD_S)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, err[-3000:]
    rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    assert len(rows) >= logged
    assert [r['step'] for r in rows] == list(range(1, len(rows) + 1))
    # The lock went with the first run: the same command now resumes it.
    assert (workdir / '.lock').read_text() == ''
    assert train.main(args[:-2] + [f'--config.max_steps={len(rows) + 2}',
                                   '--allow-change=max_steps']) == 0
