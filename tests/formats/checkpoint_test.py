"""jaxsim/formats/checkpoint.py: retention, exact round trip, 8 -> 1 device restore, crash
safety."""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxsim.formats.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointOptions,
    abstract_target,
    restore_or_none,
)
from tests.conftest import HANG_GUARD_S, cpu_devices_env

REPO = Path(__file__).resolve().parents[2]



class TrainState(flax.struct.PyTreeNode):
    """A training state as the train loop saves it: a custom pytree node (restored as the same
    type when the target is given), the parameter tree under 'params'. The subprocess scripts
    below import it from here."""

    step: jax.Array
    params: dict
    opt_state: object
    rng: jax.Array


def _state(seed: int = 0, step: int = 0) -> TrainState:
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"dense": {"kernel": jax.random.normal(k1, (5, 3)), "bias": jnp.zeros((3,))},
              "emb": jax.random.normal(k2, (7,))}
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    # One real update so the optimizer moments are non-zero.
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return TrainState(step=jnp.asarray(step, jnp.int32), params=params, opt_state=opt_state,
                      rng=jax.random.key_data(jax.random.key(seed + 100)))


def _assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_is_exact_and_keeps_data_and_config(tmp_path):
    state = _state(step=7)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.save(7, state, data={"epoch": 1, "index": 640}, config={"lr": 3e-5})
        ckpt.wait_until_finished()
        restored = ckpt.restore(target=abstract_target(jax.eval_shape(lambda: state)))
        params_only = ckpt.restore_params()  # no optimizer state read
    _assert_tree_equal(params_only, state.params)
    assert restored.step == 7
    assert isinstance(restored.state, TrainState)
    _assert_tree_equal(restored.state, state)
    assert restored.data == {"epoch": 1, "index": 640}
    assert restored.config == {"lr": 3e-5}


def test_reading_logs_no_read_only_warning(tmp_path, caplog):
    # orbax warns 'Given directory is read only' at every read-only open, i.e. every load.
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, _state(step=1))
        ckpt.wait_until_finished()
    with caplog.at_level(logging.WARNING):
        with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
            assert ckpt.latest_step() == 1
        logging.getLogger("absl").warning("Given directory is read only=%s", "elsewhere")
    messages = [r.getMessage() for r in caplog.records]
    # Dropped only while the folder opens: the same message later is kept.
    assert messages == ["Given directory is read only=elsewhere"], messages


def test_keeps_last_k_and_best(tmp_path):
    state = _state()
    options = CheckpointOptions(max_to_keep=2, best_metric="dev", best_mode="max")
    with Checkpointer(tmp_path, options) as ckpt:
        for step, dev in [(1, 5.0), (2, 9.0), (3, 1.0), (4, 2.0), (5, 3.0)]:
            ckpt.save(step, state.replace(step=jnp.int32(step)), metrics={"dev": dev})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [2, 4, 5]
        assert ckpt.best_step() == 2
        assert int(ckpt.restore("best").state["step"]) == 2
    # min mode keeps the lowest metric instead.
    with Checkpointer(tmp_path / "min", CheckpointOptions(max_to_keep=1, best_metric="loss",
                                                          best_mode="min")) as ckpt:
        for step, loss in [(1, 3.0), (2, 0.5), (3, 2.0), (4, 4.0)]:
            ckpt.save(step, state, metrics={"loss": loss})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [2, 4]
        assert ckpt.best_step() == 2


@pytest.mark.parametrize("read", ["restore", "restore_params"])
def test_a_checkpoint_a_running_train_removes_while_it_is_read_is_read_again(tmp_path, read):
    """Export / eval of a workdir that is still training: the run's retention (here: keep 1)
    removes the latest checkpoint while a reader reads it. 'latest' is read again as the folder
    now stands (it read as 'corrupt or incomplete'); an explicit step says it was removed."""
    folder = tmp_path / "ckpt"
    with Checkpointer(folder, CheckpointOptions(max_to_keep=1)) as writer:
        writer.save(1, _state(seed=1, step=1))
        writer.wait_until_finished()
        with Checkpointer(folder, read_only=True) as reader:
            real = getattr(reader, f"_{read}")
            races = [1]  # how many reads the run races with

            def racing(step, *args):
                if races[0] and step == writer.latest_step():
                    races[0] -= 1
                    # The run saves the next step; its retention drops this one meanwhile.
                    writer.save(step + 1, _state(seed=step + 1, step=step + 1))
                    writer.wait_until_finished()
                    assert not (folder / str(step)).exists()
                return real(step, *args)

            setattr(reader, f"_{read}", racing)
            got = reader.restore_params() if read == "restore_params" else \
                reader.restore().state["params"]
            _assert_tree_equal(got, _state(seed=2, step=2).params)
            races[0] = 1
            with pytest.raises(CheckpointError, match=(
                    r"/2: removed while it was read \(a run still training here keeps only "
                    r"its newest checkpoints\); read it again, or a step it keeps "
                    r"\(have \[3\]\)")):
                getattr(reader, read)(2)


def test_errors_are_clear(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        Checkpointer(tmp_path / "nope", read_only=True)
    assert restore_or_none(tmp_path / "nope", target=None) is None
    with Checkpointer(tmp_path / "empty") as ckpt:
        with pytest.raises(CheckpointError, match="no complete checkpoint"):
            ckpt.restore()
        ckpt.save(1, _state())
        ckpt.wait_until_finished()
        with pytest.raises(CheckpointError, match="no checkpoint for step 3"):
            ckpt.restore(3)
        with pytest.raises(ValueError, match="metric 'dev' is nan"):
            ckpt.save(2, _state(), metrics={"dev": float("nan")})
        with pytest.raises(TypeError, match="JSON-serializable"):
            ckpt.save(2, _state(), data={"x": object()})
    # A target from another model: the error names the checkpoint and the mismatch.
    with Checkpointer(tmp_path / "other") as ckpt:
        ckpt.save(1, {"w": jnp.ones((4, 3))})
        ckpt.wait_until_finished()
        with pytest.raises(CheckpointError, match=r"other/1: cannot restore.*\(5, 3\)"):
            ckpt.restore(target=abstract_target({"w": jnp.ones((5, 3))}))
    with pytest.raises(ValueError, match="best_mode"):
        CheckpointOptions(best_mode="top")


def _damage(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 8])  # every array in it cut


@pytest.mark.parametrize("victim", ["data", "state/_METADATA", "state/manifest.ocdbt"])
def test_a_damaged_latest_checkpoint_names_its_file_and_the_intact_one(tmp_path, victim):
    """A truncated file in the latest checkpoint: one line naming the file, and the older
    checkpoint that still restores with the move that lets a rerun go on from it."""
    def state(step):  # arrays large enough for a data file of their own
        w = jax.random.normal(jax.random.key(step), (128, 128))
        return TrainState(step=jnp.int32(step), params={"w": w}, opt_state={"mu": w * 2},
                          rng=jax.random.key_data(jax.random.key(step)))

    states = {1: state(1), 2: state(2)}
    folder = tmp_path / "w" / "checkpoints"
    with Checkpointer(folder) as ckpt:
        for step, state in states.items():
            ckpt.save(step, state, data={"index": step})
        ckpt.wait_until_finished()
    if victim == "data":  # the arrays' files of step 2 (orbax writes one or two)
        damaged = [p for p in (folder / "2" / "state").rglob("d/*")
                   if p.stat().st_size > 10_000]
        assert damaged
    else:
        damaged = [folder / "2" / victim]
    for path in damaged:
        _damage(path)
    target = abstract_target(jax.eval_shape(lambda: states[2]))
    aside = tmp_path / "w" / "damaged-step-2"
    with Checkpointer(folder) as ckpt:
        for restore in (lambda: ckpt.restore(target=target), ckpt.restore_params):
            with pytest.raises(CheckpointError) as e:
                restore()
            message = str(e.value)
            assert "\n" not in message and message.startswith(f"{folder / '2'}: cannot ")
            named = message.split("(damaged file: ")[-1].split(")")[0]
            assert Path(named) in damaged, message
            assert message.endswith(
                f"(damaged file: {named}); the checkpoint of step 1 is intact: move the "
                f"damaged one aside (mv {folder / '2'} {aside}) and rerun to go on from the "
                f"checkpoints left"), message
    (folder / "2").rename(aside)
    with Checkpointer(folder) as ckpt:
        restored = ckpt.restore(target=target)
    assert restored.step == 1 and restored.data == {"index": 1}
    _assert_tree_equal(restored.state, states[1])


def test_reads_a_failed_restore_leaves_pending_are_not_reported(monkeypatch):
    """Closing orbax's pending read coroutines after a failed restore re-raises the read
    error into sys.unraisablehook (a TensorStore spec per array, thousands of lines): dropped;
    any other unraisable exception still reaches the hook installed before."""
    import types

    import orbax.checkpoint

    from jaxsim import runtime

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    runtime.ignore_orphaned_loop_callbacks()
    namespace = {}
    exec(compile("async def _read_shard():\n    pass\n", orbax.checkpoint.__file__, "exec"),
         namespace)
    pending = namespace["_read_shard"]()
    try:
        error = Exception("Encountered error while reading array index")
        error.__cause__ = GeneratorExit()
        sys.unraisablehook(types.SimpleNamespace(exc_value=error, object=pending,
                                                 exc_traceback=None))
        assert seen == []
        other = types.SimpleNamespace(exc_value=ValueError("x"), object=pending,
                                      exc_traceback=None)
        sys.unraisablehook(other)
        assert seen == [other]
        # The same read wrapped by asyncio (`ensure_future` of an awaitable): dropped too.
        exec(compile("async def _wrap_awaitable():\n    pass\n", asyncio.tasks.__file__,
                     "exec"), namespace)
        wrapped = namespace["_wrap_awaitable"]()
        try:
            sys.unraisablehook(types.SimpleNamespace(exc_value=error, object=wrapped,
                                                     exc_traceback=None))
            assert seen == [other]
        finally:
            wrapped.close()
    finally:
        pending.close()


def test_a_task_whose_orbax_error_nobody_retrieved_is_not_logged(caplog):
    """asyncio logs a garbage-collected task's unretrieved error with its traceback: dropped
    when the error came from orbax (a failed read's siblings), kept otherwise."""
    import orbax.checkpoint

    from jaxsim import runtime

    runtime.ignore_orphaned_loop_callbacks()
    namespace = {}
    exec(compile("def _read():\n    raise ValueError('OUT_OF_RANGE')\n",
                 orbax.checkpoint.__file__, "exec"), namespace)

    def log_unretrieved(read):
        try:
            read()
        except ValueError as e:
            logging.getLogger("asyncio").error("Task exception was never retrieved",
                                               exc_info=(type(e), e, e.__traceback__))

    def not_orbax():
        raise ValueError("a bug elsewhere")

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        log_unretrieved(namespace["_read"])
        assert caplog.records == []
        log_unretrieved(not_orbax)
        assert [r.getMessage() for r in caplog.records] == ["Task exception was never retrieved"]


def _run(script: str, devices: int, *args: str) -> subprocess.CompletedProcess:
    env = cpu_devices_env(devices)  # the device count must be set before jax starts
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)


_SAVE_8 = """
import sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxsim.formats.checkpoint import Checkpointer
from tests.formats.checkpoint_test import TrainState
assert jax.device_count() == 8, jax.devices()
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ('data', 'tensor'))
w = jax.device_put(jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6),
                   NamedSharding(mesh, P('data', 'tensor')))
b = jax.device_put(jnp.arange(6, dtype=jnp.float32), NamedSharding(mesh, P('tensor')))
assert len(w.sharding.device_set) == 8
state = TrainState(step=jnp.int32(3), params={'w': w, 'b': b}, opt_state={'mu': w * 2},
                   rng=jax.random.key_data(jax.random.key(1)))
with Checkpointer(sys.argv[1]) as ckpt:
    ckpt.save(3, state, data={'index': 30})
print('saved')
"""

_RESTORE_1 = """
import sys, jax, jax.numpy as jnp, numpy as np
from jaxsim.formats.checkpoint import Checkpointer, abstract_target
from tests.formats.checkpoint_test import TrainState
assert jax.device_count() == 1, jax.devices()
like = TrainState(step=jnp.int32(0), params={'w': jnp.zeros((8, 6)), 'b': jnp.zeros(6)},
                  opt_state={'mu': jnp.zeros((8, 6))}, rng=jnp.zeros(2, jnp.uint32))
target = abstract_target(jax.eval_shape(lambda: like),
                         jax.sharding.SingleDeviceSharding(jax.devices()[0]))
with Checkpointer(sys.argv[1], read_only=True) as ckpt:
    r = ckpt.restore(target=target)
expected = np.arange(48, dtype=np.float32).reshape(8, 6)
np.testing.assert_array_equal(np.asarray(r.state.params['w']), expected)
np.testing.assert_array_equal(np.asarray(r.state.opt_state['mu']), expected * 2)
np.testing.assert_array_equal(np.asarray(r.state.params['b']), np.arange(6))
assert int(r.state.step) == 3 and r.data == {'index': 30}
assert r.state.params['w'].sharding.device_set == {jax.devices()[0]}
# Without a target the structure comes from the checkpoint metadata.
with Checkpointer(sys.argv[1], read_only=True) as ckpt:
    r2 = ckpt.restore()
np.testing.assert_array_equal(np.asarray(r2.state['params']['w']), expected)
print('restored')
"""


def test_restore_8_devices_onto_1(tmp_path):
    saved = _run(_SAVE_8, 8, str(tmp_path / "ckpt"))
    assert saved.returncode == 0 and "saved" in saved.stdout, saved.stderr[-3000:]
    restored = _run(_RESTORE_1, 1, str(tmp_path / "ckpt"))
    assert restored.returncode == 0 and "restored" in restored.stdout, restored.stderr[-3000:]


_CRASH = """
import os, signal, sys, jax, jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from jaxsim.formats.checkpoint import Checkpointer
from tests.formats.checkpoint_test import TrainState

def state(v):
    return TrainState(step=jnp.int32(v), params={'w': jnp.full((256, 256), float(v))},
                      opt_state={}, rng=jnp.zeros(2, jnp.uint32))

ckpt = Checkpointer(sys.argv[1])
ckpt.save(1, state(1))
ckpt.wait_until_finished()

async def killed_finalize(self, *args, **kwargs):
    # The arrays of step 2 are on disk in the temp folder, the commit (rename) has not happened.
    os.kill(os.getpid(), signal.SIGKILL)

atomicity.AtomicRenameTemporaryPath.finalize = killed_finalize
ckpt.save(2, state(2))   # async: returns, then the background commit kills the process
print('save returned', flush=True)
ckpt.wait_until_finished()
print('NOT KILLED', flush=True)
"""


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    crashed = _run(_CRASH, 1, str(directory))
    assert crashed.returncode == -9, (crashed.returncode, crashed.stdout, crashed.stderr[-3000:])
    assert "NOT KILLED" not in crashed.stdout
    # The interrupted save left only a temporary folder for step 2.
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith("2.")]
    assert leftovers and all("tmp" in name for name in leftovers), list(directory.iterdir())

    like = TrainState(step=jnp.int32(0), params={"w": jnp.zeros((256, 256))}, opt_state={},
                      rng=jnp.zeros(2, jnp.uint32))
    target = abstract_target(jax.eval_shape(lambda: like))
    with Checkpointer(directory) as ckpt:  # reopening cleans the temp folder
        assert ckpt.all_steps() == [1]
        restored = ckpt.restore(target=target)
        assert int(restored.state.step) == 1
        np.testing.assert_array_equal(np.asarray(restored.state.params["w"]), 1.0)
        # The workdir stays usable: step 2 can be saved again and read back.
        ckpt.save(2, like.replace(step=jnp.int32(2), params={"w": jnp.full((256, 256), 2.0)}))
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [1, 2]
        assert int(ckpt.restore(target=target).state.step) == 2
    assert not [p for p in directory.iterdir() if "tmp" in p.name]
