"""Host memory of training: the train loop compiles its step once, keeps no copy of the loaded
weights beside the train state, and importing what a train step needs leaves out heavy libraries
it never uses."""
import dataclasses
import gc
import logging
import subprocess
import sys
import weakref

import jax
import numpy as np

from jaxsim.train import build, loop
from jaxsim.train.step import configure_jax
from tests.conftest import tiny_run_config, write_snli_corpus

configure_jax()


def test_the_loop_compiles_its_step_once(tmp_path, caplog):
    corpus = tmp_path / 'corpus.txt'
    write_snli_corpus(corpus, 40)
    cfg = tiny_run_config(corpus, max_steps=3, checkpoint=False)
    jax.config.update('jax_log_compiles', True)
    try:
        with caplog.at_level(logging.WARNING):
            result = loop.train_and_evaluate(cfg, tmp_path / 'run',
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
    real_load_base, real_run = build.load_base, loop._Loop.run

    def load_base(cfg):
        base = real_load_base(cfg)
        weights = jax.tree.map(lambda x: np.asarray(x).view(_Tracked), base.bert_params)
        loaded.extend(weakref.ref(x) for x in jax.tree.leaves(weights))
        return dataclasses.replace(base, bert_params=weights)

    def run(self):  # the state is built, no step has run yet
        gc.collect()
        alive.append(sum(ref() is not None for ref in loaded))
        real_run(self)

    monkeypatch.setattr(build, 'load_base', load_base)
    monkeypatch.setattr(loop._Loop, 'run', run)
    corpus = tmp_path / 'corpus.txt'
    write_snli_corpus(corpus, 40)
    cfg = tiny_run_config(corpus, model=str(folder), random_init=False, model_overrides={},
                          max_steps=2, checkpoint=False)
    result = loop.train_and_evaluate(cfg, tmp_path / 'run', progress=False)
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
            "from jaxsim.formats import hf_folder")
    assert _imported(step, ('orbax', 'tensorstore', 'grain', 'scipy', 'torch')) == []


def test_the_train_loop_does_not_import_torch():
    # tensorboardX would import it (installed here, for the parity tests) to accept its tensors.
    # The loop imports tensorboardX with its first event-file writer, not at start-up.
    writer = ("from jaxsim.train import loop\n"
              "assert 'tensorboardX' not in sys.modules\n"
              "from jaxsim.storage import tb\n"
              "tb.summary_writer_class()")
    assert _imported(writer, ('torch', 'tensorboardX')) == ['tensorboardX']
