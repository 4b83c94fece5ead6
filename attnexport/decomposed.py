"""A traced program handed to torch.onnx as its decomposition would leave it, without tracing it again.

torch.onnx decomposes every program torch.export traced (`ExportedProgram.run_decompositions`) into
the ops it has ONNX functions for. That is a second trace of the whole program: about 3 s of a
1.07B Llama's export here, on the one core the trace runs on, against 0.03-0.2 s for this pass on
the same model. Where the retrace would keep every op as it is, it is not needed. It keeps an op that

- is not in torch.onnx's decomposition table (the table leaves out every op with an ONNX function),
- mutates nothing, and
- where it is a composite op (one torch implements with others), is one torch.export preserves
  (functional, not a view; `_is_preservable_cia_op`): the others are always decomposed.

A handful of ops in torch.export's programs fail that and have a known result, written here as
the retrace writes it (`_rewrite`): a `.to` becomes a cast (`_to_copy`) or nothing, `detach_`
nothing, `&` and `|` the bitwise ops. Two are kept, their ONNX being their decomposition's:
`contiguous` (an Identity, as the copy it becomes is) and `reshape` (the view or copy and view it
becomes are one Reshape: `translations` gives it the view's function). A program with anything
else (another op, a higher-order op, a mutated input or buffer) is decomposed by torch as before,
and `why_retraced` says why. The program given is never changed: the result is a new program over
a copy of its graph (the same parameters). `tests/test_decomposed.py` checks that the ONNX graphs
come out the same both ways, node for node, for every variant and a language model.
"""

from __future__ import annotations

import copy
import functools
import logging
import operator
from collections.abc import Callable

# What torch.export's programs hold that the retrace always rewrites, and how (see `_rewrite`).
_ALIASES = ("to.dtype", "to.device", "to.dtype_layout", "to.other", "detach_.default")  # a cast or nothing
_RENAMED = {"__and__.Tensor": "bitwise_and.Tensor", "__or__.Tensor": "bitwise_or.Tensor"}
# Rewritten by the retrace into ops whose ONNX is theirs: kept (`translations` gives reshape the view's).
_KEPT = ("contiguous.default", "reshape.default")
_ASSERTIONS = ("_assert_tensor_metadata.default", "_assert_scalar.default", "_assert_async.default",
               "_assert_async.msg", "sym_constrain_range_for_size.default")  # torch.onnx drops them


@functools.cache
def unsupported() -> str | None:
    """Why this torch cannot take the pass, or None where it can."""
    try:
        from onnxscript.function_libs.torch_lib.ops.core import aten_view  # noqa: F401
        from torch._export.utils import _is_cia_op, _is_preservable_cia_op  # noqa: F401
        from torch.onnx._internal.exporter import _decomp, _dispatching
    except ImportError:
        return "torch's internals this pass reads have moved"
    if hasattr(_dispatching, "get_matching_overload"):
        # An older torch.onnx (2.10, the floor) matches a node against each function it has for it, and
        # cannot match reshape's list of sizes against a second one (`translations`): an AssertionError.
        return "this torch.onnx matches a node against each of its functions (2.13 takes the first)"
    if not hasattr(_decomp, "create_onnx_friendly_decomposition_table"):
        return "torch's internals this pass reads have moved"
    return None


@functools.cache
def translations() -> dict:
    """What torch.onnx's table gets for the ops `_KEPT` whose own ONNX function is not what their
    decomposition's is: `reshape` (whose function reads a 0 in the shape as "keep that size", where
    torch means a size of 0) becomes a view or a copy and a view, both translated as the view.
    Empty where this torch cannot take the pass (`unsupported`)."""
    import torch
    if unsupported() is not None:
        return {}
    from onnxscript.function_libs.torch_lib.ops.core import aten_view
    return {torch.ops.aten.reshape.default: aten_view}


def _aten(name: str):
    import torch
    op, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, op), overload)


@functools.cache
def _ops():
    """The op objects of the names above, made once: (.to's, the aliases, the renamed, the known)."""
    to_ops = frozenset(_aten(n) for n in _ALIASES if n.startswith("to."))
    aliases = frozenset(_aten(n) for n in _ALIASES)
    renamed = {_aten(a): _aten(b) for a, b in _RENAMED.items()}
    known = aliases | frozenset(renamed) | frozenset(_aten(n) for n in (*_KEPT, *_ASSERTIONS))
    return to_ops, aliases, renamed, known


def as_decomposed(program, registry):
    """`program` as torch.onnx's decomposition with `registry` would leave it, or None where the
    decomposition would change more than the rewrites here know (torch then decomposes it)."""
    why = why_retraced(program, registry)
    if why is not None:
        logging.getLogger(__name__).debug("torch decomposes the program: %s", why)
        return None
    try:
        copied = _copy(program.graph_module)
        _rewrite(copied.graph)
        copied.recompile()
        return program._update(copied, copy.deepcopy(program.graph_signature))
    except Exception as e:  # noqa: BLE001 - torch would not build the new program: it decomposes this one as before
        logging.getLogger(__name__).debug("torch decomposes the program: %s", e)
        return None


def why_retraced(program, registry) -> str | None:
    """Why torch's decomposition of `program` must run (it would change more than `_rewrite`
    knows), or None where `as_decomposed` gives what it would."""
    import torch
    if (off := unsupported()) is not None:
        return off
    from torch._export.utils import _is_cia_op, _is_preservable_cia_op
    from torch.onnx._internal.exporter import _decomp

    gm = program.graph_module
    signature = program.graph_signature
    if any(m is not gm for m in gm.modules()):
        return "it has subgraphs"
    if signature.buffers_to_mutate or signature.user_inputs_to_mutate or \
            getattr(signature, "parameters_to_mutate", None):
        return "it mutates an input or a buffer"
    if any(_unusual(v) for v in (*(n.meta.get("val") for n in gm.graph.nodes), *program.state_dict.values(),
                                 *program.constants.values())):
        return "it holds a tensor subclass or a complex tensor"  # torch's retrace unwraps and redispatches them
    if _named(gm.graph.find_nodes(op="placeholder")) != _named(s.arg for s in signature.input_specs) or \
            _named(_output(gm.graph).args[0]) != _named(s.arg for s in signature.output_specs):
        return "its signature names values its graph no longer has"  # a graph rewritten since the trace
    implemented = set(_decomp.get_onnx_implemented_overloads(registry))
    table = _decomp.create_onnx_friendly_decomposition_table(implemented)
    known = _ops()[3]
    reshape = torch.ops.aten.reshape.default
    outputs = set(_output(gm.graph).all_input_nodes)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function":  # a get_attr, a call_method left by a rewrite: torch's retrace lifts it
            return f"{node.op} {node.target} is not an op's call"
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            if t in known:
                if not _rewritable(node, node in outputs):
                    return f"{t} at {node.name}"
                if t is reshape and not _reshape_as_view(registry):
                    return "torch.onnx's registry does not translate reshape as the view (decomposed.translations)"
            elif t in table:
                return f"{t} is decomposed"
            elif t not in implemented:
                return f"{t} has no ONNX function"
            elif t._schema.is_mutable:
                return f"{t} mutates"
            elif _is_cia_op(t) and not _is_preservable_cia_op(t):
                return f"{t} is a composite op export does not keep"
        elif not _symbolic(t):  # a higher-order op, or a call torch.onnx translates its own way
            return f"{getattr(t, '__name__', t)} is not an op"
    return None


def _unusual(value) -> bool:
    """A tensor subclass (a quantized weight's wrapper, say) or a complex tensor: what `_rewrite`
    and the kept ops' translations do not cover (reshape's view function, for one, is real-only)."""
    import torch
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if not isinstance(value, torch.Tensor):
        return False
    return is_traceable_wrapper_subclass(value) or value.is_complex()


def _reshape_as_view(registry) -> bool:
    """Whether `registry` translates reshape with the view's function (`translations`), first."""
    import torch
    view = translations().get(torch.ops.aten.reshape.default)
    decomps = registry.get_decomps(torch.ops.aten.reshape.default) if view is not None else []
    return bool(decomps) and decomps[0].is_custom and decomps[0].onnx_function is view


def _output(graph):
    return next(iter(graph.find_nodes(op="output")))


def _named(values) -> list:
    """The names of `values` (graph nodes, or a signature's arguments), None for a constant."""
    return [getattr(v, "name", None) for v in values]


def _symbolic(target: Callable) -> bool:
    """Python's operators and torch's functions on symbolic sizes (sym_max, sym_not, ...): the
    size arithmetic the retrace keeps."""
    import torch
    name = getattr(target, "__name__", "")
    return getattr(operator, name, None) is target or (name.startswith("sym_") and getattr(torch, name, None) is target)


def _copy(gm):
    """A graph module over a copy of `gm`'s graph (its nodes' metadata shared) and `gm`'s own
    parameters, buffers and submodules."""
    import torch
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    return copied


def _rewritable(node, is_output: bool) -> bool:
    """Whether `_rewrite` writes `node` (one of the known ops) as the retrace would: a `.to` whose
    tensors are known and stay on their device; an op the retrace drops that is not an output
    (the program's outputs are named by their nodes)."""
    to_ops, aliases, _, _ = _ops()
    if node.target in to_ops:
        before, after = node.args[0].meta.get("val"), node.meta.get("val")
        if before is None or after is None or before.device != after.device:
            return False
        return not is_output or before.dtype != after.dtype
    return not is_output or node.target not in aliases


def _rewrite(graph) -> None:
    """The known ops of `graph` made what the retrace makes of them (a `.to` a cast where it changes
    the type; `detach_` and a `.to` to the same type the tensor itself; `&` and `|` the bitwise ops)."""
    import torch
    to_ops, aliases, renamed, _ = _ops()
    for node in list(graph.nodes):
        t = node.target
        if t in aliases:
            x = node.args[0]
            dtype = node.meta["val"].dtype
            if t in to_ops and x.meta["val"].dtype != dtype:
                node.target, node.args, node.kwargs = torch.ops.aten._to_copy.default, (x,), {"dtype": dtype}
                continue
            node.replace_all_uses_with(x)
            graph.erase_node(node)
        elif t in renamed:
            node.target = renamed[t]
