"""A sliding-window layer's ring (`attnexport.models.core.attend_ring`): the slots' positions worked
out by hand, and blocks of every length stepped through a ring equal to attention over the whole
sequence with the window's mask, computed in float64 NumPy (the reference, not the code under test)."""

import numpy as np
import pytest
import torch

from attnexport.models.core import attend_ring, ring_positions
from attnexport.semantics import Core


def test_each_slot_holds_the_newest_position_written_to_it():
    # A ring of 4: position p at slot p % 4. Nothing written (write_pos 0): every slot empty (negative).
    # Positions 0..2 written: slots 0, 1, 2 hold them, slot 3 none. Positions 0..5: 4, 5, 2, 3.
    held = ring_positions(torch.tensor([0, 3, 6]), 4, 0).numpy()
    assert (held[0] < 0).all()
    assert held[1].tolist()[:3] == [0, 1, 2] and held[1, 3] < 0
    assert held[2].tolist() == [4, 5, 2, 3]
    # Once a block of 3 more is written at 6: positions 0..8, the newest at each slot 8, 5, 6, 7.
    assert ring_positions(torch.tensor([6]), 4, 3).numpy().tolist() == [[8, 5, 6, 7]]


def _windowed(q, k, v, window, scale, softcap):
    """(B, Hq, T, d) attention over the whole sequence, each query at t seeing keys t - window + 1 .. t,
    grouped heads repeated, in float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * scale
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    t = np.arange(q.shape[2])
    seen = (t[None, :] <= t[:, None]) & (t[None, :] > t[:, None] - window)
    scores = np.where(seen, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("blocks, softcap", [((1,) * 11, 0.0), ((3, 1, 1, 6, 2, 1), 0.0), ((9, 2, 5), 5.0)])
def test_blocks_through_the_ring_equal_attention_over_the_whole_sequence(blocks, softcap):
    """Blocks shorter and longer than the window (4), wrapping the ring, the ring fed back each step."""
    window, total = 4, sum(blocks)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, total, 8))
    k, v = rng.standard_normal((2, 2, total, 8)), rng.standard_normal((2, 2, total, 8))
    want = _windowed(q, k, v, window, 0.3, softcap)
    ring = (torch.zeros(2, 2, window, 8, dtype=torch.float64), torch.zeros(2, 2, window, 8, dtype=torch.float64))
    start, got = 0, []
    for n in blocks:
        part = [torch.from_numpy(x[:, :, start:start + n]) for x in (q, k, v)]
        out, *ring = attend_ring(*part, tuple(ring), torch.tensor([start, start]), window, Core(0.3, True, softcap))
        got.append(out.numpy())
        start += n
    got = np.concatenate(got, axis=2)
    assert np.abs(got - want).max() < 1e-12
    # The ring holds the last `window` positions' keys, each at its slot.
    for p in range(total - window, total):
        assert np.abs(ring[0][:, :, p % window].numpy() - k[:, :, p]).max() == 0
