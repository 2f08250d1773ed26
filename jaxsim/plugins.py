"""User code in every command: modules that register objectives, poolers, calibrations or flow
layers, loaded before a command reads its names.

Three sources, loaded in this order, each module once per process:
  - the `jaxsim.plugins` entry-point group of installed distributions;
  - `JAXSIM_PLUGINS`: comma-separated modules;
  - `--import MODULE` (repeatable) on train.py, eval.py and every `python -m jaxsim` command.
A module is a dotted name (importable from sys.path or the current folder) or a path to a
.py file. `jaxsim.cli.cli_io.add_import_flag(parser)` declares `--import` and loads all three
before the parser reads the rest of the command line, so a registered pooler is a valid
`--pooler` choice.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterable, Optional, Sequence

from jaxsim.errors import JaxsimError

ENV_VAR = "JAXSIM_PLUGINS"
ENTRY_POINT_GROUP = "jaxsim.plugins"
FLAG = "--import"

# What has been loaded in this process: module spec (or entry point) -> module.
_loaded: dict[str, ModuleType] = {}


class PluginError(JaxsimError):
    """A user module that cannot be imported, or whose registrations fail."""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def _import_file(path: Path) -> ModuleType:
    name = path.stem
    if not name.isidentifier():
        raise ImportError(f"{path.name}: the file name must be a Python identifier")
    held = sys.modules.get(name)
    if held is not None:
        if Path(getattr(held, "__file__", "") or "").resolve() == path:
            return held
        raise ImportError(f"a module named {name!r} is already imported from "
                          f"{getattr(held, '__file__', None) or 'elsewhere'}; rename the file")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as `import` does: pickling and dataclasses look it up.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _import(spec: str) -> ModuleType:
    if _is_path(spec):
        path = Path(spec).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"no such file {spec}")
        return _import_file(path)
    # `python train.py` puts the script's folder on sys.path, not the current one; a module
    # beside the user's data should import as it does under `python -m jaxsim`.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    return importlib.import_module(spec)


def load_module(spec: str, source: str = FLAG) -> ModuleType:
    """Imports one user module (dotted name or .py path) once; `source` names where it was
    asked for in the error line (`--import`, `JAXSIM_PLUGINS`, `entry point NAME`)."""
    spec = spec.strip()
    if not spec:
        raise PluginError(f"{source}: empty module name")
    key = str(Path(spec).expanduser().resolve()) if _is_path(spec) else spec
    if key not in _loaded:
        try:
            _loaded[key] = _import(spec)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # anything the user's module raises is reported in one line
            raise PluginError(f"{source} {spec}: {_one_line(e)}") from None
    return _loaded[key]


def _entry_points() -> list:
    try:
        return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as e:  # a broken distribution's metadata must not stop every command
        print(f"warning: entry points {ENTRY_POINT_GROUP}: {_one_line(e)}", file=sys.stderr)
        return []


def load_plugins(imports: Sequence[str] = (), *, environ: Optional[dict] = None,
                 entry_points: bool = True) -> list[ModuleType]:
    """Loads the `jaxsim.plugins` entry points, then `JAXSIM_PLUGINS`, then `imports`.

    Returns the modules, in that order. Raises PluginError (one line naming the module and
    what failed: the import, or a registration) on the first that fails.
    """
    modules = []
    if entry_points:
        for ep in _entry_points():
            key = f"entry point {ep.name}={ep.value}"
            if key not in _loaded:
                try:
                    _loaded[key] = ep.load()
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:
                    raise PluginError(f"{ENTRY_POINT_GROUP} entry point {ep.name} ({ep.value}): "
                                      f"{_one_line(e)}") from None
            modules.append(_loaded[key])
    env = os.environ if environ is None else environ
    for spec in env.get(ENV_VAR, "").split(","):
        if spec.strip():
            modules.append(load_module(spec, ENV_VAR))
    modules += [load_module(spec, FLAG) for spec in imports]
    return modules


def imports_in(argv: Iterable[str]) -> list[str]:
    """The `--import` values of a command line (`--import M` and `--import=M`), up to `--`."""
    argv, found = list(argv), []
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == FLAG and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith(FLAG + "="):
            found.append(arg[len(FLAG) + 1:])
    return found
