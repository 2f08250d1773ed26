"""Named plug points: a registry maps a name to what implements it.

Poolers, objectives, calibrations and flow layers each have one registry, kept in the module
that owns the concept. Code outside jaxsim registers into them with the same decorator the
package uses for its own entries, so a new idea is one decorated definition in one file.
"""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

from jaxsim.errors import JaxsimError

T = TypeVar("T")


class RegistryError(JaxsimError):
    """An unknown name, or a name registered twice."""


class Registry(Generic[T]):
    """A dict of named entries, filled by `register(name)(entry)`.

    Attributes:
      kind: what the entries are (used in error messages, e.g. 'pooler').
      error: the exception class raised for an unknown or doubly registered name (the
        owning module's error, so callers catch one class for everything about the concept).
    """

    def __init__(self, kind: str, error: type[JaxsimError] = RegistryError):
        self.kind = kind
        self.error = error
        self._entries: dict[str, T] = {}

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
            if name in self._entries and not replace:
                raise self.error(f"{self.kind} {name!r} is already registered "
                                 f"(pass replace=True to override it)")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        """The entry for `name`; an unknown name is an error listing the known ones."""
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r}; choose one of "
                             f"{', '.join(sorted(self._entries))}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
