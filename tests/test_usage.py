"""usage: a command's wall time and resident memory, phase by phase, as export reports them."""

import time

import numpy as np

from attnexport import usage as U


def test_a_phase_that_holds_memory_shows_it_and_the_meter_reports_its_peak():
    with U.metered() as meter:
        with U.phase("small"):
            pass
        with U.phase("big"):
            held = np.ones(64 << 20, np.uint8)  # 64 MiB, touched
            with U.phase("inner"):
                pass
            del held
    small, big, inner = meter.phases
    assert [p.name for p in meter.phases] == ["small", "big", "inner"]
    assert big.peak - big.start >= 48 << 20  # sampled or the kernel's mark, never less than what was touched
    assert meter.peak >= big.peak >= inner.peak > 0 and meter.seconds >= big.seconds >= 0
    doc = meter.to_dict()
    assert [p["name"] for p in doc["phases"]] == ["small", "big", "inner"] and doc["peak_bytes"] == meter.peak
    assert meter.line().startswith("took ") and "GiB" in meter.line()


def test_a_phase_outside_a_meter_does_nothing_and_meters_nest_into_the_outer_one():
    with U.phase("alone") as p:
        assert p is None
    with U.metered() as outer, U.metered() as inner, U.phase("x"):
        assert inner is outer
    assert [p.name for p in outer.phases] == ["x"]


def test_what_the_machine_has_is_read():
    assert U.resident() > 0 and U.high_water() >= U.resident() // 2
    assert U.available() is None or U.available() > 0


def test_each_phase_is_told_as_it_ends_where_asked():
    told = []
    U.tell_phases(told.append)
    try:
        with U.metered(), U.phase("trace"), U.phase("inner"):
            pass
    finally:
        U.tell_phases(None)
    assert [p.name for p in told] == ["inner", "trace"]
    assert U.phase_line(told[1]).startswith("  trace: ") and "peak" in U.phase_line(told[1])
    with U.metered() as meter, U.phase("quiet"):
        pass
    assert meter.progress is None


def test_a_files_mapped_pages_count_as_resident_but_not_as_the_processs_own(tmp_path):
    """statm's resident set holds a mapped file's pages, which the kernel can drop and read again;
    the meter reports the peak of the rest (`peak_own`) beside the peak."""
    path = tmp_path / "f"
    path.write_bytes(b"\1" * (64 << 20))
    before = U._statm()
    mapped = np.memmap(path, np.uint8, mode="c")
    assert int(mapped.sum(dtype=np.int64)) == 64 << 20  # every page read
    during = U._statm()
    del mapped
    assert during[0] - before[0] >= 48 << 20 and during[1] - before[1] < 16 << 20
    with U.metered() as meter:
        with U.phase("own"):
            held = np.ones(64 << 20, np.uint8)
            own = U._statm()[1]
            time.sleep(0.3)  # the sampler reads every 20 ms
            del held
    assert meter.peak_own >= meter.phases[0].peak_own >= own - (1 << 20) > 0
    assert meter.to_dict()["peak_own_bytes"] == meter.peak_own
    assert all("peak_own_bytes" in p for p in meter.to_dict()["phases"])


def test_the_runs_peak_is_never_below_a_phases(monkeypatch):
    """A phase's resident memory at its start is its first peak, and the run's too: a phase that
    starts at the run's highest point (between two samples) does not report above the run."""
    readings = [(100, 10), (500, 20), (200, 15)]  # the meter's start, the phase's start, then lower

    def statm():
        return readings.pop(0) if len(readings) > 1 else readings[0]
    monkeypatch.setattr(U, "_statm", statm)
    monkeypatch.setattr(U, "resident", lambda: 100)
    monkeypatch.setattr(U, "high_water", lambda: 0)
    monkeypatch.setattr(U, "_INTERVAL", 3600)  # no sample between the readings above
    with U.Meter() as meter, meter.phase("load") as p:
        pass
    assert p.peak == 500 and meter.peak >= p.peak and meter.peak_own >= p.peak_own == 20


# --- counts: how far a long piece of work has gone, for a terminal's bars ------------------------------

def _told():
    """A listener that keeps what each telling said (the Count is one object, changed as it moves)."""
    said: list[tuple] = []
    return said, lambda c: said.append((c.what, c.done, c.total, c.ended))


def test_a_count_is_told_as_it_starts_after_each_step_and_as_it_ends_never_past_its_total():
    said, show = _told()
    U.tell_counts(show)
    try:
        assert U.counts_shown()
        with U.counted("layer", 2) as advance:
            advance()
            advance()
            advance()  # one run more than declared: held at the total
    finally:
        U.tell_counts(None)
    assert said == [("layer", 0, 2, False), ("layer", 1, 2, False), ("layer", 2, 2, False), ("layer", 2, 2, False),
                    ("layer", 2, 2, True)]
    assert not U.counts_shown()
    with U.counted("nobody", 3) as advance:  # no terminal: nothing told, advance costs a call
        assert advance is U.counted_nothing
        advance()


def test_each_counts_a_loops_items_a_continue_too_and_ends_when_the_loop_leaves_early():
    said, show = _told()
    U.tell_counts(show)
    try:
        seen = []
        for item in U.each(["a", "b", "c"], "matrix"):
            if item == "b":
                continue
            seen.append(item)
        for item in U.each([1, 2, 3], "early"):
            if item == 2:
                break
    finally:
        U.tell_counts(None)
    assert seen == ["a", "c"]
    assert [s[1] for s in said if s[0] == "matrix"] == [0, 1, 2, 3, 3] and said[4][3]
    early = [s for s in said if s[0] == "early"]
    assert [s[1] for s in early] == [0, 1, 1] and early[-1][3]  # ended at 1 of 3


def test_a_meter_of_its_own_tells_no_count_and_puts_the_listener_back():
    """A forked child's work (`aside`) runs under its own meter: the listener and its terminal are
    the parent's, so the child tells them nothing."""
    said, show = _told()
    U.tell_counts(show)
    try:
        with U.own_meter(), U.counted("in the child", 2) as advance:
            assert not U.counts_shown()
            advance()
        assert U.counts_shown()
    finally:
        U.tell_counts(None)
    assert said == []
