"""Attention written by hand, found in a traced program and routed through the core.

`softmax(q @ k.transpose(-1, -2) * scale + mask) @ v` is attention whoever wrote it: GPT-2's and
T5's eager code, `nn.MultiheadAttention` asked for its weights, and countless users' modules. A
user's module is traced by torch.export (attnexport.export.export_module); this pass rewrites the
traced program in place, replacing each such computation by one call of the attention core
(`torch.ops.attnexport.attention`), so that the flavour decides its graph exactly as for a call of
`scaled_dot_product_attention`. A call of torch's own `scaled_dot_product_attention` op left in the
program (a module that bound the function before the export) is routed the same way.

What is recognized, walking back from each softmax over the last axis:
- the value product `matmul`/`bmm` of the probabilities (after casts, clones, and dropout in
  eval) with the values; the probabilities may also be used elsewhere (returned as weights):
  those uses read the core's score output (the operator's mode 3);
- masks added to the scores (any number, float or boolean; `scores += mask` too), `masked_fill`/`where` with -inf or a
  large negative value, a constant added to every score (softmax ignores it);
- scales by numbers: on the scores, on the queries or on the keys (`mul`/`div`), `baddbmm`'s alpha;
- a softmax in float32 of float16 scores (the operator's `softmax_precision`);
- queries, keys and values of rank 4 (batch, heads, length, dim; key heads dividing query heads)
  or rank 3 (batch x heads, length, dim).

Anything else that looks like attention (a softmax fed by, or feeding, a product of two computed
tensors) is reported with the reason it was not recognized, so that a fused flavour never passes
with MatMul+Softmax in it unnoticed.
"""

from __future__ import annotations

import importlib
import math
import operator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.fx import Node

from attnexport.errors import reason
from attnexport.semantics import NO_WEIGHTS, Core

aten = torch.ops.aten

_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_PRODUCT = {aten.matmul.default, aten.bmm.default}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.to.dtype_layout}
_SAME_VALUES = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
                aten.dropout.default}
_CHECKS = {aten._assert_tensor_metadata.default}
_KIND = "attnexport_routed"  # the meta key marking a core node this pass made, with how it was found
_LARGE_NEGATIVE = -1e4  # a fill at or below this hides a key as -inf does (exp underflows to 0)


@dataclass
class Found:
    """One attention computation routed (`kind`: "hand-written" or "sdpa op") or not (`reason`)."""

    where: str
    kind: str = ""
    reason: str = ""


class _NotAttention(Exception):
    pass


def _where(node: Node) -> str:
    """The user's source line of a node, from the trace's stack (the innermost frame outside
    attnexport and torch): `file.py:12 (code)`."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    frames = []
    for i, line in enumerate(lines):
        if line.startswith("File "):
            parts = line.split(",")
            path = parts[0][len("File "):].strip('"')
            number = parts[1].strip().removeprefix("line ") if len(parts) > 1 else "?"
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            frames.append((path, number, code.rstrip("(").strip()))
    outside = [f for f in frames if not any(f"/{pkg}/" in f[0] for pkg in ("attnexport", "torch"))] or frames
    if not outside:
        return f"node {node.name}"
    path, number, code = outside[-1]
    file = path.rsplit("/", 1)[-1]
    return f"{file}:{number} ({code})" if code else f"{file}:{number}"


def routed_calls(program) -> list[dict]:
    """Every call of the core in a traced program, in order: {"kind", "where"}; kind is
    "scaled_dot_product_attention" for a call routed as the module made it, else how
    `route` found it ("hand-written", "sdpa op")."""
    core = torch.ops.attnexport.attention.default
    static = torch.ops.attnexport.static_attention.default
    return [{"kind": "static cache step" if n.target is static else n.meta.get(_KIND, "scaled_dot_product_attention"),
             "where": _where(n)} for n in program.graph.nodes if n.target in (core, static)]


def _val(x):
    return x.meta.get("val") if isinstance(x, Node) else x


def _number(x):
    """A Python number, or the value of a 0-d constant made with `full`; None otherwise."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if isinstance(x, Node) and x.target is aten.full.default and list(x.args[0]) == [] and \
            isinstance(x.args[1], (int, float)):
        return float(x.args[1])
    return None


def _operands(product: Node) -> list[Any]:
    """The tensors a product multiplies: einsum's list, or matmul's and bmm's two arguments."""
    args: Any = product.args[1] if product.target is aten.einsum.default else product.args  # fx: untyped
    return list(args)


def _users(node: Node) -> list[Node]:
    return [u for u in node.users if u.target not in _CHECKS]


def _rank(x) -> int:
    v = _val(x)
    return v.dim() if isinstance(v, torch.Tensor) else -1


def _last_axis(dim, rank) -> bool:
    return dim in (-1, rank - 1)


class _Rewriter:
    def __init__(self, program):
        self.graph = program.graph_module.graph
        sig = program.graph_signature
        self.weights = set(sig.inputs_to_parameters) | set(sig.inputs_to_buffers) | \
            set(getattr(sig, "inputs_to_lifted_tensor_constants", {}))
        vals = [n.meta["val"] for n in self.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        self.fake_mode = torch._guards.detect_fake_mode(vals)

    # --- building nodes -------------------------------------------------------------------------

    def new(self, before: Node, target, *args, **kwargs) -> Node:
        """A node calling `target`, inserted before `before`, with its fake value computed."""
        with self.graph.inserting_before(before):
            node = self.graph.call_function(target, args, kwargs)
        fargs = [_val(a) for a in args]
        fkwargs = {k: _val(v) for k, v in kwargs.items()}
        with self.fake_mode:
            node.meta["val"] = target(*fargs, **fkwargs)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in before.meta:
                node.meta[key] = before.meta[key]
        return node

    def computed(self, x) -> bool:
        """Whether a tensor is computed from the inputs (not a parameter, buffer or constant)."""
        return isinstance(x, Node) and not (x.op == "placeholder" and x.name in self.weights) and x.op != "get_attr"

    # --- matching -------------------------------------------------------------------------------

    def product_of_computed(self, node, depth: int = 8) -> bool:
        """Whether `node` is, or is computed from (within `depth` steps), a product of two computed
        tensors: the scores of attention, as against a mask or a bias."""
        if not isinstance(node, Node) or depth == 0 or node.op != "call_function":
            return False
        if node.target in _PRODUCT | {aten.baddbmm.default, aten.einsum.default}:
            operands: Any = node.args[1] if node.target is aten.einsum.default else node.args[-2:]
            if all(self.computed(a) for a in operands):
                return True
        return any(self.product_of_computed(a, depth - 1) for a in node.all_input_nodes
                   if isinstance(_val(a), torch.Tensor))

    def looks_like_attention(self, softmax: Node) -> bool:
        if self.product_of_computed(softmax.args[0]):
            return True
        chain, _ = self.probs_chain(softmax)
        return any(u.target in _PRODUCT | {aten.einsum.default} and self.computed(next(
            (a for a in _operands(u) if a is not chain[-1]), None)) for u in _users(chain[-1]))

    def probs_chain(self, softmax: Node):
        """(the softmax and the casts/clones/dropouts after it, their other users)."""
        chain: list[Node] = [softmax]
        others: list[Node] = []
        while True:
            users = _users(chain[-1])
            nxt = [u for u in users if (u.target in _CASTS or u.target in _SAME_VALUES) and u.args[0] is chain[-1]
                   and not (u.target is aten.dropout.default and u.args[2] and u.args[1])]
            if len(nxt) != 1:
                return chain, others
            others += [u for u in users if u is not nxt[0]]
            chain.append(nxt[0])

    def scores(self, x: Any, scale: float, masks: list):
        """Walks back from the softmax's input to the product QK^T, appending each mask term found
        to `masks` with the scale applied after it. Returns (q, kt, scale)."""
        while True:
            t = x.target if isinstance(x, Node) else None
            if t in _CASTS or t in (aten.clone.default, aten.contiguous.default):
                x = x.args[0]
            elif t in (aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor):
                a, b = x.args[:2]
                if x.kwargs.get("alpha", 1) != 1:
                    raise _NotAttention(f"{x.name} adds with alpha {x.kwargs['alpha']}")
                if t is aten.add_.Tensor and not (isinstance(a, Node) and len(a.users) == 1):
                    # `scores += mask` (T5): the scores before it must be read nowhere else
                    raise _NotAttention(f"{x.name} adds to the scores in place, and they are read elsewhere")
                if _number(b) is not None:  # the same number added to every score: softmax ignores it
                    x = a
                    continue
                if t is not aten.sub.Tensor and not self.product_of_computed(b) and self.product_of_computed(a):
                    x, mask = a, b
                elif t is aten.add.Tensor and not self.product_of_computed(a) and self.product_of_computed(b):
                    x, mask = b, a
                else:
                    raise _NotAttention(f"{x.name} combines two products or subtracts from the scores")
                masks.append((mask, scale))
            elif t in (aten.mul.Tensor, aten.div.Tensor):
                a, b = x.args[:2]
                if _number(b) is None and _number(a) is not None and t is aten.mul.Tensor:
                    a, b = b, a
                n = _number(b)
                if n is None:
                    raise _NotAttention(f"{x.name} scales the scores by a tensor, not a number")
                scale *= n if t is aten.mul.Tensor else 1.0 / n
                x = a
            elif t in (aten.masked_fill.Scalar, aten.where.self, aten.where.ScalarOther):
                # masked_fill(scores, cond, v) hides where cond is True; where(cond, scores, v) keeps there
                hides = t is aten.masked_fill.Scalar
                a, cond, value = (x.args[0], x.args[1], x.args[2]) if hides else (x.args[1], x.args[0], x.args[2])
                fill = _number(value)
                if fill is None or fill > _LARGE_NEGATIVE:
                    raise _NotAttention(f"{x.name} puts {value} in the scores, not -inf or a large negative number")
                masks.append((("hide" if hides else "keep", cond, fill), 1.0))
                x = a
            elif t is aten.baddbmm.default:
                bias, q, kt = x.args[:3]
                if x.kwargs.get("beta", 1) != 1:
                    raise _NotAttention(f"{x.name} scales its mask by beta {x.kwargs['beta']}")
                masks.append((bias, scale))
                return q, kt, scale * x.kwargs.get("alpha", 1)
            elif t in _PRODUCT:
                return x.args[0], x.args[1], scale
            else:
                raise _NotAttention(f"the scores come from {getattr(t, '__name__', t)}, not a product of queries "
                                    "and keys")

    def operand_scale(self, x: Any, scale: float):
        """Peels `mul`/`div` by a number off a query or key operand."""
        while isinstance(x, Node) and x.target in (aten.mul.Tensor, aten.div.Tensor) and _number(x.args[1]) is not None:
            n = _number(x.args[1])
            scale *= n if x.target is aten.mul.Tensor else 1.0 / n
            x = x.args[0]
        return x, scale

    def keys(self, kt: Any, before: Node) -> Any:
        """The keys (…, Tk, d) of the product's right operand (…, d, Tk)."""
        rank = _rank(kt)
        last = {rank - 2, rank - 1}
        if kt.target is aten.transpose.int and {d % rank for d in kt.args[1:3]} == last:
            return kt.args[0]
        if kt.target is aten.permute.default:
            perm = [d % rank for d in kt.args[1]]
            if perm[:-2] == list(range(rank - 2)) and perm[-2:] == [rank - 1, rank - 2]:
                return kt.args[0]
        return self.new(before, aten.transpose.int, kt, -2, -1)

    # --- rewriting ------------------------------------------------------------------------------

    def route_softmax(self, softmax: Node) -> Found:
        where = _where(softmax)
        rank_s = _rank(softmax)
        if not _last_axis(softmax.args[1], rank_s):
            raise _NotAttention("the softmax is not over the last axis")
        chain, others = self.probs_chain(softmax)
        probs = chain[-1]
        users = _users(probs)
        value_products = [u for u in users if u.target in _PRODUCT and u.args[0] is probs]
        if len(value_products) != 1:
            raise _NotAttention("the probabilities are not multiplied by values (matmul or bmm)")
        vp = value_products[0]
        others += [u for u in users if u is not vp]
        v: Any = vp.args[1]
        masks: list = []
        x: Any = softmax.args[0]
        precision = None
        if softmax.target is aten.softmax.int and len(softmax.args) > 2 and softmax.args[2] is not None:
            precision = softmax.args[2]
        elif softmax.target is aten._softmax.default and softmax.args[2]:
            precision = torch.float32
        if x.target in _CASTS and _val(x).dtype == torch.float32 and _val(x.args[0]).dtype in (torch.float16,
                                                                                              torch.bfloat16):
            precision, x = torch.float32, x.args[0]
        q, kt, scale = self.scores(x, 1.0, masks)
        q, scale = self.operand_scale(q, scale)
        kt, scale = self.operand_scale(kt, scale)
        rank = _rank(q)
        if rank not in (3, 4) or _rank(kt) != rank or _rank(v) != rank or _rank(vp) != rank:
            raise _NotAttention(f"the queries have rank {rank}, not 3 or 4 like keys and values")
        qv, ktv, vv = _val(q), _val(kt), _val(v)
        if str(qv.shape[0]) != str(ktv.shape[0]) or str(ktv.shape[0]) != str(vv.shape[0]):
            raise _NotAttention("queries, keys and values have different batch sizes")
        if rank == 4:
            hq, hk, hv = qv.shape[1], ktv.shape[1], vv.shape[1]
            same = str(hq) == str(hk)
            if str(hk) != str(hv) or not (same or isinstance(hq, int) and isinstance(hk, int) and hq % hk == 0):
                raise _NotAttention(f"{hq} query heads and {hk} key heads: key heads must divide query heads")
        if _val(softmax).dtype != qv.dtype and precision is None:
            raise _NotAttention("the softmax's dtype differs from the queries'")
        wanted_precision = 1 if (precision is not None and qv.dtype != torch.float32) else None
        core = Core(scale, weights=Core.mode("softmax" if others else None), softmax_precision=wanted_precision)
        out, shown = self.call_core(vp, q, self.keys(kt, vp), v, self.mask(masks, vp), core=core, kind="hand-written")
        if _val(out).dtype != _val(vp).dtype:
            out = self.new(vp, aten.to.dtype, out, _val(vp).dtype)
        vp.replace_all_uses_with(out)
        if others:
            for user in others:
                src = next(a for a in user.all_input_nodes if a in chain)
                wanted = _val(src).dtype
                s = shown if _val(shown).dtype == wanted else self.new(vp, aten.to.dtype, shown, wanted)
                user.replace_input_with(src, s)
        self.graph.erase_node(vp)
        for node in reversed(chain):  # dropout is not pure to torch.fx: erased here, not as dead code
            for u in list(node.users):
                if u.target in _CHECKS:
                    self.graph.erase_node(u)
            if not node.users:
                self.graph.erase_node(node)
        return Found(where, kind="hand-written")

    def mask(self, masks, before):
        """One mask for the core from the (term, scale) pairs found: None, a boolean (True =
        attend), or additive."""
        terms = []
        for m, s in masks:
            if isinstance(m, tuple):
                how, cond, fill = m
                if math.isinf(fill) and len(masks) == 1:
                    terms.append(self.new(before, aten.logical_not.default, cond) if how == "hide" else cond)
                    continue
                hidden, shown = (fill, 0.0) if how == "hide" else (0.0, fill)
                terms.append(self.new(before, aten.where.Scalar, cond, hidden, shown))
                continue
            if _val(m).dtype == torch.bool:
                raise _NotAttention("a boolean tensor is added to the scores")
            terms.append(m if s == 1.0 else self.new(before, aten.mul.Tensor, m, s))
        if not terms:
            return None
        mask = terms[0]
        for t in terms[1:]:
            mask = self.new(before, aten.add.Tensor, mask, t)
        return mask

    def call_core(self, before: Node, q, k, v, mask, *, core: Core, kind: str):
        """The core called on (q, k, v, mask) before `before`: rank-3 inputs (batch x heads, length,
        dim) given a head axis and the outputs theirs taken back off. Returns (output, the score
        output or None)."""
        rank3 = _rank(q) == 3
        if rank3:
            q, k, v = (self.new(before, aten.unsqueeze.default, t, 1) for t in (q, k, v))
            if mask is not None and _rank(mask) == 3:
                mask = self.new(before, aten.unsqueeze.default, mask, 1)
        mode = core.weights
        called = self.new(before, torch.ops.attnexport.attention.default, q, k, v, mask, None, None, None,
                          *core.attributes())
        called.meta[_KIND] = kind
        outs = [self.new(before, operator.getitem, called, i) for i in ((0, 3) if mode != NO_WEIGHTS else (0,))]
        if rank3:
            outs = [self.new(before, aten.squeeze.dim, o, 1) for o in outs]
        return outs[0], (outs[1] if len(outs) > 1 else None)

    def route_sdpa_op(self, node: Node) -> Found:
        """torch's own scaled_dot_product_attention op (a module that bound the function before the
        export): the same call of the core as a routed call."""
        q, k, v = node.args[:3]
        rest = list(node.args[3:]) + [None, 0.0, False][len(node.args) - 3:]
        mask, dropout_p, is_causal = rest[:3]
        if dropout_p:
            raise _NotAttention(f"scaled_dot_product_attention with dropout_p={dropout_p} (pass 0.0 for inference)")
        rank = _rank(q)
        if rank not in (3, 4):
            raise _NotAttention(f"scaled_dot_product_attention on rank-{rank} inputs")
        # enable_gqa needs nothing: the core takes fewer key heads than query heads as grouped.
        core = Core(cast(float | None, node.kwargs.get("scale")), bool(is_causal))
        out, _ = self.call_core(node, q, k, v, mask, core=core, kind="sdpa op")
        node.replace_all_uses_with(out)
        return Found(_where(node), kind="sdpa op")


def route(program) -> list[Found]:
    """Rewrites `program` (a torch.export ExportedProgram) in place: each attention written by hand,
    and each call of torch's scaled_dot_product_attention op, becomes a call of the core. Returns
    what was routed, and what looks like attention but was not recognized (with the reason)."""
    from torch.fx.passes.tools_common import legalize_graph
    importlib.import_module("attnexport.models.core")  # registers torch.ops.attnexport.attention
    r = _Rewriter(program)
    found = []
    candidates = [n for n in r.graph.nodes if n.op == "call_function"
                  and (n.target is aten.scaled_dot_product_attention.default or n.target in _SOFTMAX)]
    for node in candidates:
        try:
            if node.target is aten.scaled_dot_product_attention.default:
                found.append(r.route_sdpa_op(node))
            elif node.users:
                if not r.looks_like_attention(node):
                    continue
                try:
                    found.append(r.route_softmax(node))
                except _NotAttention:
                    raise
                except Exception as e:  # noqa: BLE001 - a shape the fake values could not take
                    raise _NotAttention(f"routing it failed ({reason(e)[:160]})") from None
        except _NotAttention as e:
            found.append(Found(_where(node), reason=str(e)))
    if any(f.kind for f in found):
        r.graph.eliminate_dead_code()
        legalize_graph(program.graph_module)
        r.graph.lint()
        program.graph_module.recompile()
    return found
