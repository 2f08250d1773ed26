"""Progress of long work: a tqdm bar on a terminal, plain periodic lines anywhere else.

A bar redraws itself with carriage returns, which a log file or a pipe keeps as one endless
line; when the stream is not a terminal the same updates become a line every `every_s`
seconds (and one at the end), e.g. `encode: 4096/15437 sent (27%), 12 s`.
"""
from __future__ import annotations

import sys
import time
from typing import IO, Optional

from tqdm import tqdm

# Seconds between two plain progress lines.
PLAIN_EVERY_S = 15.0


class PlainProgress:
    """tqdm's update / set_postfix / close, printed as plain lines at most every `every_s`."""

    def __init__(self, total: Optional[int], desc: str, unit: str, file: IO,
                 every_s: float = PLAIN_EVERY_S, initial: int = 0):
        self.total, self.desc, self.unit, self.file = total, desc, unit, file
        self.every_s, self.n = every_s, initial
        self.start = self.last = time.monotonic()
        self.postfix = ""
        self.closed = False
        self.printed: Optional[int] = None  # the count of the last line printed

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.every_s:
            self._print()

    def _print(self) -> None:
        self.printed, self.last = self.n, time.monotonic()
        done = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        extra = f", {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {done} {self.unit}{share}, {self.last - self.start:.0f} s{extra}",
              file=self.file, flush=True)

    def set_postfix(self, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def close(self) -> None:
        # A final line only for work long enough to have printed, or been worth printing.
        if (not self.closed and self.printed != self.n
                and time.monotonic() - self.start >= self.every_s):
            self._print()
        self.closed = True

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(total: Optional[int], desc: str, unit: str = "it", enable: bool = True,
                 file: Optional[IO] = None, initial: int = 0, leave: bool = True):
    """A tqdm bar when `file` (default stderr) is a terminal, else PlainProgress.

    Args:
      total: the number of units (None: unknown).
      desc: what is being done, e.g. 'encode' or 'MR fold 3/10'.
      enable: False gives a bar that shows nothing.
    """
    file = sys.stderr if file is None else file
    if not enable:
        return tqdm(total=total, disable=True)
    if hasattr(file, "isatty") and file.isatty():
        return tqdm(total=total, desc=desc, unit=unit, file=file, initial=initial,
                    dynamic_ncols=True, leave=leave)
    return PlainProgress(total, desc, unit, file, every_s=PLAIN_EVERY_S, initial=initial)


class CountProgress:
    """A `(done, total)` callback that drives a progress bar, created at the first call (when
    the total becomes known)."""

    def __init__(self, desc: str, unit: str = "it", enable: bool = True):
        self.desc, self.unit, self.enable = desc, unit, enable
        self.bar, self.done = None, 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = progress_bar(total, self.desc, unit=self.unit, enable=self.enable)
        self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
