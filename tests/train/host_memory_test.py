"""The compiler's freed memory goes back before training steps: `runtime.release_host_memory`
returns freed C-heap pages to the system, and the train loop compiles its step ahead (once)."""
import ctypes
import ctypes.util
import logging
import platform
from pathlib import Path

import jax

from configs.tiny_unsup_simcse import get_config
from jaxsim import runtime
from jaxsim.paths import SENTEVAL_ROOT
from jaxsim.train import loop
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
