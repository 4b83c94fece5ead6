"""The integer int8 form's choices (`precision.Calibration`), each measured on calibration text the
family owns (`registry.Family.calibration`), never on the text verify judges.

A matrix run by DynamicQuantizeMatMul reads its input rounded to uint8 over the whole tensor: where
a few of the input's channels are far wider than the rest, every other channel gets a handful of
steps. Two remedies, both chosen an input at a time (the matrices that read one input, an
encoder's query, key and value projections, together) by what they cost the family's answers:

- smoothing: the input's channel j divided by s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) (max|x_j|
  over the calibration tokens, W_j row j of the input's matrices side by side, each multiplied by
  s_j: the products unchanged), which narrows the wide channels and widens the weights' rows. For
  each input alone, each alpha of `ALPHAS` (0: none) is tried and the one that costs least is kept
  where it costs at most `GAIN` of what none does (its Mul costs time: a gain in the noise does not
  pay for it);
- float: the inputs whose matrices still cost most alone are kept in float, the costliest first,
  while the whole graph (every input as chosen) costs more than the family's target, at most
  `LIMIT` of the inputs.

Each cost is the model in torch (fp32) with the matrices concerned computing as the file will
(`emulate.per_tensor_uint8` of the smoothed input, the weights as ONNX Runtime's quantizer rounds
them, `precision.int8_columns`), the family's measure of its outputs against the model's own on the
calibration feeds. The table of every measurement goes into the file's precision record."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np

from attnexport import weights as W
from attnexport.pretrained import emulate
from attnexport.pretrained import precision as P

# The smoothing strengths tried for each matrix (0: not smoothed).
ALPHAS = (0.0, 0.5, 0.8, 0.95)
# A smoothing is kept only where it costs at most this share of what its input's matrices cost
# without one (it adds a Mul: a gain lost in the measurement's noise does not pay for it).
GAIN = 0.5
# At most this share of the inputs' matrices is kept in float.
LIMIT = 1 / 8


def scales(maxima: np.ndarray, w: np.ndarray, alpha: float) -> np.ndarray:
    """(K,) float64 smoothing scales of a (K, N) weight whose input's channels reach `maxima`."""
    x = np.maximum(np.asarray(maxima, np.float64), 1e-5)
    rows = np.maximum(np.abs(np.asarray(w, np.float64)).max(axis=1), 1e-5)
    return x ** alpha / rows ** (1 - alpha)


def choose(wrapper, onnx_model, found: list, feeds: list[dict], outputs: list[str],
           cost: Callable[[list[dict], list[dict]], float], target: float) -> P.Calibration:
    """The smoothing and float matrices of the integer form for the sites `found` (`precision.sites`
    of `onnx_model`, the fp32 graph about to be quantized, made from `wrapper`, the module it was
    exported from): `feeds` the family's calibration inputs, `outputs` the wrapper's output names,
    `cost(want, got)` the family's measure of outputs, `target` the whole graph's cost to stay
    under."""
    import torch

    inits = {i.name: i for i in onnx_model.graph.initializer}
    modules = dict(wrapper.named_modules())
    linears = {s.node: [(modules[_owner(name)], columns) for name, columns in s.params.items()
                        if isinstance(modules.get(_owner(name)), torch.nn.Linear)] for s in found}
    usable = [s for s in found if linears[s.node]]

    def run() -> list[dict]:
        with torch.no_grad():
            return [dict(zip(outputs, (t.numpy() for t in wrapper(*(torch.from_numpy(v) for v in f.values()))),
                             strict=True)) for f in feeds]

    maxima = _input_maxima(usable, linears, run)
    want = run()
    weights = {s.node: W.values(inits[s.weight]).astype(np.float32) for s in usable}
    readers: dict[str, list] = {}  # the matrices that read each input: one smoothing vector for them all
    for s in usable:
        readers.setdefault(s.input, []).append(s)

    def held(group: list, alpha: float) -> tuple[np.ndarray | None, dict]:
        rows = np.concatenate([weights[s.node] for s in group], axis=1)
        s_ = scales(maxima[group[0].node], rows, alpha) if alpha else None
        out = {}
        for s in group:
            w = weights[s.node] if s_ is None else (weights[s.node] * s_[:, None]).astype(np.float32)
            q, step = P.int8_columns(w)
            out[s.node] = q.astype(np.float32) * step
        return s_, out

    def emulated(stack, group: list, chosen) -> None:
        s_, ws = chosen
        for s in group:
            stack.enter_context(_as_integer(linears[s.node], ws[s.node], s_))

    table: list[dict] = []
    chosen = {}
    for x, group in readers.items():
        row: dict = {"input": x, "nodes": [s.node for s in group], "group": group[0].group}
        for alpha in ALPHAS:
            with contextlib.ExitStack() as stack:
                emulated(stack, group, held(group, alpha))
                row[f"alpha {alpha}"] = cost(want, run())
        best = min(ALPHAS, key=lambda a: row[f"alpha {a}"])
        row["alpha"] = best if row[f"alpha {best}"] <= GAIN * row[f"alpha {ALPHAS[0]}"] else ALPHAS[0]
        row["cost"] = row[f"alpha {row['alpha']}"]
        table.append(row)
        chosen[x] = held(group, row["alpha"])
    kept: dict[str, str] = {}
    whole: list[dict] = []
    for r in sorted(table, key=lambda r: -r["cost"])[:max(1, int(LIMIT * len(table)))] + [None]:
        with contextlib.ExitStack() as stack:
            for x, group in readers.items():
                if x not in kept:
                    emulated(stack, group, chosen[x])
            whole.append({"kept_float": [n for x in kept for n in readers_nodes(readers, x)],
                          "cost": cost(want, run())})
        if whole[-1]["cost"] <= target or r is None:
            break
        kept[r["input"]] = (f"costs most alone ({r['cost']:.3g}); the rest together cost {whole[-1]['cost']:.3g}, "
                            f"over the target {target:.3g}")
    if whole[-1]["cost"] > target:  # the last one kept did not bring it under: keep the least costly tried
        best_whole = min(whole, key=lambda w: w["cost"])
        kept = {x: why for x, why in kept.items() if readers[x][0].node in best_whole["kept_float"]}
    smoothing = {s.node: (next(r["alpha"] for r in table if r["input"] == x), chosen[x][0])
                 for x, group in readers.items() if x not in kept and chosen[x][0] is not None for s in group}
    return P.Calibration(smoothing, {n: why for x, why in kept.items() for n in readers_nodes(readers, x)},
                         {"feeds": len(feeds), "target": target, "alphas": list(ALPHAS), "gain": GAIN,
                          "per_input": table, "whole": whole})


def readers_nodes(readers: dict, x: str) -> list[str]:
    return [s.node for s in readers[x]]


def _owner(param: str) -> str:
    """A recorded parameter's module in the export's wrapper (its names as the record has them)."""
    return param.rsplit(".", 1)[0]


def _input_maxima(found: list, linears: dict, run) -> dict[str, np.ndarray]:
    """Each site's input's largest magnitude per channel over the calibration feeds."""
    maxima: dict[str, np.ndarray] = {}
    hooks = []

    def seen(node):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).double().numpy()
            maxima[node] = np.maximum(maxima[node], x) if node in maxima else x
        return hook

    try:
        for s in found:
            hooks.append(linears[s.node][0][0].register_forward_pre_hook(seen(s.node)))
        run()
    finally:
        for h in hooks:
            h.remove()
    return maxima


@contextlib.contextmanager
def _as_integer(owners: list, w: np.ndarray, s: np.ndarray | None):
    """Within the block the Linears `owners` ((module, columns) of one site) compute as its
    DynamicQuantizeMatMul will: the input divided by `s` (where given), rounded to uint8 per tensor,
    times `w` ((K, N) float32, the rounded smoothed weights)."""
    import torch

    inverse = torch.from_numpy((1 / s).astype(np.float32)) if s is not None else None

    def forward_of(owner, columns):
        block = torch.from_numpy(np.ascontiguousarray(w if columns is None else w[:, columns[0]:columns[1]]))

        def forward(x):
            x = x * inverse.to(x.dtype) if inverse is not None else x
            out = emulate.per_tensor_uint8(x) @ block.to(x.dtype)
            return out + owner.bias.to(x.dtype) if owner.bias is not None else out
        return forward

    patched = []
    try:
        for owner, columns in owners:
            owner.forward = forward_of(owner, columns)
            patched.append(owner)
        yield
    finally:
        for owner in patched:
            del owner.forward
