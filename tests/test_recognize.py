"""Attention written by hand is found in the traced program and routed through the core
(attnexport.recognize): each form a module may write it in gives the module's own numbers once
routed, and what is not recognized is named, with its reason, and stops a fused export."""

import math

import onnx
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnexport import recognize
from attnexport.cli import main
from attnexport.export import export_module
from attnexport.models import core

CORE = core.attention._opoverload
B, H, T, D = 2, 4, 6, 8


def _qkv(seed=0, heads=H, kv_heads=H, rank=4):
    g = torch.Generator().manual_seed(seed)
    shape = (B, heads, T, D) if rank == 4 else (B * heads, T, D)
    kv_shape = (B, kv_heads, T, D) if rank == 4 else (B * kv_heads, T, D)
    return (torch.randn(shape, generator=g), torch.randn(kv_shape, generator=g), torch.randn(kv_shape, generator=g))


def _mask():
    m = torch.ones(B, T, dtype=torch.bool)
    m[1, 4:] = False  # the second sequence's last two keys are padding
    return m


class Scores(nn.Module):
    """Attention of (q, k, v[, mask]) written by `fn(q, k, v, mask)`."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, q, k, v, mask):
        return self.fn(q, k, v, mask)


def _added_in_place(q, k, v, m):
    scores = q @ k.transpose(-2, -1)
    scores += (~m[:, None, None, :]).float() * -1e9  # T5's `scores += position_bias_masked`
    return torch.softmax(scores, dim=-1) @ v


def _added_in_place_and_read_before(q, k, v, m):
    scores = q @ k.transpose(-2, -1)
    before = scores.mean(-1, keepdim=True)
    scores += (~m[:, None, None, :]).float() * -1e9
    return torch.softmax(scores, dim=-1) @ v + before


FORMS = {
    "mask added in place": _added_in_place,
    "scale on the scores": lambda q, k, v, m: torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1) @ v,
    "divided by sqrt(d)": lambda q, k, v, m: (q @ k.transpose(-1, -2) / math.sqrt(D)).softmax(-1) @ v,
    "no scale (T5)": lambda q, k, v, m: torch.matmul(
        nn.functional.softmax(torch.matmul(q, k.transpose(3, 2)), dim=-1), v),
    "scale on the queries": lambda q, k, v, m: torch.softmax((q * 0.25) @ k.transpose(-2, -1), dim=-1) @ v,
    "additive mask": lambda q, k, v, m: torch.softmax(
        q @ k.transpose(-2, -1) * 0.3 + (~m[:, None, None, :]).float() * -1e9, dim=-1) @ v,
    "mask added before the scale": lambda q, k, v, m: torch.softmax(
        (q @ k.transpose(-2, -1) + (~m[:, None, None, :]).float() * -30.0) * 0.3, dim=-1) @ v,
    "masked_fill -inf": lambda q, k, v, m: torch.softmax(
        (q @ k.transpose(-2, -1) * 0.3).masked_fill(~m[:, None, None, :], float("-inf")), dim=-1) @ v,
    "masked_fill finfo.min": lambda q, k, v, m: torch.softmax(
        (q @ k.transpose(-2, -1)).masked_fill(~m[:, None, None, :], torch.finfo(torch.float32).min), dim=-1) @ v,
    "where -inf, causal": lambda q, k, v, m: torch.softmax(torch.where(
        torch.ones(T, T, dtype=torch.bool).tril(), q @ k.transpose(-2, -1) * 0.3, float("-inf")), dim=-1) @ v,
    "two masks and a constant": lambda q, k, v, m: torch.softmax(
        q @ k.transpose(-2, -1) * 0.3 + 2.0 + torch.ones(T, T).triu(1) * -1e4
        + (~m[:, None, None, :]).float() * -1e4, dim=-1) @ v,
    "permuted keys, dropout in eval": lambda q, k, v, m: nn.functional.dropout(torch.softmax(
        q @ k.permute(0, 1, 3, 2) * 0.3, dim=-1), 0.1, training=False) @ v,
    "softmax in float32": lambda q, k, v, m: torch.softmax((q @ k.transpose(-2, -1)).float(), dim=-1).type_as(q) @ v,
    "grouped heads by broadcasting": lambda q, k, v, m: torch.softmax(
        q @ k[:, :1].transpose(-2, -1) * 0.3, dim=-1) @ v[:, :1],
    "scale on the keys": lambda q, k, v, m: torch.softmax(q @ (k * 0.3).transpose(-2, -1), dim=-1) @ v,
    "queries divided": lambda q, k, v, m: torch.softmax((q / 4.0) @ k.transpose(-2, -1), dim=-1) @ v,
    "clone and cast": lambda q, k, v, m: torch.softmax(
        (q @ k.transpose(-2, -1) * 0.3).clone().to(torch.float32), dim=-1) @ v,
}


@pytest.mark.parametrize("form", list(FORMS))
def test_each_form_is_routed_and_keeps_the_modules_numbers(form):
    module = Scores(FORMS[form]).eval()
    args = (*_qkv(), _mask())
    program = torch.export.export(module, args)
    found = recognize.route(program)
    assert [f.kind for f in found] == ["hand-written"], found
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count(CORE) == 1
    assert not {torch.ops.aten.softmax.int, torch.ops.aten._softmax.default} & set(ops), ops
    want = module(*args)
    got = program.module()(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alpha", [0.3, 1.0])
def test_rank_3_baddbmm_keeps_its_alpha(alpha):
    """baddbmm(mask, q, k^T, alpha=a) is mask + a * q k^T: a recognizer that dropped the alpha
    would give the module's numbers at alpha 1 only."""
    def fn(q, k, v, m):
        bias = (~m).float().repeat_interleave(H, dim=0)[:, None, :] * -1e9
        return torch.bmm(torch.softmax(torch.baddbmm(bias, q, k.transpose(-2, -1), alpha=alpha), dim=-1), v)
    module = Scores(fn).eval()
    args = (*_qkv(rank=3), _mask())
    program = torch.export.export(module, args)
    assert [f.kind for f in recognize.route(program)] == ["hand-written"]
    torch.testing.assert_close(program.module()(*args), module(*args), rtol=1e-5, atol=1e-6)


def test_rank_4_probabilities_also_returned_become_the_score_output():
    def fn(q, k, v, m):
        probs = torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1)
        return probs @ v, probs
    module = Scores(fn).eval()
    args = (*_qkv(), _mask())
    program = torch.export.export(module, args)
    assert [f.kind for f in recognize.route(program)] == ["hand-written"]
    for w, g in zip(module(*args), program.module()(*args), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_rank_3_with_baddbmm_and_the_weights_returned():
    """nn.MultiheadAttention's own code when it is asked for its weights: (B*H, T, d) tensors,
    baddbmm with the mask, the weights averaged over the heads and returned."""
    def fn(q, k, v, m):
        bias = (~m).float().repeat_interleave(H, dim=0)[:, None, :] * -1e9
        probs = torch.softmax(torch.baddbmm(bias, q * 0.3, k.transpose(-2, -1)), dim=-1)
        return torch.bmm(probs, v), probs.view(B, H, T, T).mean(dim=1)
    module = Scores(fn).eval()
    args = (*_qkv(rank=3), _mask())
    program = torch.export.export(module, args)
    assert [f.kind for f in recognize.route(program)] == ["hand-written"]
    want, got = module(*args), program.module()(*args)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_torchs_sdpa_op_bound_before_the_export_is_routed():
    from torch.nn.functional import scaled_dot_product_attention as bound
    module = Scores(lambda q, k, v, m: bound(q, k, v, attn_mask=m[:, None, None, :], is_causal=False)).eval()
    args = (*_qkv(), _mask())
    program = torch.export.export(module, args)
    assert [f.kind for f in recognize.route(program)] == ["sdpa op"]
    torch.testing.assert_close(program.module()(*args), module(*args), rtol=1e-5, atol=1e-6)


UNRECOGNIZED = {
    "softmax over another axis": (lambda q, k, v, m: torch.softmax(q @ k.transpose(-2, -1), dim=-2) @ v,
                                  "not over the last axis"),
    "scaled by a tensor": (lambda q, k, v, m: torch.softmax(q @ k.transpose(-2, -1) * q.mean(), dim=-1) @ v,
                           "by a tensor"),
    "added in place to scores read elsewhere": (_added_in_place_and_read_before, "read elsewhere"),
    "masked with zeros": (lambda q, k, v, m: torch.softmax(
        (q @ k.transpose(-2, -1)).masked_fill(~m[:, None, None, :], 0.0), dim=-1) @ v, "not -inf"),
}


@pytest.mark.parametrize("form", list(UNRECOGNIZED))
def test_what_is_not_recognized_is_named_and_left_as_it_is(form):
    fn, why = UNRECOGNIZED[form]
    module = Scores(fn).eval()
    args = (*_qkv(), _mask())
    program = torch.export.export(module, args)
    found = recognize.route(program)
    assert len(found) == 1 and not found[0].kind and why in found[0].reason, found
    assert "test_recognize.py:" in found[0].where
    assert CORE not in [n.target for n in program.graph.nodes]
    torch.testing.assert_close(program.module()(*args), module(*args))


def test_a_softmax_that_is_not_attention_is_left_alone():
    """A classifier's softmax (over a product with a parameter) is no attention."""
    head = nn.Sequential(nn.Linear(D, 5), nn.Softmax(dim=-1)).eval()
    program = torch.export.export(head, (torch.randn(B, D),))
    assert recognize.route(program) == []


HAND = """
import torch
from torch import nn

class Unrecognized(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return torch.softmax(q @ k.transpose(-2, -1) * q.mean(), dim=-1) @ v
"""


def test_a_fused_flavor_exits_1_on_attention_it_cannot_fuse_unless_allowed(tmp_path):
    path = tmp_path / "hand.py"
    path.write_text(HAND)
    out = tmp_path / "m.onnx"
    args = ["export", "--module", f"{path}:Unrecognized", "--input", "x:2x5x8", "-o", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and not out.exists(), r.output
    assert "hand.py:12" in r.output and "scales the scores by a tensor" in r.output
    assert "--allow-unfused" in r.output and len(r.output.strip().splitlines()) == 1, r.output
    r = CliRunner().invoke(main, args + ["--allow-unfused"])
    assert r.exit_code == 0 and out.exists(), r.output
    assert "0 attention call(s) routed" in r.output and "not routed (MatMul+Softmax in the graph)" in r.output


def test_the_example_exports_fused():
    """examples/handwritten_attention.py: a padding mask as masked_fill(-inf), fused in the ort
    flavour (the attention flavour's export of hand-written attention is the CLI tests' and the
    fully-masked-row test's)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("handwritten_example", "examples/handwritten_attention.py")
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    module, example = source.example()
    for flavor, op in (("ort", "MultiHeadAttention"),):
        result = export_module(module, example, flavor=flavor)
        assert result.routed == 1 and result.recognized[0].kind == "hand-written"
        assert op in {n.op_type for n in result.model.graph.node}
        assert "Softmax" not in {n.op_type for n in result.model.graph.node}
        onnx.checker.check_model(result.model)


def test_a_fully_masked_row_filled_with_the_lowest_float_is_the_modules_on_onnx_runtime():
    """transformers' eager masks add float32's lowest number: a fully padded sequence then attends
    evenly to every key. ONNX Runtime's Attention kernel takes that number for -inf (zeros); the
    export hands it the next number, so the model gives the module's answer there too."""
    import numpy as np

    from attnexport import runtimes as R
    module = Scores(FORMS["masked_fill finfo.min"]).eval()
    mask = _mask()
    mask[0] = False  # the first sequence is all padding
    args = (*_qkv(), mask)
    result = export_module(module, args, flavor="attention", input_names=["q", "k", "v", "m"])
    got = R.prepare_onnx("ort-cpu", result.model).run({n: t.numpy() for n, t in zip("qkvm", args, strict=True)})
    np.testing.assert_allclose(list(got.values())[0], module(*args).numpy(), rtol=1e-4, atol=1e-5)


def test_the_check_at_other_sizes_takes_a_query_with_no_key_as_the_export_does():
    """A -inf mask that hides every key gives NaN in the module and zeros in the export (the
    operator's semantics): the export's check at other sizes, whose masks take the example's
    most common value (here: hidden), compares under those semantics instead of failing."""
    module = Scores(FORMS["masked_fill -inf"]).eval()
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 0] = True
    result = export_module(module, (*_qkv(), mask), flavor="attention", input_names=["q", "k", "v", "m"])
    assert result.routed == 1 and len(result.checked) == 2


@settings(max_examples=20, deadline=None)
@given(scale_on=st.sampled_from(["scores", "queries", "keys", "none"]), divide=st.booleans(),
       mask=st.sampled_from(["none", "additive", "masked_fill", "where", "two"]), rank3=st.booleans(),
       float32_softmax=st.booleans(), returned=st.booleans(), heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]))
def test_any_combination_of_the_forms_keeps_the_modules_numbers(scale_on, divide, mask, rank3, float32_softmax,
                                                                returned, heads):
    """The forms combined at random: wherever the scale sits, whatever the masks, rank 3 or 4,
    grouped heads by broadcasting or repeated, the probabilities also returned: the routed program gives the
    module's own numbers, and no softmax is left in it."""
    hq, hk = heads
    if rank3 and hk != hq:
        hk = hq  # bmm has no head axis to broadcast

    def fn(q, k, v, m):
        if k.shape[1] not in (1, hq):  # grouped heads repeated as transformers' repeat_kv does
            k, v = (t[:, :, None].expand(B, hk, hq // hk, T, D).reshape(B, hq, T, D) for t in (k, v))
        if rank3:
            q, k, v = (t.reshape(-1, T, D) for t in (q, k, v))
        s = 0.3 if not divide else 1 / 0.3
        op = (lambda t: t / s) if divide else (lambda t: t * s)
        q = op(q) if scale_on == "queries" else q
        k = op(k) if scale_on == "keys" else k
        scores = q @ k.transpose(-2, -1)
        scores = op(scores) if scale_on == "scores" else scores
        hidden = ~m[:, None, None, :] if not rank3 else (~m).repeat_interleave(hq, dim=0)[:, None, :]
        if mask in ("additive", "two"):
            scores = scores + hidden.float() * -1e9
        if mask == "two":
            scores = scores + torch.ones(T, T).triu(1) * -1e4
        if mask == "masked_fill":
            scores = scores.masked_fill(hidden, float("-inf"))
        if mask == "where":
            scores = torch.where(~hidden, scores, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores.float() if float32_softmax else scores, dim=-1).type_as(q)
        out = probs @ v
        return (out, probs.mean(dim=1 if not rank3 else 0)) if returned else out

    module = Scores(fn).eval()
    q, k, v = _qkv(heads=hq, kv_heads=hk)
    args = (q, k, v, _mask())
    program = torch.export.export(module, args)
    found = recognize.route(program)
    assert [f.kind for f in found] == ["hand-written"], found
    ops = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert not {torch.ops.aten.softmax.int, torch.ops.aten._softmax.default} & ops
    want, got = module(*args), program.module()(*args)
    for w, g in zip(*(((x,) if isinstance(x, torch.Tensor) else x) for x in (want, got)), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
