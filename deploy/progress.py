"""Progress of long lab work (evaluation, benchmarks, training, the load generator), always on stderr.

On a terminal it is a ``tqdm`` bar with an ETA; otherwise (a log file, CI) a plain line at most every
``VLKV_PROGRESS_INTERVAL`` seconds (default 10) and a final line, e.g.::

    eval: 40/200 (20%) elapsed 12s eta 48s
    eval: 200/200 (100%) done in 1m00s

``progress(iterable)`` wraps a loop; ``Progress`` is the manual form (``update(n)``, ``set_postfix``) for
work that is not a plain iterable, such as completions counted by the load generator. Stdout stays for
results (tables, JSON).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from time import monotonic
from typing import TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")
INTERVAL_ENV = "VLKV_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0


def interval_from_env() -> float:
    """Seconds between plain progress lines: ``VLKV_PROGRESS_INTERVAL`` or 10."""
    raw = os.environ.get(INTERVAL_ENV, "")
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{INTERVAL_ENV} must be a number of seconds >= 0, got {raw!r}")
    return value


def format_seconds(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Counts work done out of ``total`` (None: unknown) and reports it on ``stream`` (default stderr)."""

    def __init__(
        self,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        *,
        disable: bool = False,
        stream: TextIO | None = None,
        interval: float | None = None,
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        self.postfix = ""
        self.disabled = disable
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval_from_env() if interval is None else interval
        self.t0 = self._last = monotonic()
        self._closed = False
        tty = not disable and getattr(self.stream, "isatty", lambda: False)()
        self._bar = (
            tqdm(total=total, desc=desc, unit=unit, file=self.stream, dynamic_ncols=True) if tty else None
        )

    def update(self, n: int = 1) -> None:
        """Adds ``n`` units done; ``update(0)`` only gives the report a chance to refresh."""
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif not self.disabled and monotonic() - self._last >= self.interval:
            self._write(self.line())

    def set_postfix(self, text: str) -> None:
        """Extra state shown after the counts, e.g. ``"3 in flight, 0 errors"``."""
        self.postfix = text
        if self._bar is not None:
            self._bar.set_postfix_str(text)

    def line(self, final: bool = False) -> str:
        elapsed = monotonic() - self.t0
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            head += f"{self.n}/{self.total} ({self.n / self.total:.0%})"
        else:
            head += f"{self.n} {self.unit}"
        if final:
            head += f" done in {format_seconds(elapsed)}"
        else:
            head += f" elapsed {format_seconds(elapsed)}"
            if self.total and self.n:
                head += f" eta {format_seconds(elapsed * max(0, self.total - self.n) / self.n)}"
        return head + (f" | {self.postfix}" if self.postfix else "")

    def close(self) -> None:
        """Ends the report: the bar's last state, or the plain final line."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        elif not self.disabled:
            self._write(self.line(final=True))

    def _write(self, text: str) -> None:
        self._last = monotonic()
        print(text, file=self.stream, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(
    iterable: Iterable[T],
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    *,
    disable: bool = False,
    stream: TextIO | None = None,
    interval: float | None = None,
) -> Iterator[T]:
    """Yields from ``iterable`` while reporting progress; ``total`` defaults to ``len(iterable)``."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with Progress(total, desc, unit, disable=disable, stream=stream, interval=interval) as bar:
        for item in iterable:
            yield item
            bar.update()
