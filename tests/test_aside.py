"""Work run aside in a forked child (`attnexport.aside`): its value or its error handed back, its
end by a signal said, a cancel that ends it, and its meter adopted by the parent's."""

import os
import signal
import time

import numpy as np
import pytest
from conftest import in_time

from attnexport import aside as A
from attnexport import usage as U
from attnexport.errors import ExportError

pytestmark = pytest.mark.skipif(not A.forks(), reason="this platform does not fork")


def test_the_childs_value_comes_back_computed_from_the_memory_it_shares():
    big = np.arange(1 << 20, dtype=np.float64)  # the child reads the parent's memory as it was at the fork
    pid = os.getpid()
    work = A.Aside(lambda: {"sum": big.sum(), "pid": os.getpid(), "rows": big[:3].copy()}, "sums")
    big[:] = 0  # the parent's writes after the fork are its own
    got = work.result()
    assert got["pid"] != pid
    assert got["sum"] == (1 << 20) * ((1 << 20) - 1) / 2
    np.testing.assert_array_equal(got["rows"], [0.0, 1.0, 2.0])


def test_an_error_in_the_child_is_raised_in_the_parent():
    def fails():
        raise ValueError("the reference failed at layer 3")
    with pytest.raises(ValueError, match="the reference failed at layer 3"):
        A.Aside(fails, "the reference").result()


def test_an_error_that_does_not_pickle_is_said_in_one_line():
    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    def fails():
        raise Unpicklable("held a lock")
    with pytest.raises(ExportError, match="Unpicklable: held a lock"):
        A.Aside(fails, "the reference").result()


def test_a_child_ended_by_a_signal_is_said_so():
    def killed():
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's out-of-memory killer would
    with pytest.raises(ExportError, match="the reference: its process was ended by signal 9"):
        A.Aside(killed, "the reference").result()


def test_cancel_ends_a_child_at_once_and_leaves_no_process():
    work = A.Aside(lambda: time.sleep(60), "a long wait")
    pid = work.pid
    start = time.perf_counter()
    work.cancel()
    assert time.perf_counter() - start < 10
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: no zombie left
    with pytest.raises(ExportError, match="cancelled"):
        work.result()


def test_the_childs_meter_is_a_phase_of_the_parents():
    """Its wall time and its resident memory at its start, peak and end (the child's, not the parent's)."""
    kept = []
    with U.metered() as meter:
        A.Aside(lambda: kept.append(np.ones(1 << 23)) or len(kept), "the reference").result()  # 64 MiB held
    phase = next(p for p in meter.phases if p.name == "the reference (forked)")
    assert phase.seconds > 0 and phase.peak_own > 0 and not kept
    assert phase.end - phase.start > 60 * 2**20 and phase.peak >= phase.end, phase


def test_a_child_ends_with_its_parent():
    """The parent's end (killed, say) ends the child: it does not go on as an orphan."""
    import subprocess
    import sys
    script = ("import os, sys, time\n"
              "from attnexport import aside as A\n"
              "work = A.Aside(lambda: time.sleep(60), 'a long wait')\n"
              "print(work.pid, flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    child = int(done.stdout.split()[0])
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the child {child} outlived its parent")


def test_a_child_runs_torchs_parallel_operators_after_its_parent_ran_them():
    """The parent's OpenMP team (started by its first parallel operator) does not survive the fork; the
    child runs its own operators on one thread, and the parent keeps its threads."""
    pytest.importorskip("torch")
    got = in_time("""
        import torch
        from attnexport import aside as A
        torch.set_num_threads(2)
        x = torch.linspace(-4, 4, 1 << 22)
        here = float(torch.nn.functional.gelu(x).sum())  # the parent's team of two threads, started
        there, threads = A.Aside(lambda: (float(torch.nn.functional.gelu(x).sum()), torch.get_num_threads()),
                                 "gelu").result()
        print(threads, torch.get_num_threads(), abs(there - here) <= 1e-5 * abs(here))
    """)
    assert got.split() == ["1", "2", "True"], got


def test_a_collection_in_the_child_leaves_the_parents_garbage_alone():
    """An ONNX Runtime session the parent let go (in a cycle: only the collector frees it), its thread
    pool's threads asleep on their lock, is not freed by a collection in the child: its destructor would
    wait for threads the fork left behind."""
    got = in_time("""
        import gc, time
        import numpy as np
        import onnxruntime as ort
        from onnx import TensorProto, helper
        from attnexport import aside as A
        info = helper.make_tensor_value_info
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [info("x", TensorProto.FLOAT, [None])],
                                  [info("y", TensorProto.FLOAT, [None])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        class Holder:
            pass
        held = Holder()
        held.session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        held.cycle = held
        held.session.run(None, {"x": np.ones(1 << 20, np.float32)})
        del held
        gc.disable()
        time.sleep(1)  # the pool's threads from spinning to asleep
        print(A.Aside(gc.collect, "a collection").result() >= 0, gc.collect() > 0)
    """, limit=60)
    assert got.split() == ["True", "True"], got


def test_a_child_stuck_on_a_lock_its_fork_left_held_is_ended_and_said(monkeypatch):
    """A lock held at the fork is held in the child for good: the child sleeps without computing, and
    the wait for it ends after STALL_SECONDS with `Stalled` (the caller does the work itself), leaving
    no process behind."""
    import threading
    monkeypatch.setattr(A, "STALL_SECONDS", 1.0)
    held = threading.Lock()
    held.acquire()
    work = A.Aside(held.acquire, "the reference")
    pid = work.pid
    started = time.monotonic()
    with pytest.raises(A.Stalled, match="the reference: its process computed nothing for 1 s"):
        work.result()
    assert time.monotonic() - started < 30
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    held.release()


def test_a_child_that_computes_is_never_taken_for_stuck(monkeypatch):
    monkeypatch.setattr(A, "STALL_SECONDS", 0.3)
    assert A.Aside(lambda: sum(range(20_000_000)), "a long sum").result() == 20_000_000 * 19_999_999 // 2
