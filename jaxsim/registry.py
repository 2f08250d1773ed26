"""Named plug points: a registry maps a name to what implements it.

Poolers, objectives, calibrations and flow layers each have one registry, kept in the module
that owns the concept. Code outside jaxsim registers into them with the same decorator the
package uses for its own entries, so a new idea is one decorated definition in one file.
An entry of the wrong sort (a plain function registered as a calibration) is refused where it
is registered, naming that module and line, rather than failing later where it is used.
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

from jaxsim.errors import JaxsimError

T = TypeVar("T")

# Appended to unknown-name errors: a name from the user's own module is unknown until the
# module is loaded (jaxsim.plugins).
IMPORT_HINT = ("a name registered in your own module needs that module imported first; "
               "commands load it with --import MODULE, $JAXSIM_PLUGINS or a jaxsim.plugins "
               "entry point")


def _registering_site() -> tuple[Optional[str], Optional[int]]:
    """(module, line) whose body is running the registration (the decorated definition's
    module; jaxsim.plugins gives a .py file its stem as name), for error messages."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            return frame.f_globals.get("__name__"), frame.f_lineno
        frame = frame.f_back
    return None, None


def binds(fn: Any, *args, **kwargs) -> bool:
    """Whether `fn(*args, **kwargs)` binds to its signature (True when it has none to read):
    for an owner's check of what its entries will be called with."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def describe(entry: Any) -> str:
    """An entry for a message: 'the class X', 'the function f' or its repr."""
    if inspect.isclass(entry):
        return f"the class {entry.__qualname__}"
    if inspect.isfunction(entry):
        return f"the function {entry.__qualname__}"
    return repr(entry)


# An owner's check of an entry: what is wrong with it (None: nothing).
Check = Callable[[Any], Optional[str]]


class RegistryError(JaxsimError):
    """An unknown name, or a name registered twice."""


class Registry(Generic[T]):
    """A dict of named entries, filled by `register(name)(entry)`.

    Attributes:
      kind: what the entries are (used in error messages, e.g. 'pooler').
      error: the exception class raised for an unknown or doubly registered name (the
        owning module's error, so callers catch one class for everything about the concept).
      check: the owner's check of an entry at registration (only what its use certainly
        needs), or None.
    """

    def __init__(self, kind: str, error: type[JaxsimError] = RegistryError,
                 check: Optional[Check] = None):
        self.kind = kind
        self.error = error
        self.check = check
        self._entries: dict[str, T] = {}
        self._origins: dict[str, Optional[str]] = {}

    def register(self, name: str, *, replace: bool = False) -> Callable[[T], T]:
        """Decorator registering its argument under `name` and returning it unchanged.

        Args:
          name: the name configs and command lines use.
          replace: allow replacing an existing entry (otherwise a second registration of the
            same name is an error, which catches two definitions shadowing each other).
        """
        if not isinstance(name, str) or not name or ":" in name or "," in name:
            raise self.error(f"{self.kind} name must be a non-empty string without ':' or ','"
                             f", got {name!r}")

        def add(entry: T) -> T:
            origin, line = _registering_site()
            problem = self.check(entry) if self.check is not None else None
            if problem is not None:
                where = f"{origin or '?'}, line {line}" if line is not None else origin or "?"
                raise self.error(f"{self.kind} {name!r} (in {where}) {problem}")
            if name in self._entries and not replace:
                raise self.error(f"{self.kind} {name!r} (in {origin or '?'}) is already "
                                 f"registered by {self._origins.get(name) or '?'}; choose "
                                 f"another name (or pass replace=True to override it)")
            self._entries[name] = entry
            self._origins[name] = origin
            return entry

        return add

    def get(self, name: str) -> T:
        """The entry for `name`; an unknown name is an error listing the known ones."""
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r}; choose one of "
                             f"{', '.join(sorted(self._entries))} ({IMPORT_HINT})") from None

    def origin(self, name: str) -> Optional[str]:
        """The module that registered `name` (None when unknown)."""
        return self._origins.get(name)

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
