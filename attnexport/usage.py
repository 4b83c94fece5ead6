"""What a command costs the machine: its wall time and its resident memory, the peak and the share of
each phase of its work (a whole model's export: load, trace, rewrite, check, write), and how far a
long piece of work has gone (`counted`: a model's layers, its matrices), for a terminal's bars.

The resident set is read from /proc/self/statm by a thread every 20 ms while a meter runs, and the
kernel's own high-water mark (`ru_maxrss`, which nothing misses) is read at the end: the peak a
meter reports is the larger of the two that fall inside it (the kernel's mark counts only when it was
set while the meter ran, that is, when it is above what the process held before). Elsewhere than on
Linux the sampler reads nothing and only the kernel's mark is reported.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_STATM = Path("/proc/self/statm")
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_INTERVAL = 0.02


def resident() -> int:
    """This process's resident memory now, in bytes (0 where /proc is not there)."""
    return _statm()[0]


def _statm() -> tuple[int, int]:
    """(resident, of it the process's own: not pages of a file, which the kernel can drop and read
    again), in bytes; zeros where /proc is not there."""
    try:
        fields = _STATM.read_text().split()
        return int(fields[1]) * _PAGE, (int(fields[1]) - int(fields[2])) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0, 0


def high_water() -> int:
    """The kernel's high-water mark of this process's resident memory, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def give_back() -> None:
    """Collects Python's garbage and returns the heap's free pages to the system (glibc's
    `malloc_trim`; nothing elsewhere): after a large working set is let go (a GGUF file's
    dequantized tensors, a model), so that the memory is there for what comes next and the
    resident set says what is held."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def available() -> int | None:
    """The memory the machine can still give (MemAvailable), in bytes; None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class Phase:
    """One phase of a metered run: its name, wall seconds, the resident memory when it started,
    its peak and when it ended (bytes)."""

    name: str
    seconds: float = 0.0
    start: int = 0
    peak: int = 0
    end: int = 0
    peak_own: int = 0  # the peak of the resident memory that is not a file's pages

    def to_dict(self) -> dict:
        return {"name": self.name, "seconds": round(self.seconds, 3), "start_bytes": self.start,
                "peak_bytes": self.peak, "end_bytes": self.end, "peak_own_bytes": self.peak_own}


@dataclass
class Meter:
    """A run's wall time and resident memory, phase by phase (`phase(name)`), sampled by a thread.
    Use as a context manager; `to_dict()` is what a command's JSON carries."""

    phases: list[Phase] = field(default_factory=list)
    seconds: float = 0.0
    start: int = 0
    peak: int = 0
    peak_own: int = 0  # of the sampled resident memory, the most that was not a file's pages
    end: int = 0  # the resident memory when it ended
    progress: Callable[[Phase], None] | None = None  # told of each phase as it ends (a terminal's lines)
    _open: list[Phase] = field(default_factory=list)
    _t0: float = 0.0
    _water0: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Meter:
        self._t0 = time.perf_counter()
        self._water0 = high_water()
        self.start = self.peak = resident()
        self.peak_own = _statm()[1]
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="attnexport-meter", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        rss, own = _statm()
        self._seen(rss, own)
        self.end = rss
        water = high_water()
        if water > self._water0:  # the kernel's mark rose while the meter ran: nothing is higher
            self.peak = max(self.peak, water)
        self.seconds = time.perf_counter() - self._t0

    def _sample(self) -> None:
        while not self._stop.wait(_INTERVAL):
            self._seen(*_statm())

    def _seen(self, rss: int, own: int = 0) -> None:
        self.peak = max(self.peak, rss)
        self.peak_own = max(self.peak_own, own)
        for p in list(self._open):
            p.peak = max(p.peak, rss)
            p.peak_own = max(p.peak_own, own)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Meters the block as the phase `name` (a phase within another is listed after it, and
        counts in the outer one's peak too)."""
        rss, own = _statm()
        self._seen(rss, own)  # the run's peak is never below a phase's: its start counts in both
        p = Phase(name, start=rss, peak=rss, peak_own=own)
        self.phases.append(p)
        self._open.append(p)
        t0 = time.perf_counter()
        try:
            yield p
        finally:
            p.seconds = time.perf_counter() - t0
            p.end, own = _statm()
            self._seen(p.end, own)
            self._open.remove(p)
            if self.progress is not None:
                self.progress(p)

    def to_dict(self) -> dict:
        return {"seconds": round(self.seconds, 3), "start_bytes": self.start, "peak_bytes": self.peak,
                "end_bytes": self.end, "peak_own_bytes": self.peak_own, "phases": [p.to_dict() for p in self.phases]}

    def line(self) -> str:
        """One line for a command's notes: wall time, peak resident memory, the phase that set it."""
        top = max(self.phases, key=lambda p: p.peak, default=None)
        where = f", highest in {top.name}" if top is not None and top.peak >= self.peak * 0.98 else ""
        mapped = (f" ({gib(self.peak_own)} of it the process's own, the rest files' pages the kernel can drop)"
                  if self.peak_own and self.peak_own < 0.9 * self.peak else "")
        return f"took {self.seconds:.1f} s, peak resident memory {gib(self.peak)}{where}{mapped}"


# The meter of the run in progress, where one runs: `phase` reports into it from anywhere below.
_ACTIVE: list[Meter] = []


# Where phases are told as they end when a command runs on a terminal (`tell_phases`).
_PROGRESS: list[Callable[[Phase], None]] = []


def tell_phases(progress: Callable[[Phase], None] | None) -> None:
    """Each phase of the metered runs that follow is told to `progress` as it ends (None: not)."""
    _PROGRESS[:] = [progress] if progress is not None else []


def phase_line(p: Phase) -> str:
    return f"  {p.name}: {p.seconds:.1f} s, resident {gib(p.end)} (peak {gib(p.peak)})"


@contextlib.contextmanager
def metered():
    """A Meter for the block, the one `phase` reports into (the outermost one, where they nest)."""
    if _ACTIVE:
        yield _ACTIVE[0]
        return
    with Meter(progress=_PROGRESS[0] if _PROGRESS else None) as m:
        _ACTIVE.append(m)
        try:
            yield m
        finally:
            _ACTIVE.remove(m)


@contextlib.contextmanager
def own_meter():
    """A Meter of its own for the block, the one `phase` reports into in place of the one running
    (a forked child's work, `aside.Aside`, metered apart from its parent's and told to no terminal:
    neither its phases nor its counts, whose listener is the parent's and whose terminal the
    parent's)."""
    before, counts = _ACTIVE[:], _COUNTS[:]
    with Meter() as m:
        _ACTIVE[:] = [m]
        _COUNTS[:] = []
        try:
            yield m
        finally:
            _ACTIVE[:] = before
            _COUNTS[:] = counts


def adopt(child: dict, name: str) -> None:
    """A forked child's meter (`Meter.to_dict`) as one phase `name` of the meter that runs: its wall
    time, and its resident memory (its own, beside the parent's, and the pages it shares with it)."""
    if _ACTIVE:
        p = Phase(name, child["seconds"], child["start_bytes"], child["peak_bytes"], child["end_bytes"],
                  child["peak_own_bytes"])
        _ACTIVE[0].phases.append(p)
        if _ACTIVE[0].progress is not None:
            _ACTIVE[0].progress(p)


@contextlib.contextmanager
def phase(name: str):
    """The block as a phase of the meter that runs (nothing where none does)."""
    if not _ACTIVE:
        yield None
        return
    with _ACTIVE[0].phase(name) as p:
        yield p


@dataclass
class Count:
    """How far one counted piece of work has gone: `done` of its `total` steps (a model's layers, its
    matrices), `ended` once the block that counts them has ended (done or not)."""

    what: str
    total: int
    done: int = 0
    ended: bool = False


# Where counts are told as they move when a command runs on a terminal (`tell_counts`).
_COUNTS: list[Callable[[Count], None]] = []


def tell_counts(show: Callable[[Count], None] | None) -> None:
    """Each counted piece of work that follows (`counted`) is told to `show` when it starts, after
    each of its steps and when it ends (None: not)."""
    _COUNTS[:] = [show] if show is not None else []


@contextlib.contextmanager
def telling(phases: Callable[[Phase], None] | None, counts: Callable[[Count], None] | None):
    """Within the block phases are told to `phases` and counts to `counts` (`tell_phases`,
    `tell_counts`; None: to nobody); after it, to whoever was told before."""
    before = _PROGRESS[:], _COUNTS[:]
    tell_phases(phases)
    tell_counts(counts)
    try:
        yield
    finally:
        _PROGRESS[:], _COUNTS[:] = before


def counts_shown() -> bool:
    """Whether a terminal shows counts now (work that would count at a cost may skip it where not)."""
    return bool(_COUNTS)


@contextlib.contextmanager
def counted(what: str, total: int):
    """Yields `advance(n=1)`, to be called as each of the block's `total` steps ends; where a
    terminal shows counts (`tell_counts`) each is told to it, else it costs a call. A step past the
    total is not counted beyond it (a layer run once more than declared)."""
    show = _COUNTS[0] if _COUNTS else None
    if show is None:
        yield counted_nothing
        return
    count = Count(what, total)
    show(count)

    def advance(n: int = 1) -> None:
        count.done = min(count.done + n, total)
        show(count)
    try:
        yield advance
    finally:
        count.ended = True
        show(count)


def counted_nothing(n: int = 1) -> None:
    """The `advance` of a count nobody is shown."""


def each(items, what: str):
    """The items of the sized `items` in turn, each a step of the count `what` (`counted`) once the
    loop's body for it has run (a `continue` too)."""
    with counted(what, len(items)) as advance:
        for item in items:
            yield item
            advance()


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
