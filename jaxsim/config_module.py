"""Config files are Python modules defining `get_config()`: train configs and flow configs alike.

One loader runs them, so both kinds report a missing file, a syntax error (with its file and
line: a module the config imports may hold it) or a missing `get_config` the same way, each
through its own error class.
"""
from __future__ import annotations

import importlib.util
import traceback
from pathlib import Path
from typing import Any

from jaxsim.errors import JaxsimError, shown_path


def run_get_config(path: Path, error: type[JaxsimError], what: str, arg: str = '') -> Any:
    """Executes the .py file at `path` and returns `get_config()` (`get_config(arg)` if `arg`).

    A bad file (missing, a syntax error in it or a module it imports, no `get_config`, its code
    failing) raises `error` in one line naming it and the file (`what`: e.g. 'flow config').
    """
    path = Path(path)
    if not path.is_file():
        raise error(f'{path}: no such {what} file')
    module_spec = importlib.util.spec_from_file_location(f'_jaxsim_config_{path.stem}', path)
    if module_spec is None:  # e.g. a YAML file: no loader for its suffix
        raise error(f'{path}: not a Python file; a {what} file is a .py file defining '
                    f'get_config()')
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as e:
        raise error(_syntax_error(path, e)) from None
    except Exception as e:  # the file's own code failed (a typo'd name, a bad import)
        raise error(_failure(path, e)) from None
    get_config = getattr(module, 'get_config', None)
    if get_config is None:
        raise error(f'{path}: defines no get_config()')
    try:
        return get_config(arg) if arg else get_config()
    except Exception as e:
        raise error(_failure(path, e)) from None


def _failure(path: Path, e: Exception) -> str:
    """'path:line: Type: message', the line being the file's deepest one in the traceback."""
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
             if Path(f.filename).resolve() == path.resolve()]
    where = f'{path}:{lines[-1]}' if lines else str(path)
    return f'{where}: {type(e).__name__}: {e}'


def _syntax_error(path: Path, e: SyntaxError) -> str:
    """'path:line: syntax error: msg'; the error's own file:line after the config's name when
    it is in a module the config imports."""
    line = f':{e.lineno}' if e.lineno else ''
    if not e.filename or Path(e.filename).resolve() == path.resolve():
        return f'{path}{line}: syntax error: {e.msg}'
    return f'{path}: {shown_path(e.filename)}{line}: syntax error: {e.msg}'
