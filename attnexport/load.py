"""A fixed background load for `bench --load N`: N processes, each keeping one core busy, started by
bench itself and stopped when it ends, so that a shared machine's figures can be measured and
measured again (a deployment rarely has the cores to itself).

Each process is a plain busy loop of the interpreter: all CPU, no memory traffic and no threads of
its own, the same on every run. It checks every few milliseconds that the bench that started it is
still its parent, so that it ends with it even where bench is killed without a chance to stop it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

# The loop each load process runs: a million empty iterations (a few milliseconds) between looks at
# its parent.
LOOP = ("import os\n"
        "parent = os.getppid()\n"
        "while os.getppid() == parent:\n"
        "    for _ in range(1000000):\n"
        "        pass\n")


def describe(processes: int) -> str:
    """The load in words, as bench's lines and its JSON say it."""
    if not processes:
        return "none (a quiet machine)"
    return f"{processes} busy process{'es' if processes > 1 else ''} (one core each), started by bench"


@contextlib.contextmanager
def background(processes: int) -> Iterator[list[subprocess.Popen]]:
    """`processes` busy loops running for the block (none for 0); each is stopped and reaped as it
    ends, also on an error or Ctrl-C."""
    started: list[subprocess.Popen] = []
    try:
        for _ in range(processes):
            started.append(subprocess.Popen([sys.executable, "-c", LOOP], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield started
    finally:
        for p in started:
            with contextlib.suppress(OSError):
                p.kill()
        for p in started:
            p.wait()
