"""What a terminal shows while a whole model is exported or verified (`render.work_in_progress`): each
phase's line as it ends and a bar for each counted piece of work, drawn on a forced terminal here."""

import io

from rich.console import Console

from attnexport import render
from attnexport import usage as U


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=100, color_system=None), out


def test_a_terminal_gets_each_phase_line_and_a_bar_per_count_drawn_as_it_moves():
    console, out = _terminal()
    with render.work_in_progress(console), U.metered():
        with U.phase("trace"):
            pass
        with U.counted("torch float64, layer", 3) as advance:
            for _ in range(3):
                advance()
    drawn = out.getvalue()
    assert "  trace: " in drawn and "resident" in drawn
    assert "torch float64, layer" in drawn
    assert "0/3" in drawn and "3/3" in drawn  # drawn as it starts and as it ends
    assert not U.counts_shown()  # the listeners go with the block
    with U.metered() as meter:
        assert meter.progress is None


def test_a_console_that_is_no_terminal_gets_nothing_and_nothing_listens():
    out = io.StringIO()
    with render.work_in_progress(Console(file=out)), U.metered():
        assert not U.counts_shown()
        with U.phase("trace"), U.counted("layer", 2) as advance:
            advance()
    assert out.getvalue() == ""


def test_the_listeners_go_when_the_work_fails():
    console, _ = _terminal()
    try:
        with render.work_in_progress(console):
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert not U.counts_shown()
    with U.metered() as meter:
        assert meter.progress is None


def test_an_inner_display_gives_the_outer_ones_listeners_back():
    outer, _ = _terminal()
    inner, _ = _terminal()
    with render.work_in_progress(outer):
        with render.work_in_progress(inner):
            assert U.counts_shown()
        assert U.counts_shown()  # the outer display's, not nobody's
    assert not U.counts_shown()


def test_stderr_that_is_no_terminal_draws_nothing_even_where_rich_is_told_to_colour(monkeypatch, capsys):
    """FORCE_COLOR (set in many CI logs) makes rich take a pipe for a terminal: the bars and their
    per-layer hooks are for a terminal itself."""
    monkeypatch.setenv("FORCE_COLOR", "1")
    with render.work_in_progress(), U.metered():
        assert not U.counts_shown()
        with U.phase("trace"):
            pass
    assert capsys.readouterr().err == ""
