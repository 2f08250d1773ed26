"""User code in every command: modules that register objectives, poolers, calibrations or flow
layers, loaded before a command reads its names (docs/extending.md): the `jaxsim.plugins`
entry points, then `JAXSIM_PLUGINS`, then `--import MODULE` (declared by
`jaxsim.cli.cli_io.add_import_flag`), each module once per process. A module that fails is one
line naming it and the file and line of the user's code that raised.
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable, Optional, Sequence

from jaxsim.errors import JaxsimError, shown_path, user_line

ENV_VAR = "JAXSIM_PLUGINS"
ENTRY_POINT_GROUP = "jaxsim.plugins"
FLAG = "--import"

# What has been loaded in this process: module spec (or entry point) -> module.
_loaded: dict[str, ModuleType] = {}


class PluginError(JaxsimError):
    """A user module that cannot be imported, or whose registrations fail."""


# What a module spec may be, for the error that refuses another thing.
ACCEPTED = "a .py file, a package folder (holding __init__.py) or a dotted module name"


class _NotAModule(ImportError):
    """A spec naming something that is no module at all: reported without a type name."""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _describe(e: BaseException) -> str:
    """`FILE:LINE: Type: message` for an error raised while importing a user module, FILE:LINE
    being where in the user's code it was raised (a syntax error's own file and line)."""
    if isinstance(e, _NotAModule):
        return str(e)
    if isinstance(e, SyntaxError) and e.filename and e.lineno and Path(e.filename).is_file():
        text = " ".join(str(e.msg).split())
        return f"{shown_path(e.filename)}:{e.lineno}: {type(e).__name__}: {text}"
    # The outermost module body is the module being imported: its file (its package's folder)
    # counts as the user's even when installed (an entry point's distribution).
    bodies = [Path(f.filename) for f in traceback.extract_tb(e.__traceback__)
              if f.name == "<module>" and Path(f.filename).is_file()]
    own = (bodies[0].parent if bodies[0].name == "__init__.py" else bodies[0]) if bodies else None
    where = user_line(e, own)
    return f"{where}: {_one_line(e)}" if where else _one_line(e)


def _is_path(spec: str) -> bool:
    # A file with another suffix (`notes.txt`) is refused as a file, not imported as `notes`.
    return (spec.endswith(".py") or os.sep in spec or "/" in spec
            or (Path(spec).suffix != "" and Path(spec).is_file()))


def _import_file(path: Path, package: Optional[Path] = None) -> ModuleType:
    """Imports a .py file, or with `package` that folder's `path` (its __init__.py)."""
    name, what = (path.stem, "file") if package is None else (package.name, "folder")
    if not name.isidentifier():
        raise ImportError(f"{(package or path).name}: the {what} name must be a Python "
                          "identifier")
    held = sys.modules.get(name)
    if held is not None:
        if Path(getattr(held, "__file__", "") or "").resolve() == path:
            return held
        raise ImportError(f"a module named {name!r} is already imported from "
                          f"{getattr(held, '__file__', None) or 'elsewhere'}; rename the {what}")
    # A package's search path makes its own submodules (`from . import x`) importable.
    spec = importlib.util.spec_from_file_location(
        name, path, submodule_search_locations=None if package is None else [str(package)])
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
        if path.is_dir():
            if not (path / "__init__.py").is_file():
                raise _NotAModule(f"a folder without __init__.py; a module is {ACCEPTED}")
            return _import_file(path / "__init__.py", package=path)
        if not path.is_file():
            raise FileNotFoundError(f"no such file {spec}")
        if path.suffix != ".py":
            raise _NotAModule(f"not a .py file; a module is {ACCEPTED}")
        return _import_file(path)
    if not all(part.isidentifier() for part in spec.split(".")):
        raise _NotAModule(f"not a module name; a module is {ACCEPTED}")
    # `python train.py` puts the script's folder on sys.path, not the current one; a module
    # beside the user's data should import as it does under `python -m jaxsim`.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    return importlib.import_module(spec)


def load_module(spec: str, source: str = FLAG) -> ModuleType:
    """Imports one user module (dotted name, .py path or package folder) once; `source` names
    where it was asked for in the error line (`--import`, `JAXSIM_PLUGINS`, `entry point
    NAME`)."""
    spec = spec.strip()
    if not spec:
        raise PluginError(f"{source}: empty module name")
    key = str(Path(spec).expanduser().resolve()) if _is_path(spec) else spec
    return _load_once(key, functools.partial(_import, spec), f"{source} {spec}")


def _load_once(key: str, load: Callable[[], ModuleType], what: str) -> ModuleType:
    """`load()` the first time `key` is asked for; what it raises is a PluginError naming
    `what`."""
    if key not in _loaded:
        try:
            _loaded[key] = load()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # anything the user's module raises is reported in one line
            raise PluginError(f"{what}: {_describe(e)}") from None
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
        modules += [_load_once(f"entry point {ep.name}={ep.value}", ep.load,
                               f"{ENTRY_POINT_GROUP} entry point {ep.name} ({ep.value})")
                    for ep in _entry_points()]
    env = os.environ if environ is None else environ
    modules += [load_module(spec, ENV_VAR) for spec in env.get(ENV_VAR, "").split(",")
                if spec.strip()]
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
