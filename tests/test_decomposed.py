"""attnexport.decomposed: a traced program handed to torch.onnx as its decomposition would leave it,
checked against torch's own decomposition (the program traced again) graph for graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import graph_difference

from attnexport import decomposed
from attnexport import export as E
from attnexport import runtimes as R
from attnexport import variants as V

OFF = decomposed.unsupported()  # None where this torch takes the pass (the declared floor's does not)
needs_the_pass = pytest.mark.skipif(OFF is not None, reason=f"attnexport.decomposed is off in this torch: {OFF}")


def _taken(monkeypatch) -> list:
    """What `as_decomposed` gives from here on, a program each (None where torch decomposed it)."""
    taken: list = []
    fast = decomposed.as_decomposed
    monkeypatch.setattr(decomposed, "as_decomposed", lambda program, registry: taken.append(fast(program, registry))
                        or taken[-1])
    return taken


def _retraced(monkeypatch):
    """Every decomposition torch's own from here on (and no program traced before reused)."""
    monkeypatch.setattr(decomposed, "as_decomposed", lambda program, registry: None)
    monkeypatch.setattr(E, "_TRACED", {})


@pytest.mark.parametrize("name", list(V.VARIANTS))
def test_every_variant_comes_out_as_torchs_decomposition_makes_it(name, monkeypatch):
    """Each variant (the attention flavour: its custom op and the rest as torch.onnx translates
    them) exported with the pass and with torch's decomposition: the same ONNX graph."""
    monkeypatch.setattr(E, "_TRACED", {})  # a program another test traced has its decomposition kept
    taken = _taken(monkeypatch)
    fast, _ = E.build_model(name, {}, "attention", use_cache=False)
    assert taken
    if name in ("sdpa", "mha", "decoder") and OFF is None:  # none needs torch's decomposition (posenc does)
        assert all(p is not None for p in taken)
    with monkeypatch.context() as m:
        _retraced(m)
        slow, _ = E.build_model(name, {}, "attention", use_cache=False)
    assert graph_difference(fast, slow) is None, graph_difference(fast, slow)


class _Casts(torch.nn.Module):
    """A few ops torch.export keeps that the decomposition rewrites: casts, a reshape, contiguous,
    detach_, & and |."""

    def forward(self, x, mask):
        y = x.to(torch.float64).transpose(0, 1).contiguous()
        z = y.reshape(y.shape[0], -1).to(torch.float32)  # a reshape of a copy
        keep = ((mask > 0) & (mask < 3)) | (mask == 3)
        w = torch.where(keep.reshape(z.shape), z, torch.zeros_like(z)).to(torch.float32)  # a .to to itself
        v = w * 2
        v.detach_()
        return v + 1


def _program(module, *args):
    return torch.export.export(module, args)


def _both(module, args, names, monkeypatch, fast_way: bool = False):
    """The module's ONNX graph through this pass and through torch's decomposition; `fast_way`: the
    first must have gone through the pass (nothing made it torch's)."""
    with monkeypatch.context() as m:
        taken = _taken(m)
        fast = E.to_onnx(_program(module, *args), args, flavor="attention", opset=18, input_names=names,
                         what="test").model_proto
    assert taken and (not fast_way or all(p is not None for p in taken)), taken
    with monkeypatch.context() as m:
        _retraced(m)
        slow = E.to_onnx(_program(module, *args), args, flavor="attention", opset=18, input_names=names,
                         what="test").model_proto
    return fast, slow


@needs_the_pass
def test_casts_views_and_in_place_detach_are_rewritten_as_the_retrace_does(monkeypatch):
    """The ops the pass rewrites (`decomposed._rewrite`) or keeps with their decomposition's ONNX:
    the program goes the fast way (nothing stops it), its graph is torch's, and it computes what
    the module does."""
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
    mask = torch.arange(24, dtype=torch.int64).reshape(6, 4) % 4
    module = _Casts()
    program = _program(module, x, mask)
    ops = {n.target for n in program.graph.nodes if n.op == "call_function"}
    assert {torch.ops.aten.to.dtype, torch.ops.aten.reshape.default, torch.ops.aten.detach_.default,
            torch.ops.aten.__and__.Tensor, torch.ops.aten.__or__.Tensor, torch.ops.aten.contiguous.default} <= ops
    registry = _registry()
    assert decomposed.why_retraced(program, registry) is None
    fast, slow = _both(module, (x, mask), ["x", "mask"], monkeypatch, fast_way=True)
    assert graph_difference(fast, slow) is None, graph_difference(fast, slow)
    got = R.prepare_onnx("ort-cpu", fast).run({"x": x.numpy(), "mask": mask.numpy()})
    out = next(iter(got.values()))
    np.testing.assert_allclose(out, module(x, mask).numpy(), rtol=1e-6)


@needs_the_pass
def test_the_program_given_is_left_as_it_was():
    """The pass works on a copy of the graph: the caller's program (its code and its signature)
    is as it was after a whole export of it (a program torch.export made is the user's, and may be
    exported again)."""
    x, mask = torch.ones(4, 6), torch.ones(6, 4, dtype=torch.int64)
    program = _program(_Casts(), x, mask)
    before = (program.graph_module.code, str(program.graph_signature))
    out = decomposed.as_decomposed(program, _registry())
    assert out is not None and out is not program
    assert torch.ops.aten.detach_.default not in {n.target for n in out.graph.nodes}
    E.to_onnx(program, (x, mask), flavor="attention", opset=18, input_names=["x", "mask"], what="test")
    assert (program.graph_module.code, str(program.graph_signature)) == before


class _Complex(torch.nn.Module):
    def forward(self, x):  # (2, 3, 2) -> complex (2, 3) -> (3, 2) -> (3, 2, 2)
        return torch.view_as_real(torch.view_as_complex(x).reshape(3, 2))


@needs_the_pass
def test_a_complex_tensor_is_left_to_torch():
    """reshape's view function is for real tensors (the complex one is torch's own view_complex,
    reached through the decomposition): a program with a complex tensor is left to torch."""
    program = _program(_Complex(), torch.ones(2, 3, 2))
    assert "complex" in decomposed.why_retraced(program, _registry())


class _ZeroRows(torch.nn.Module):
    def forward(self, x):  # (3, 0) -> (0, 3): a 0 in the shape is a size of 0 in torch
        return x.reshape(0, 3) + 1


@needs_the_pass
def test_a_reshape_to_a_zero_size_is_a_size_not_a_copied_axis(monkeypatch):
    """torch.onnx's own function for reshape reads a 0 in the shape as ONNX does by default (keep
    that axis's size: 3 here, and then the sizes do not add up); the decomposition's view, and the
    pass's reshape, mean a size of 0."""
    x = torch.ones(3, 0)
    fast, slow = _both(_ZeroRows(), (x,), ["x"], monkeypatch, fast_way=True)
    assert graph_difference(fast, slow) is None, graph_difference(fast, slow)
    got = next(iter(R.prepare_onnx("ort-cpu", fast).run({"x": x.numpy()}).values()))
    assert got.shape == (0, 3)


class _InPlace(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        y.masked_fill_(y > 3, 0.5)  # in place on an intermediate: only functionalization knows its uses
        return y


class _NoGrad(torch.nn.Module):
    def forward(self, x):
        with torch.no_grad():  # a higher-order op around the block, its subgraph
            y = x.sin()
        return y + 1


class _Unflatten(torch.nn.Module):
    def forward(self, x):
        return x.unflatten(1, (3, 1)) + 1  # a composite view: the retrace makes it a view


class _Mutates(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        self.count.add_(1)  # a buffer written
        return x + self.count


@needs_the_pass
@pytest.mark.parametrize("module, reason", [(_InPlace(), "masked_fill_"), (_NoGrad(), "subgraphs"),
                                            (_Mutates(), "add_"), (_Unflatten(), "composite op")])
def test_anything_else_is_left_to_torchs_decomposition(module, reason, monkeypatch):
    """A program with an op the pass does not know (an op done in place, a higher-order op, a written
    buffer, a composite view) is decomposed by torch: the reason is said, and the graph is torch's."""
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    program = _program(module, x)
    why = decomposed.why_retraced(program, _registry())
    assert why is not None and reason in why, why
    assert decomposed.as_decomposed(program, _registry()) is None
    fast, slow = _both(module, (x,), ["x"], monkeypatch)
    assert graph_difference(fast, slow) is None, graph_difference(fast, slow)


def _registry():
    """torch.onnx's registry as `export.to_onnx` has it made (the pass's own translations in it)."""
    from torch.onnx._internal.exporter import _registration
    registry = _registration.ONNXRegistry.from_torchlib()
    for op, function in decomposed.translations().items():
        registry.register_op(op, function)
    return registry


class _Double(torch.nn.Module):
    def forward(self, x):
        return x * 2


@needs_the_pass
def test_a_graph_rewritten_since_its_trace_is_left_to_torch():
    """A program whose graph was rewritten after the trace (attnexport's routing of attention does
    so) may return a value its signature does not name: torch's decomposition makes the signature
    anew, this pass would keep the old one, so it leaves such a program to torch."""
    program = _program(_Double(), torch.ones(2, 3))
    assert decomposed.why_retraced(program, _registry()) is None
    graph = program.graph_module.graph
    out = next(iter(graph.find_nodes(op="output")))
    with graph.inserting_before(out):
        negated = graph.call_function(torch.ops.aten.neg.default, (out.args[0][0],))
    negated.meta = dict(out.args[0][0].meta)
    out.args = ((negated,),)
    assert "no longer has" in decomposed.why_retraced(program, _registry())


@needs_the_pass
def test_a_registry_that_translates_reshape_its_own_way_leaves_the_program_to_torch():
    """Kept as it is, reshape must be translated as the view it becomes in torch's decomposition: a
    registry without that translation (torch.onnx's own, which reads a 0 in the shape as "keep that
    size") sends a program with a reshape through torch's decomposition."""
    from torch.onnx._internal.exporter import _registration
    program = _program(_ZeroRows(), torch.ones(3, 0))
    assert decomposed.why_retraced(program, _registry()) is None
    assert "reshape" in decomposed.why_retraced(program, _registration.ONNXRegistry.from_torchlib())
