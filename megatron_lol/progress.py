"""Progress of long single-process work (``convert-hf``, ``import-hf``, ``analyze``).

On a terminal it is a tqdm bar on stderr, cleared when the work ends (the verb
prints its own summary). Anywhere else (Slurm logs, CI, a pipe) a bar's carriage
returns would be noise, so it is a plain line on stderr every
``MEGATRON_LOL_PROGRESS_INTERVAL`` seconds (default 30), plus a closing line when
at least one was printed. Work shorter than the interval prints nothing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Iterable, Iterator, Optional, TypeVar

INTERVAL_ENV = "MEGATRON_LOL_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 30.0

T = TypeVar("T")


def isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress(
    iterable: Iterable[T],
    *,
    desc: str,
    unit: str = "item",
    total: Optional[int] = None,
    stream=None,
    interval: Optional[float] = None,
) -> Iterator[T]:
    """Yield from ``iterable`` while reporting progress (see the module docstring)."""
    stream = stream if stream is not None else sys.stderr
    if total is None:
        try:
            total = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            total = None
    if isatty(stream):
        from tqdm import tqdm

        yield from tqdm(iterable, total=total, desc=desc, unit=unit, file=stream, leave=False, dynamic_ncols=True)
        return
    if interval is None:
        try:
            interval = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))
        except ValueError:
            interval = DEFAULT_INTERVAL_S
    start = last = time.monotonic()
    done, printed = 0, False
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= interval and (total is None or done < total):
            of = f" of {total} ({100 * done / total:.0f}%)" if total else ""
            print(f"{desc}: {unit} {done}{of}, {now - start:.0f} s", file=stream, flush=True)
            last, printed = now, True
    if printed:
        print(f"{desc}: {unit} {done} of {done} done in {time.monotonic() - start:.0f} s", file=stream, flush=True)
