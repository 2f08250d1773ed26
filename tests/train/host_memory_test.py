"""Host memory of training: `runtime.release_host_memory` returns freed C-heap pages to the
system, the train loop compiles its step ahead (once), keeps no copy of the loaded weights beside
the train state, and importing what a train step needs leaves out heavy libraries it never uses."""
import ctypes
import ctypes.util
import dataclasses
import gc
import logging
import os
import platform
import subprocess
import sys
import subprocess
import sys
import weakref
from pathlib import Path

import jax
import numpy as np

from configs.tiny_unsup_simcse import get_config
from jaxsim import runtime
from jaxsim.paths import SENTEVAL_ROOT
from jaxsim.train import build, loop
from jaxsim.train.config import TrainConfig, base_config
from jaxsim.train.step import configure_jax

configure_jax()
GLIBC = platform.system() == 'Linux' and platform.libc_ver()[0] == 'glibc'


def _rss_mb() -> float:
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) / 1024.0
    raise AssertionError('no VmRSS in /proc/self/status')


def test_release_host_memory_returns_freed_heap_pages():
    if not GLIBC:  # elsewhere it must say it did nothing
        assert runtime.release_host_memory() is False
        return
    libc = ctypes.CDLL(ctypes.util.find_library('c'))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 120 MB of small blocks (heap, not mmap), touched; the last one stays allocated, so the
    # heap's top cannot shrink on its own: the freed pages stay resident until trimmed.
    blocks = [libc.malloc(4000) for _ in range(30_000)]
    for b in blocks:
        ctypes.memset(b, 1, 4000)
    for b in blocks[:-1]:
        libc.free(b)
    before = _rss_mb()
    assert runtime.release_host_memory() is True
    after = _rss_mb()
    libc.free(blocks[-1])
    assert before - after > 60, (before, after)


def test_the_loop_compiles_its_step_once(tmp_path, caplog):
    lines = (SENTEVAL_ROOT / 'SNLI' / 's1.dev').read_text().splitlines()[:40]
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('\n'.join(lines) + '\n')
    fields = {**base_config().to_dict(), **get_config().to_dict(), 'train_file': str(corpus),
              'max_steps': 3, 'checkpoint': False}
    jax.config.update('jax_log_compiles', True)
    try:
        with caplog.at_level(logging.WARNING):
            result = loop.train_and_evaluate(TrainConfig.from_dict(fields), tmp_path / 'run',
                                             progress=False)
    finally:
        jax.config.update('jax_log_compiles', False)
    assert result.steps == 3
    compiles = [r for r in caplog.records if 'Compiling jit(train_step' in r.getMessage()]
    assert len(compiles) == 1, [r.getMessage()[:120] for r in compiles]


class _Tracked(np.ndarray):
    """A host array that can be weakly referenced (plain ndarrays cannot)."""


def test_no_copy_of_the_loaded_weights_outlives_the_state(tmp_path, tiny_model_dir,
                                                          monkeypatch):
    folder, _ = tiny_model_dir('bert')
    loaded, alive = [], []
    real_load_base, real_compile_ahead = build.load_base, runtime.compile_ahead

    def load_base(cfg):
        base = real_load_base(cfg)
        weights = jax.tree.map(lambda x: np.asarray(x).view(_Tracked), base.bert_params)
        loaded.extend(weakref.ref(x) for x in jax.tree.leaves(weights))
        return dataclasses.replace(base, bert_params=weights)

    def compile_ahead(step, *args):  # just before the first step
        gc.collect()
        alive.append(sum(ref() is not None for ref in loaded))
        real_compile_ahead(step, *args)

    monkeypatch.setattr(build, 'load_base', load_base)
    monkeypatch.setattr(runtime, 'compile_ahead', compile_ahead)
    lines = (SENTEVAL_ROOT / 'SNLI' / 's1.dev').read_text().splitlines()[:40]
    corpus = tmp_path / 'corpus.txt'
    corpus.write_text('\n'.join(lines) + '\n')
    fields = {**base_config().to_dict(), **get_config().to_dict(), 'train_file': str(corpus),
              'model': str(folder), 'random_init': False, 'model_overrides': {},
              'max_steps': 2, 'checkpoint': False}
    result = loop.train_and_evaluate(TrainConfig.from_dict(fields), tmp_path / 'run',
                                     progress=False)
    assert result.steps == 2
    assert len(loaded) > 10 and alive == [0], (len(loaded), alive)


def _imported(statements: str, names: tuple) -> list:
    """Which of the top-level modules `names` a fresh interpreter holds after `statements`."""
    code = (f"import sys\n{statements}\n"
            f"print(sorted(m for m in {names!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return eval(out.stdout.strip().splitlines()[-1])


def test_a_train_step_imports_no_checkpoint_shuffle_or_scipy_library():
    # What building and running a train step imports (benchmarks/train_speed.py's imports).
    step = ("import jaxsim\n"
            "from jaxsim.train import build, optim, state, step\n"
            "from jaxsim.data import batching, readers\n"
            "from jaxsim.io import hf_folder")
    assert _imported(step, ('orbax', 'tensorstore', 'grain', 'scipy', 'torch')) == []


def test_the_train_loop_does_not_import_torch():
    # tensorboardX would import it (installed here, for the parity tests) to accept its tensors.
    # The loop imports tensorboardX with its first event-file writer, not at start-up.
    writer = ("from jaxsim.train import loop\n"
              "assert 'tensorboardX' not in sys.modules\n"
              "from jaxsim.io import tb\n"
              "tb.summary_writer_class()")
    assert _imported(writer, ('torch', 'tensorboardX')) == ['tensorboardX']


# Restarts itself with the huge-page heap (unless told not to), then runs a program with
# 128 MB of temporaries five times and prints GLIBC_TUNABLES, how many times this script
# started, and the fewest page faults of a later run (a count, not a time).
_FAULTS_PROBE = """
import os, resource, sys
os.environ['PROBE_STARTS'] = str(int(os.environ.get('PROBE_STARTS', '0')) + 1)
from jaxsim import runtime
if sys.argv[1] == 'restart':
    runtime.restart_with_huge_page_heap()
import jax, jax.numpy as jnp
x = jnp.ones((2048, 8192))
f = jax.jit(lambda x: jnp.sum(jnp.cumsum(x * 2.0, axis=0)))
compiled = f.lower(x).compile()
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    compiled(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(os.environ.get('GLIBC_TUNABLES', '-'), os.environ['PROBE_STARTS'], min(faults[2:]))
"""


def _probe(mode: str, **env) -> tuple[str, int, int]:
    env = {**{k: v for k, v in os.environ.items() if k != 'GLIBC_TUNABLES'}, **env,
           'PYTHONPATH': str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, '-c', _FAULTS_PROBE, mode], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1]), int(out[2])


def _transparent_huge_pages() -> bool:
    path = Path('/sys/kernel/mm/transparent_hugepage/enabled')
    return path.exists() and '[never]' not in path.read_text()


def test_restart_with_huge_page_heap_cuts_the_page_faults_of_a_rerun():
    restarted, plain = _probe('restart'), _probe('plain')
    assert plain[:2] == ('-', 1)
    if not GLIBC:
        assert restarted[:2] == ('-', 1)
        return
    assert restarted[:2] == ('glibc.malloc.hugetlb=1', 2)  # restarted exactly once
    if _transparent_huge_pages() and tuple(map(int, platform.libc_ver()[1].split('.'))) >= (2, 35):
        assert restarted[2] < 0.25 * plain[2], (restarted, plain)
    # A GLIBC_TUNABLES the user set is left alone: no restart.
    assert _probe('restart', GLIBC_TUNABLES='glibc.malloc.check=0')[:2] == (
        'glibc.malloc.check=0', 1)
