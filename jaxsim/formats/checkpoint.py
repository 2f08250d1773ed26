"""Training checkpoints: an orbax `CheckpointManager` holding everything an exact resume needs.

Each checkpoint step is one orbax composite with three items, committed atomically together:
  state   `TrainState(step, params, opt_state, rng)` (arrays, `StandardSave`)
  data    the data-iterator position (JSON, e.g. `{"epoch": 1, "index": 640}`)
  config  the full train config (JSON), so a checkpoint is self-describing
plus the orbax metrics JSON (the dev metric) used to keep the best checkpoint.

Retention keeps the last `max_to_keep` steps AND the best `keep_best` by the dev metric.
Saves are asynchronous: `save` returns once arrays are copied off the device, and orbax
writes into a temporary folder that is renamed only when complete, so a process killed
mid-save leaves the previous checkpoint intact (the half-written temp folder is ignored and
removed on the next open).

Restores go into an abstract target (`jax.ShapeDtypeStruct` leaves with shardings), so a
checkpoint written on 8 devices restores onto 1 device or any other mesh.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import jax
import numpy as np

from jaxsim import runtime
from jaxsim.errors import JaxsimError
from jaxsim.storage import store


def _orbax():
    """orbax.checkpoint, imported when a checkpoint is opened: a process that never opens one
    (encode, eval of a model folder) spares tensorstore's memory (docs/performance.md)."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint import checkpoint_managers  # noqa: F401  (ocp.checkpoint_managers)
    return ocp


CHECKPOINT_DIR = "checkpoints"
# Retention options, so a read-only reader ranks "best" by the same metric as the writer.
OPTIONS_FILE = "jaxsim_checkpoint_options.json"


class CheckpointError(JaxsimError):
    """A checkpoint folder that is missing, empty or unreadable; the message names the path."""


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """Retention and saving policy.

    Attributes:
      max_to_keep: number of most recent checkpoints kept.
      best_metric: key of the `metrics` dict passed to `save` that ranks checkpoints
        (e.g. 'stsb_dev_spearman'); None keeps only the most recent ones.
      best_mode: 'max' (higher is better) or 'min'.
      keep_best: number of best-by-metric checkpoints kept in addition to the recent ones.
      async_save: write in a background thread (call `wait_until_finished`/`close`).
    """

    max_to_keep: int = 3
    best_metric: Optional[str] = None
    best_mode: str = "max"
    keep_best: int = 1
    async_save: bool = True

    def __post_init__(self):
        if self.max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {self.max_to_keep}")
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")
        if self.keep_best < 0:
            raise ValueError(f"keep_best must be >= 0, got {self.keep_best}")


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore` returns.

    Attributes:
      step: the checkpoint step restored.
      state: the restored state (same pytree type as the target, or nested dicts without one).
      data: the data-iterator position saved with it (a JSON dict, possibly empty).
      config: the train config saved with it (a JSON dict, possibly empty).
    """

    step: int
    state: Any
    data: dict
    config: dict


def abstract_target(tree: Any, sharding: Any = None) -> Any:
    """Turns a pytree of arrays or ShapeDtypeStructs (`jax.eval_shape`) into a restore target.

    Args:
      tree: pytree whose leaves have `.shape` and `.dtype`.
      sharding: one `jax.sharding.Sharding` for every leaf, a pytree of shardings matching
        `tree`, or None (replicate on all devices of this process).

    Returns:
      The same pytree with `jax.ShapeDtypeStruct(shape, dtype, sharding=...)` leaves.
    """
    if sharding is None:  # replicated on every device
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding)


def _write_options(directory: store.Path, options: CheckpointOptions) -> None:
    path = directory / OPTIONS_FILE
    text = json.dumps(dataclasses.asdict(options), indent=2) + "\n"
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        store.write_atomic(path, text)  # a crash never leaves a truncated file


def _read_options(directory: store.Path) -> Optional[CheckpointOptions]:
    path = directory / OPTIONS_FILE
    if not path.is_file():
        return None
    try:
        return CheckpointOptions(**json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed checkpoint options: {e}") from None


def _cause(error: BaseException, limit: int = 400) -> str:
    """One line naming the root cause of an orbax/tensorstore error.

    orbax wraps tensorstore's message (e.g. 'OUT_OF_RANGE: ... byte range [0, 10695) is not
    valid for value of size 100') in errors whose text is a multi-line TensorStore spec dump;
    the innermost cause's first line is the part that says what is wrong.
    """
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    lines = str(error).strip().splitlines()
    # tensorstore appends its JSON spec to the message: noise for a reader.
    text = (lines[0] if lines else "").split(" [tensorstore_spec=")[0]
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}"


def _read_failed(message: str, error: BaseException) -> CheckpointError:
    """The error for a failed read of a checkpoint (`message` + its root cause).

    orbax leaves the failed read's sibling reads in flight on its private asyncio loop; they
    are garbage-collected at interpreter teardown, after the command has printed its one
    error line, and at teardown the hooks that drop their reports (jaxsim.runtime) may
    already be gone: a chance traceback of up to 200 lines. So the process that saw a read
    fail leaves without teardown (`runtime.exit_process`, after flushing its output)."""
    runtime.leave_hard_at_exit("a failed checkpoint read left orbax's reads in flight")
    return CheckpointError(f"{message}: {_cause(error)}")


def _messages(error: BaseException) -> list[str]:
    out, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        out.append(str(error))
        error = error.__cause__ or error.__context__
    return out


def _damaged_file(folder: store.Path, error: BaseException) -> Optional[str]:
    """The file of a checkpoint folder a failed read tripped on, where it can be told: one
    tensorstore names, a data file of the size it reports (truncated), or a JSON file that no
    longer parses. None for a remote folder or when nothing stands out."""
    if store.is_remote(folder) or not folder.is_dir():
        return None
    files = [p for p in Path(os.fspath(folder)).rglob("*") if p.is_file()]
    for text in _messages(error):
        for named in re.findall(r'local file "([^"]+)"', text):
            if Path(named).is_file():  # e.g. a manifest that fails to decode
                return named
        for size in re.findall(r"is not valid for value of size (\d+)", text):
            same = [p for p in files if p.parent.name == "d" and p.stat().st_size == int(size)]
            if len(same) == 1:
                return str(same[0])
    # The rest orbax writes as JSON (metadata, sharding): a truncated one no longer parses.
    for path in files:
        if path.parent.name == "d" or path.name in ("manifest.ocdbt", "commit_success.txt"):
            continue
        try:
            json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError):
            return str(path)
    return None


def _to_json(obj: Any) -> Any:
    """Round-trips through json so only plain JSON values reach orbax (and fail here if not)."""
    try:
        return json.loads(json.dumps(obj if obj is not None else {}))
    except TypeError as e:
        raise TypeError(f"checkpoint data/config must be JSON-serializable: {e}") from None


class Checkpointer(contextlib.AbstractContextManager):
    """Keeps the last K (+ best) training checkpoints of one run under `directory`.

    Usage:
      ckpt = Checkpointer(workdir / 'checkpoints', CheckpointOptions(best_metric='stsb_dev'))
      ckpt.save(step, state, data={'index': i}, config=cfg, metrics={'stsb_dev': 81.2})
      restored = ckpt.restore(target=abstract_target(jax.eval_shape(init_state)))
      ckpt.close()
    """

    def __init__(self, directory: Union[str, os.PathLike],
                 options: CheckpointOptions = CheckpointOptions(), read_only: bool = False):
        directory = store.as_path(directory, "checkpoint folder")
        # orbax wants absolute local paths; URLs (gs://) are absolute already.
        self.directory = directory if store.is_remote(directory) else store.Path(
            os.path.abspath(directory))
        if read_only and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: no checkpoint folder")
        if read_only and options == CheckpointOptions():
            # A reader (export, eval) ranks 'best' as the writer did.
            options = _read_options(self.directory) or options
        self.options = options
        ocp = _orbax()
        policies = [ocp.checkpoint_managers.LatestN(n=options.max_to_keep)]
        best_fn = None
        if options.best_metric is not None:
            best_fn = lambda m: float(m[options.best_metric])  # noqa: E731
            if options.keep_best:
                # BestN keeps the LAST n after an ascending sort, hence reverse for 'min'.
                policies.append(ocp.checkpoint_managers.BestN(
                    get_metric_fn=best_fn, reverse=options.best_mode == "min",
                    n=options.keep_best, keep_checkpoints_without_metrics=False))
        manager_options = ocp.CheckpointManagerOptions(
            best_fn=best_fn, best_mode=options.best_mode,
            preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
            enable_async_checkpointing=options.async_save,
            # A crash mid-save leaves `<step>.orbax-checkpoint-tmp-*`; remove it on open.
            cleanup_tmp_directories=not read_only, read_only=read_only,
            save_interval_steps=0 if read_only else 1, create=not read_only)
        # Reads of a damaged checkpoint fail on orbax's private asyncio loop; the reads still in
        # flight then report into the closed loop (see jaxsim.runtime). Drop only those reports.
        runtime.ignore_orphaned_loop_callbacks()
        # orbax logs a warning each time a folder is opened read-only, i.e. at every load.
        with runtime.quiet_absl_messages("Given directory is read only"):
            self._manager = ocp.CheckpointManager(self.directory, options=manager_options,
                item_handlers={"state": ocp.StandardCheckpointHandler(),
                               "data": ocp.JsonCheckpointHandler(),
                               "config": ocp.JsonCheckpointHandler()})
        if not read_only and jax.process_index() == 0:
            _write_options(self.directory, options)

    # ------------------------------------------------------------------ queries
    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        return self._manager.latest_step()

    def best_step(self) -> Optional[int]:
        """The best step by `best_metric` (the latest step when no metric is tracked)."""
        return self._manager.best_step()

    def metrics(self, step: int) -> Optional[dict]:
        return self._manager.metrics(step)

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: Any, data: Optional[Mapping] = None,
             config: Optional[Mapping] = None, metrics: Optional[Mapping] = None) -> bool:
        """Starts saving `state` (+ iterator position + config) as checkpoint `step`.

        Args:
          step: the step number (usually `int(state.step)`).
          state: the `TrainState` (or any pytree of arrays).
          data: JSON-serializable data-iterator position.
          config: JSON-serializable train config.
          metrics: e.g. `{'stsb_dev': 81.2}`; must contain `best_metric` for the checkpoint
            to compete for "best".

        Returns:
          Whether a save was started. It completes in the background when `async_save`.
        """
        metrics = None if metrics is None else {k: float(v) for k, v in metrics.items()}
        for k, v in (metrics or {}).items():
            if not np.isfinite(v):
                raise ValueError(f"metric {k!r} is {v} at step {step}; refusing to rank by it")
        ocp = _orbax()
        args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                                  data=ocp.args.JsonSave(_to_json(data)),
                                  config=ocp.args.JsonSave(_to_json(config)))
        return self._manager.save(int(step), args=args, metrics=metrics, force=True)

    def wait_until_finished(self) -> None:
        """Blocks until any background save is committed to disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager's threads."""
        self._manager.close()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ restore
    def resolve_step(self, which: Union[str, int, None]) -> int:
        """'latest' / 'best' / None (= latest) / an int -> an existing step number."""
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"{self.directory}: no complete checkpoint found")
        if which is None or which == "latest":
            return steps[-1]
        if which == "best":
            return self.best_step()
        step = int(which)
        if step not in steps:
            raise CheckpointError(f"{self.directory}: no checkpoint for step {step} (have {steps})")
        return step

    def abstract_state_from_metadata(self, step: int, sharding: Any = None) -> Any:
        """A restore target read from the checkpoint itself (nested dicts of ShapeDtypeStructs).

        Useful when the caller cannot build the state structure (e.g. export), at the cost of
        losing custom pytree types (TrainState, optax states become dicts/lists).
        """
        try:
            meta = self._manager.item_metadata(step)["state"]
        except Exception as e:  # tensorstore/orbax raise bare ValueErrors for missing files
            raise _read_failed(f"{self.directory / str(step)}: cannot read checkpoint "
                               "metadata (corrupt or incomplete)", e) from e
        if meta is None:
            raise CheckpointError(f"{self.directory}/{step}: no 'state' item")
        return abstract_target(getattr(meta, "tree", meta), sharding)

    def restore(self, step: Union[str, int, None] = None, target: Any = None) -> Restored:
        """Restores a checkpoint.

        Args:
          step: 'latest' (default), 'best' or a step number.
          target: abstract state (see `abstract_target`): leaves carry the shardings the arrays
            are restored onto, which may differ from the saving mesh/device count. None reads
            the structure from the checkpoint and places every array on all local devices.

        Returns:
          `Restored(step, state, data, config)`.
        """
        return self._read(step, lambda at: self._restore(at, target))

    # A training run's retention may delete the checkpoint a reader (export, eval) is reading:
    # 'latest' / 'best' are then read again, up to this many times, from the folder as it is.
    _REREADS = 3

    def _read(self, which: Union[str, int, None], read: Callable[[int], Any]) -> Any:
        """`read(step)` of the step `which` names; a damaged checkpoint is reported with what
        to do (`_damaged`), one removed while it was read is read again as it now stands."""
        for rereads in itertools.count():
            step = self.resolve_step(which)
            try:
                return read(step)
            except CheckpointError as e:
                if (self.directory / str(step)).exists():
                    raise self._damaged(step, e, read) from e
                if which not in (None, "latest", "best") or rereads == self._REREADS:
                    raise CheckpointError(
                        f"{self.directory / str(step)}: removed while it was read (a run "
                        f"still training here keeps only its newest checkpoints); read it "
                        f"again, or a step it keeps (have {self._reload()})") from e
                self._reload()

    def _reload(self) -> list[int]:
        """The steps the folder holds now (the manager caches them)."""
        self._manager.reload()
        return self.all_steps()

    def _restore(self, step: int, target: Any) -> Restored:
        if target is None:
            target = self.abstract_state_from_metadata(step)
        ocp = _orbax()
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore(),
                config=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises many types; name the checkpoint, keep the cause
            raise _read_failed(
                f"{self.directory / str(step)}: cannot restore checkpoint (corrupt, or saved "
                "from a different model/optimizer than the target)", e) from e
        return Restored(step=step, state=out["state"], data=dict(out["data"] or {}),
                        config=dict(out["config"] or {}))

    def _damaged(self, step: int, error: CheckpointError, restore) -> CheckpointError:
        """`error` with the file at fault and, when an older checkpoint restores (`restore`),
        how to go on from it."""
        folder = self.directory / str(step)
        text = str(error)
        culprit = _damaged_file(folder, error)
        if culprit:
            text += f" (damaged file: {culprit})"
        for older in reversed([s for s in self.all_steps() if s < step]):
            try:
                restore(older)
            except CheckpointError:
                continue
            aside = self.directory.parent / f"damaged-step-{step}"
            return CheckpointError(
                f"{text}; the checkpoint of step {older} is intact: move the damaged one aside "
                f"(mv {folder} {aside}) and rerun to go on from the checkpoints left")
        return CheckpointError(text)

    def restore_params(self, step: Union[str, int, None] = None, sharding: Any = None) -> Any:
        """Restores only `state.params` (no optimizer state: a third of Adam's memory).

        Args:
          step: 'latest' (default), 'best' or a step number.
          sharding: placement of every array (default: replicated on all local devices).

        Returns:
          The parameter tree as nested dicts of jax.Arrays.
        """
        return self._read(step, lambda at: self._restore_params(at, sharding))

    def _restore_params(self, step: int, sharding: Any) -> Any:
        tree = self.abstract_state_from_metadata(step, sharding)
        if not isinstance(tree, Mapping) or "params" not in tree:
            raise CheckpointError(f"{self.directory / str(step)}: the saved state has no 'params'")
        target = {"params": tree["params"]}
        ocp = _orbax()
        try:
            with ocp.PyTreeCheckpointer() as reader:
                args = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                    restore_args=ocp.checkpoint_utils.construct_restore_args(target))
                out = reader.restore(self.directory / str(step) / "state", args=args)
        except Exception as e:  # name the checkpoint, keep the cause
            raise _read_failed(f"{self.directory / str(step)}: cannot restore params "
                               "(corrupt or incomplete checkpoint)", e) from e
        return out["params"]


def restore_or_none(directory: Union[str, os.PathLike], target: Any,
                    step: Union[str, int, None] = None) -> Optional[Restored]:
    """Restores the latest (or given) checkpoint under `directory`, or None if there is none."""
    directory = store.as_path(directory)
    if not directory.is_dir():
        return None
    with Checkpointer(directory, read_only=True) as ckpt:
        return ckpt.restore(step, target) if ckpt.all_steps() else None
