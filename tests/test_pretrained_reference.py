"""A whole model's numerics (`attnexport.pretrained.reference`): the model in float64 everywhere, budgets
derived from torch's own error, padding never compared, caches written by the model. The `[hf]`
extra, on a small random Llama (examples/tiny_lms.py)."""

import json

import numpy as np
import pytest
import torch
from conftest import nudged_output

from attnexport import modules as M
from attnexport.compare import FP32_FACTOR, TOLERANCES
from attnexport.errors import ExportError
from attnexport.pretrained import forms
from attnexport.pretrained import model as hf
from attnexport.pretrained import reference as HR

# --- the positions a check compares, written out -----------------------------------------------------


def test_the_logits_compared_are_the_blocks_own_positions_and_padding_is_not():
    """The mask covers the past and the block; the logits are the block's: its last T columns.
    Sequence 0's first three positions are padding: one in the block, two in the past."""
    mask = np.array([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    feed = {"input_ids": np.zeros((2, 4), np.int64), "attention_mask": mask}
    valid = HR.valid_positions(hf.Layout("concat", 1, 1, 2, 5), feed)
    assert set(valid) == {"logits", "present.0.key", "present.0.value"}
    assert valid["logits"].shape == (2, 4, 1) and valid["logits"][..., 0].tolist() == [[False, True, True, True],
                                                                                         [True, True, True, True]]
    assert valid["present.0.value"].shape == (2, 1, 6, 1)
    assert valid["present.0.value"][:, 0, :, 0].tolist() == mask.astype(bool).tolist()
    none = HR.valid_positions(hf.Layout("none", 1, 1, 2, 5), {"input_ids": np.zeros((2, 6), np.int64),
                                                              "attention_mask": mask})
    assert list(none) == ["logits"] and none["logits"][..., 0].tolist() == mask.astype(bool).tolist()


def test_a_static_buffer_is_compared_up_to_each_sequences_write_position_plus_the_block():
    """Sequence 0 writes positions 2, 3, 4 and sequence 1 positions 5, 6, 7: the window ends at 8
    (the furthest written), and within it each sequence's own positions up to its end. A window
    is never longer than the buffers."""
    layout = hf.Layout("static", 1, 1, 2, 5, max_seq=10)
    feed = {"input_ids": np.zeros((2, 3), np.int64), "write_pos": np.array([2, 5])}
    valid = HR.valid_positions(layout, feed)
    assert valid["logits"].shape == (2, 3, 1) and valid["logits"].all()
    written = valid["present.0.key"][:, 0, :, 0].astype(int).tolist()
    assert written == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]
    buffers = np.arange(2 * 10, dtype=np.float32).reshape(2, 1, 10, 1)
    cut = HR.masked({"present.0.key": buffers}, valid)["present.0.key"]
    assert cut[:, 0, :, 0].tolist() == [[0, 1, 2, 3, 4, 0, 0, 0], [10, 11, 12, 13, 14, 15, 16, 17]]
    full = HR.valid_positions(layout, {"input_ids": np.zeros((2, 3), np.int64), "write_pos": np.array([0, 7])})
    assert full["present.0.value"].shape == (2, 1, 10, 1) and full["present.0.value"][1].all()
    assert full["present.0.value"][0, 0, :, 0].astype(int).tolist() == [1, 1, 1] + [0] * 7


# --- on a small random Llama (the [hf] extra: the tests that need it skip without it) -----------------

NEEDS = "transformers is the [hf] extra: pip install -e '.[dev,hf]'"


@pytest.fixture(scope="module")
def llama(tiny_lm):
    pytest.importorskip("transformers", reason=NEEDS)
    folder = tiny_lm("llama")
    return folder, hf.load(folder)[0]


def test_float64_everywhere_keeps_what_asks_for_float32_in_float64():
    x = torch.ones(3, dtype=torch.float64)
    with HR.float64_everywhere():
        assert x.float().dtype == torch.float64
        assert x.to(torch.float32).dtype == torch.float64
        assert torch.zeros(2, dtype=torch.float32).dtype == torch.float64
        assert torch.tensor(1.5).dtype == torch.float64
        assert torch.arange(3).dtype == torch.int64  # integers stay integers
    assert x.float().dtype == torch.float32 and torch.tensor(1.5).dtype == torch.float32  # restored


def test_an_rms_norm_run_in_float64_everywhere_is_the_float64_formula():
    """transformers' RMS norm casts to float32 on purpose: a plain .double() model rounds there,
    the float64 mode does not."""
    pytest.importorskip("transformers", reason=NEEDS)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    rng = np.random.default_rng(0)
    norm = LlamaRMSNorm(64, eps=1e-6).double()
    norm.weight.data = torch.from_numpy(rng.standard_normal(64))
    x = rng.standard_normal((3, 64)) * 20
    want = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * norm.weight.detach().numpy()
    with torch.no_grad():
        plain = norm(torch.from_numpy(x)).numpy()
        with HR.float64_everywhere():
            exact = norm(torch.from_numpy(x)).numpy()
    assert np.abs(exact - want).max() < 1e-12 * np.abs(want).max()
    assert np.abs(plain - want).max() > 1e-9 * np.abs(want).max()  # single precision somewhere inside


def test_the_budget_is_a_multiple_of_torchs_own_error_never_below_the_policy():
    fp32 = TOLERANCES["fp32"]
    tol = HR.budget(np.array([1.0, 2.0 + 3e-5]), np.array([1.0, 2.0]))
    assert tol.atol == pytest.approx(FP32_FACTOR * 3e-5) and tol.rtol == fp32.rtol
    assert tol.basis.endswith("3e-05 x 4") and "float64" in tol.basis
    small = HR.budget(np.array([1.0 + 1e-8]), np.array([1.0]))
    assert small.atol == fp32.atol and "policy" in small.basis
    user = HR.budget(np.array([1.0 + 3e-5]), np.array([1.0]), rtol=0.0, atol=1e-3)
    assert (user.rtol, user.atol, user.basis) == (0.0, 1e-3, "override")
    broken = HR.budget(np.array([np.nan]), np.array([1.0]))  # nothing to derive from: never an infinite budget
    assert (broken.rtol, broken.atol) == (fp32.rtol, fp32.atol) and "not finite" in broken.basis


def test_padding_is_never_compared_and_everything_else_is(llama):
    _, model = llama
    layout = hf.layout_of(model, "concat")
    reference = HR.Reference(model, layout)
    ids = HR.token_rows(None, layout.vocab, 2, 7, seed=0)
    feed = HR.prefilled_feed(reference, ids, past=3, padded=2)  # sequence 0: two padding positions in its past
    assert feed["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    expected = reference.expect(feed)
    got = reference.run(feed)
    assert all(expected.compare(got, layout.outputs))
    junk = {n: a.copy() for n, a in got.items()}
    junk["present.1.key"][0, :, :2] = 1e6  # the padded positions: not compared
    assert all(expected.compare(junk, layout.outputs))
    junk["present.1.key"][0, :, 2] = 1e6  # the first real one: compared
    bad = [c for c in expected.compare(junk, layout.outputs) if not c]
    assert [c.name for c in bad] == ["present.1.key"] and bad[0].max_abs > 1e5


def test_a_static_buffer_is_compared_over_its_written_window_and_checked_whole_in_shape(llama):
    """The expected buffers hold the written rows only (a check at thousands of positions holds a
    few); the rows past them are what the runtime left there, never compared; a buffer of another
    shape still fails."""
    _, model = llama
    layout = hf.layout_of(model, "static", 64)
    reference = HR.Reference(model, layout)
    ids = HR.token_rows(None, layout.vocab, 2, 9, seed=3)
    feed = HR.prefilled_feed(reference, ids, past=5)  # both sequences write positions 5..8
    expected = reference.expect(feed)
    assert expected.outputs["present.0.key"].shape[2] == 9 and expected.shapes["present.0.key"][2] == 64
    got = reference.run(feed)
    assert all(expected.compare(got, layout.outputs))
    junk = {n: a.copy() for n, a in got.items()}
    junk["present.0.value"][:, :, 9:] = 1e6  # past the written window
    assert all(expected.compare(junk, layout.outputs))
    junk["present.0.value"][1, :, 8] = 1e6  # the last written row
    bad = [c for c in expected.compare(junk, layout.outputs) if not c]
    assert [c.name for c in bad] == ["present.0.value"] and bad[0].max_abs > 1e5
    for cut in (32, 4):  # longer than the window, and shorter
        short = {**got, "present.0.key": got["present.0.key"][:, :, :cut]}
        bad = [c for c in expected.compare(short, layout.outputs) if not c]
        assert [c.name for c in bad] == ["present.0.key"] and "shape" in bad[0].problem


def test_a_missing_or_extra_output_fails(llama):
    _, model = llama
    layout = hf.layout_of(model, "none")
    reference = HR.Reference(model, layout)
    feed = HR.prefilled_feed(reference, HR.token_rows(None, layout.vocab, 1, 4, seed=1), past=0)
    expected = reference.expect(feed)
    assert not expected.compare({}, layout.outputs)[0]
    extra = expected.compare({"logits": reference.run(feed)["logits"], "other": np.zeros(1)}, layout.outputs)
    assert [bool(c) for c in extra] == [True, False]


@pytest.mark.parametrize("form", ["concat", "static"])
def test_a_step_after_caches_the_model_wrote_gives_the_whole_sequences_logits(llama, form):
    """The caches of a checked step are the model's own: the step's logits are those of one forward
    over the prefix and the block together (in float64, where they agree to rounding)."""
    _, model = llama
    layout = hf.layout_of(model, form, 32 if form == "static" else 0)
    reference = HR.Reference(model, layout)
    ids = HR.token_rows(None, layout.vocab, 2, 9, seed=2)
    step = reference.run64(HR.prefilled_feed(reference, ids, past=5))["logits"]
    whole = reference.run64(HR.prefilled_feed(reference, ids, past=0))["logits"][:, 5:]
    assert np.abs(step - whole).max() < 1e-4 * max(1.0, np.abs(whole).max())  # the prefix written in fp32






def test_the_check_before_writing_fails_a_damaged_export_and_passes_the_export(llama):
    """An export whose one norm weight is 0.1% off fails against the model in float64 (each output
    within its budget); the export as made passes."""
    from onnx import numpy_helper

    from attnexport.pretrained import export as hf_export
    folder, model = llama
    result, layout = hf_export.export_hf(hf_export.HFExport(folder, "concat", flavor="attention"))
    cases = hf_export.expectations(HR.Reference(model, layout), None)
    checked = hf_export.check_before_writing(result.model, layout, cases, "llama")
    assert len(checked) == len(forms.FORMS["concat"].export_checks)
    assert all(e["logits"]["max_abs"] < e["logits"]["atol"] + 1e-4 for e in checked)
    record = json.loads({p.key: p.value for p in result.model.metadata_props}["attnexport.params"])
    held = record["model.model.layers.1.input_layernorm.weight"]["initializer"]
    target = next(i for i in result.model.graph.initializer if i.name == held)
    target.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(target) * 1.001, target.name))
    with pytest.raises(ExportError, match="differs from the model in float64"):
        hf_export.check_before_writing(result.model, layout, cases, "llama")


def test_the_check_before_writing_judges_every_output(llama):
    """Each output of the step off alone (the logits, each layer's key and value) fails the check
    before writing, which names that output."""
    import re

    from attnexport.pretrained import export as hf_export
    folder, model = llama
    result, layout = hf_export.export_hf(hf_export.HFExport(folder, "concat", flavor="attention"))
    cases = hf_export.expectations(HR.Reference(model, layout), None)
    assert len(layout.outputs) == 5
    for name in layout.outputs:
        with pytest.raises(ExportError, match=rf"differs from the model in float64 at .*: {re.escape(name)}: FAIL"):
            hf_export.check_before_writing(nudged_output(result.model, name), layout, cases, "llama")


def test_the_float64_run_casts_one_layer_at_a_time_and_gives_what_a_float64_copy_gives(llama):
    """No float64 copy of the model: each module is float64 only while its forward runs (counted
    from inside a layer's forward), its float32 storage is put back as it was, and the outputs are
    those of the model copied whole into float64 (within float64's rounding, never bitwise)."""
    import copy
    _, model = llama
    layout = hf.layout_of(model, "concat")
    reference = HR.Reference(model, layout)
    feed = hf.example_feed(layout, batch=2, block=3, past=2)
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    seen = []

    def count(module, args, out):  # runs before the hook that puts the projection back
        seen.append(sum(p.dtype == torch.float64 for p in model.parameters()))
    handle = model.model.layers[1].mlp.up_proj.register_forward_hook(count)
    try:
        got = reference.run64(feed)
    finally:
        handle.remove()
    assert seen == [1]  # the projection running, alone in float64
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage
    whole = copy.deepcopy(model).double()
    step = hf.step_module(whole, layout)
    args = [torch.from_numpy(v).double() if v.dtype.kind == "f" else torch.from_numpy(v) for v in feed.values()]
    with torch.no_grad(), M.export_semantics(), HR.float64_everywhere():
        want = M.outputs_of(step(*args))
    for name, w in zip(layout.outputs, want, strict=True):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-12, atol=1e-12)


def test_a_large_matrix_computes_in_float64_a_block_of_rows_at_a_time(llama, monkeypatch):
    """Above BLOCK_BYTES (lowered here to a few rows) a Linear and an Embedding are never cast:
    each computes in float64 from blocks of its float32 rows, and the outputs are still those of the
    model copied whole into float64."""
    import copy
    _, model = llama
    monkeypatch.setattr(HR, "BLOCK_BYTES", 4 * 8 * model.config.hidden_size)
    layout = hf.layout_of(model, "concat")
    feed = hf.example_feed(layout, batch=2, block=3, past=2)
    seen = []

    def count(module, args, out):
        seen.append((out.dtype, sum(p.dtype == torch.float64 for p in model.parameters())))
    handles = [model.lm_head.register_forward_hook(count), model.model.embed_tokens.register_forward_hook(count)]
    try:
        got = HR.Reference(model, layout).run64(feed)
    finally:
        for h in handles:
            h.remove()
    assert seen and all(dtype == torch.float64 and held == 0 for dtype, held in seen)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "forward" not in vars(model.lm_head)
    step = hf.step_module(copy.deepcopy(model).double(), layout)
    args = [torch.from_numpy(v).double() if v.dtype.kind == "f" else torch.from_numpy(v) for v in feed.values()]
    with torch.no_grad(), M.export_semantics(), HR.float64_everywhere():
        want = M.outputs_of(step(*args))
    for name, w in zip(layout.outputs, want, strict=True):
        np.testing.assert_allclose(got[name], w.numpy(), rtol=1e-12, atol=1e-12)


def test_a_terminal_is_told_each_decoder_layer_as_the_model_runs_it(llama):
    """`usage.counted` a layer at a time (a terminal's bar while a large model's float64 check runs):
    the float64 run and the run in the export's dtype, each layer once."""
    from attnexport import usage as U
    _, model = llama
    layout = hf.layout_of(model, "concat")
    reference = HR.Reference(model, layout)
    feed = HR.prefilled_feed(reference, HR.token_rows(None, layout.vocab, 1, 4, seed=0), past=2)
    said: list[tuple] = []
    U.tell_counts(lambda c: said.append((c.what, c.done, c.total, c.ended)))
    try:
        reference.expect(feed, layers=True)
    finally:
        U.tell_counts(None)
    n = layout.layers
    for what in ("torch float64, layer", "torch fp32, layer"):
        told = [s for s in said if s[0] == what]
        assert told[0] == (what, 0, n, False) and told[-1] == (what, n, n, True), told
        assert [s[1] for s in told[:n + 1]] == list(range(n + 1))
