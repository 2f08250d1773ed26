"""Exact resume: 20 steps straight == 10 steps, SIGKILL, restart, 10 more (params and losses)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
_WORDS = ("cat dog man woman child plays runs sings eats reads a the red big small green "
          "quickly slowly in on park street river house book song").split()

# Runs the tiny unsupervised SimCSE config for 20 steps in WORKDIR. With KILL_AT set, the process
# SIGKILLs itself right after the checkpoint of that step is committed (deterministic crash
# point). At the end it dumps the final params as .npz for comparison.
_TRAIN = """
import os, signal, sys
import numpy as np
import flax.traverse_util
import jax
from jaxsim import checkpoint as ckpt_lib
from jaxsim import train_lib

workdir, train_file, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, os.path.join(os.getcwd(), 'configs'))
import tiny_unsup_simcse
cfg = tiny_unsup_simcse.get_config()
cfg.train_file = train_file
cfg.max_steps = 20
cfg.checkpoint_every = 10
cfg.keep_checkpoints = 3

if kill_at:
    original_save = ckpt_lib.Checkpointer.save
    def save_then_die(self, step, *args, **kwargs):
        started = original_save(self, step, *args, **kwargs)
        if int(step) == kill_at:
            self.wait_until_finished()  # the checkpoint is committed; now crash hard
            os.kill(os.getpid(), signal.SIGKILL)
        return started
    ckpt_lib.Checkpointer.save = save_then_die

result = train_lib.train_and_evaluate(cfg, workdir, progress=False)
with ckpt_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), read_only=True) as ckpt:
    restored = ckpt.restore('latest')
flat = flax.traverse_util.flatten_dict(restored.state['params'], sep='/')
np.savez(os.path.join(workdir, 'final_params.npz'), **{k: np.asarray(v) for k, v in flat.items()})
print('steps', result.steps, 'latest', restored.step, flush=True)
"""


def _start(workdir: Path, train_file: Path, kill_at: int = 0) -> subprocess.Popen:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(_TRAIN), str(workdir),
                             str(train_file), str(kill_at)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _losses(workdir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a step re-logged after the restart must agree."""
    out = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" not in rec:
            continue
        step = int(rec["step"])
        assert step not in out or out[step] == rec["loss"], (step, out[step], rec["loss"])
        out[step] = rec["loss"]
    return out


def test_resume_after_sigkill_is_exact(tmp_path):
    rng = np.random.default_rng(0)
    train_file = tmp_path / "train.txt"
    # 20 steps x batch 16 = 320 sentences: no epoch boundary hides an iterator-position bug.
    train_file.write_text("\n".join(" ".join(rng.choice(_WORDS, rng.integers(3, 12)))
                                    for _ in range(400)) + "\n")

    # The straight run and the run that crashes are independent: run them side by side.
    straight_proc = _start(tmp_path / "straight", train_file)
    crashed_proc = _start(tmp_path / "resumed", train_file, kill_at=10)
    rc, _, err = _finish(straight_proc)
    assert rc == 0, err[-4000:]
    rc, _, err = _finish(crashed_proc)
    assert rc == -9, (rc, err[-4000:])
    assert not (tmp_path / "resumed" / "final_params.npz").exists()
    losses_before = _losses(tmp_path / "resumed")
    assert max(losses_before) == 10, sorted(losses_before)

    rc, out, err = _finish(_start(tmp_path / "resumed", train_file))
    assert rc == 0, err[-4000:]
    assert "steps 20 latest 20" in out, out

    a = np.load(tmp_path / "straight" / "final_params.npz")
    b = np.load(tmp_path / "resumed" / "final_params.npz")
    assert sorted(a.files) == sorted(b.files) and len(a.files) > 10
    worst = max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files)
    print(f"resume: max |straight - resumed| over {len(a.files)} params = {worst:.3g}")
    assert worst <= 1e-7, worst
    la, lb = _losses(tmp_path / "straight"), _losses(tmp_path / "resumed")
    assert sorted(la) == sorted(lb) == list(range(1, 21))
    assert la == lb
    assert la[1] != la[20]  # the run actually trained
