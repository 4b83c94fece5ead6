"""`bench --load N`'s background load (`attnexport.load`): N busy processes for the block, stopped
as it ends, also when bench dies without stopping them; refused in one line without --hf."""

import os
import subprocess
import sys
import time

from conftest import cli

from attnexport import load


def _state(pid: int) -> str | None:
    """The process's state letter (Z: ended, not yet reaped), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_the_load_runs_for_the_block_and_ends_with_it():
    with load.background(2) as started:
        assert len(started) == 2
        time.sleep(0.3)
        assert all(p.poll() is None for p in started)  # running, each its own process
        assert len({p.pid for p in started}) == 2
    assert all(p.returncode is not None for p in started)
    with load.background(0) as none:
        assert none == []
    assert load.describe(0) == "none (a quiet machine)"
    assert load.describe(3) == "3 busy processes (one core each), started by bench"


def test_a_load_whose_bench_died_ends_by_itself():
    code = ("import os\nfrom attnexport import load\n"
            "started = load.background(1).__enter__()\n"
            "print(started[0].pid, flush=True)\n"
            "os._exit(0)\n")  # no clean-up: as a bench killed outright
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 20
    while _state(pid) not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(pid) in (None, "Z"), f"the load process {pid} outlived its bench"


def test_load_goes_with_a_whole_model():
    r = cli("bench", "--variant", "mha", "--load", "1")
    assert r.exit_code == 2 and "--load goes with --hf" in r.output and len(r.output.strip().splitlines()) == 1
    r = cli("bench", "--variant", "mha", "--load", "-1")
    assert r.exit_code == 2
