"""Work run aside: in a forked copy of this process, while the process goes on with its own.

A whole model's export computes the check's float64 reference (thousands of torch operations over
the model's weights) while it traces the model and writes the weights. A thread cannot do that
beside a trace: each operation takes the interpreter's lock between its kernels, and a trace holds
that lock for seconds at a time, so the thread waits up to the switch interval at every operation.
A child forked from the process shares its memory as it was at the fork (a model's weights are not
copied: a mapped file's pages are the same pages, the rest copied only where one side writes), runs
on the machine's other core, and hands its result back pickled through an unnamed temporary file.
The child never runs the parent's exit handlers or writes anything of the parent's: it leaves with
`os._exit`, having written only that file. Where the platform does not fork (`forks()`), callers run
the work themselves.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pickle
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attnexport import usage as U
from attnexport.errors import ExportError

# prctl's option for the signal a process gets when its parent ends (linux/prctl.h).
_PR_SET_PDEATHSIG = 1

# A child asleep this long without a tick of CPU time is stuck (`Stalled`): its work computes, and a
# fork can leave it waiting on a lock that a thread of the parent held, which no thread of its own
# will ever release (`_one_thread` and the frozen collector take away the causes known).
STALL_SECONDS = 15.0


class Stalled(ExportError):
    """The child sat asleep, gaining no CPU time, for STALL_SECONDS while its result was waited for:
    ended; the caller does the work itself."""


def forks() -> bool:
    """Whether work can be run aside here: a platform that forks (Linux; not Windows, and not macOS,
    where a forked child may not use the system's frameworks)."""
    return hasattr(os, "fork") and sys.platform.startswith("linux")


class Aside:
    """`work()` run in a forked child from now; `result()` waits for it and returns its value, or
    raises the error it raised. `name` says what it is in an error and in the parent's phases (the
    child's wall time and own memory: `usage.adopt`). `cancel()` ends it (a caller that fails
    before it needs the result)."""

    def __init__(self, work: Callable[[], Any], name: str):
        self.name = name
        self._out = tempfile.TemporaryFile()
        self.pid: int | None = None
        parent = os.getpid()
        # Every object the parent holds now, frozen for the collector (`gc.freeze`) in the child: none
        # of them is collected there. The parent's garbage that a collection in the child would free
        # includes objects of libraries with threads (an ONNX Runtime session a test or a verify let
        # go): their destructors wait on their threads' locks, which no thread in the child will ever
        # release (a CI run hung there). The parent's own collector takes them back after the fork.
        gc.freeze()
        try:
            with _quiet_fork():
                pid = os.fork()
                if pid == 0:
                    _child(work, self._out, parent)  # never returns
        finally:
            gc.unfreeze()  # the parent's (the child never gets here)
        self.pid = pid

    def result(self) -> Any:
        """Waits for the child; its value (an error it raised, raised here). `Stalled` where it
        stopped computing without ending (it is ended)."""
        status = self._wait(watch=True)
        if status is None:
            raise ExportError(f"{self.name}: cancelled")
        if os.WIFSIGNALED(status):
            raise ExportError(f"{self.name}: its process was ended by signal {os.WTERMSIG(status)} "
                              "(killed for memory?)")
        self._out.seek(0)
        try:
            kind, value, meter = pickle.load(self._out)
        except (EOFError, pickle.UnpicklingError) as e:
            raise ExportError(f"{self.name}: its process gave no result (exit status "
                              f"{os.WEXITSTATUS(status)}: {e})") from None
        finally:
            self._out.close()
        if meter is not None:
            U.adopt(meter, f"{self.name} (forked)")
        if kind == "error":
            raise value
        return value

    def cancel(self) -> None:
        """Ends the child if it still runs (nothing it wrote is read)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._wait()
        self._out.close()

    def _wait(self, watch: bool = False) -> int | None:
        """The child's exit status once it ends (None where it was reaped elsewhere); `watch`: ended
        and `Stalled` raised where it sleeps STALL_SECONDS without gaining CPU time."""
        if self.pid is None:
            return None
        pid, self.pid = self.pid, None
        seen, since = None, time.monotonic()
        while True:
            try:
                if not watch:
                    return os.waitpid(pid, 0)[1]
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    return status
            except InterruptedError:
                continue
            except ChildProcessError:
                return None
            ticks = _asleep_ticks(pid)
            if ticks is None or ticks != seen:
                seen, since = ticks, time.monotonic()
            elif time.monotonic() - since > STALL_SECONDS:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
                self._out.close()
                raise Stalled(f"{self.name}: its process computed nothing for {STALL_SECONDS:.0f} s, asleep "
                              "(a lock its fork left held); ended")
            time.sleep(0.05)


@contextlib.contextmanager
def _quiet_fork():
    """Python 3.12 warns of a fork in a process with threads (the meter's sampler): the child here
    runs only its own thread (`_one_thread`). The tokenizers library warns too where its parallelism
    was used before a fork and is not configured: configured here, in the parent only (the child
    leaves inside the block, with its own setting)."""
    set_here = "TOKENIZERS_PARALLELISM" not in os.environ
    if set_here:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*fork.*")
            yield
    finally:
        if set_here:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


def _child(work: Callable[[], Any], out, parent: int) -> None:
    """The forked child: runs `work` under a meter of its own and writes (kind, value, the meter's
    dict) to `out`; Ctrl-C or a signal ends it at once, writing nothing, and so does its parent's
    end (the kernel's parent-death signal: no orphan goes on computing for nobody)."""
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the parent says what Ctrl-C did
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent ended before the signal was asked for
            return
        _one_thread()
        with U.own_meter() as meter:
            try:
                value: tuple = ("done", work())
            except Exception as e:  # noqa: BLE001 - raised in the parent
                value = ("error", e)
        payload = (*value, meter.to_dict())
        try:
            data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - an error that does not pickle: said in one line
            data = pickle.dumps(("error", ExportError(f"{type(payload[1]).__name__}: {payload[1]} ({e})"), None))
        out.write(data)
        out.flush()
        status = 0
    finally:
        os._exit(status)


def _asleep_ticks(pid: int) -> int | None:
    """The CPU time (clock ticks) of process `pid` where it is asleep; None where it runs, waits on
    the disk, or cannot be read (each counts as progress)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12]) if fields[0] == "S" else None


def _one_thread() -> None:
    """The child's libraries on one thread each. A thread pool the parent started is gone in the
    child (a fork copies only the forking thread) while the library still counts on it: work handed
    to it waits forever. Two such pools are in reach of a whole model's reference: the tokenizers
    library's (any tokenization after the parent used its parallelism) and torch's OpenMP team
    (any parallel operator after the parent ran one). The child runs on the machine's other core
    anyway."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read at each call, over a user's own setting
    torch = sys.modules.get("torch")  # only where the parent imported it: a leaf imports no torch
    if torch is not None:
        torch.set_num_threads(1)
