"""Users' own attention modules: load one (and its weights) from a file, route its attention.

During the export, every call of `torch.nn.functional.scaled_dot_product_attention` goes through
attnexport's attention core (`attnexport.models.core.attend`), so the flavour decides the graph
exactly as for the built-in variants. `nn.MultiheadAttention` (and with it
`nn.TransformerEncoderLayer`/`DecoderLayer`) calls that function when it is not asked for its
weights, with its fast path off, which the export turns off. Attention written out with torch's
ops is recognized in the traced program (`attnexport.recognize`). A module is exported by
`attnexport.export.export_module` and verified by `attnexport.verify.verify_module`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
from pathlib import Path

import numpy as np

from attnexport import dtypes as D
from attnexport import models
from attnexport.compare import derived_tolerance, tolerance
from attnexport.errors import ExportError, UsageError, first_line, reason
from attnexport.semantics import Core

SEMANTICS_NOTE = "a fully masked query row gives zeros in the export, where torch {version} gives NaN"


def torch_gives_nan_rows(dtype: str) -> bool:
    """Whether this torch's scaled_dot_product_attention (on the CPU, in `dtype`) gives NaN for a
    query row whose mask hides every key. torch 2.13 gives zeros; earlier releases gave NaN."""
    import torch

    torch_sdpa = models.core.torch_sdpa
    q = torch.ones((1, 1, 1, 4), dtype=D.torch_dtype(dtype))
    mask = torch.zeros((1, 1, 1, 2), dtype=torch.bool)
    return bool(torch.isnan(torch_sdpa(q, q.expand(1, 1, 2, 4), q.expand(1, 1, 2, 4), attn_mask=mask)).any())
_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "bool": "bool", "int64": "int64",
           "int32": "int32"}


@contextlib.contextmanager
def _importable_beside(path: Path):
    """The folder of the user's file first on the import path while it loads (as `python FILE.py`
    has it), so `import helpers` finds the helpers.py beside it; the path is restored after."""
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        if folder in sys.path:
            sys.path.remove(folder)


def load(spec: str, seed: int = 0):
    """`FILE.py:NAME` -> (module, example inputs or None). NAME is an nn.Module class taking no
    arguments, or a function returning a module or (module, example_inputs).

    torch's generator is seeded with `seed` while NAME runs (and restored after), so a class
    that draws its weights at random gives the same ones in export, verify and bench."""
    import torch
    path_text, sep, name = spec.rpartition(":")
    if not sep or not path_text or not name:
        raise UsageError(f"--module takes FILE.py:NAME, got {spec!r}")
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"--module {spec}: {path} is not a file")
    mod_name = "attnexport_user_" + re.sub(r"\W", "_", str(path.resolve()))
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UsageError(f"--module {spec}: {path} cannot be imported as Python")
    source = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = source
    try:
        with _importable_beside(path):  # as Python runs a script: its siblings import
            loader_spec.loader.exec_module(source)
    except Exception as e:  # noqa: BLE001 - the user's file: any error is theirs, said in one line
        raise UsageError(f"--module {spec}: importing {path.name} raised {reason(e)}") from None
    if not hasattr(source, name):
        names = sorted(n for n, v in vars(source).items() if not n.startswith("_") and callable(v)
                       and getattr(v, "__module__", None) == mod_name)
        raise UsageError(f"--module {spec}: {path.name} has no {name!r} (it defines {', '.join(names) or 'nothing'})")
    obj = getattr(source, name)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"the seed must be an integer >= 0, got {seed!r}")
    try:
        with torch.random.fork_rng(devices=[]), _importable_beside(path):
            torch.manual_seed(seed)
            made = obj()
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"--module {spec}: {name}() raised {reason(e)}") from None
    module, example = (made if isinstance(made, tuple) and len(made) == 2 else (made, None))
    if not isinstance(module, torch.nn.Module):
        raise UsageError(f"--module {spec}: {name}() gave a {type(module).__name__}, not a torch.nn.Module")
    if example is not None:
        example = tuple(example) if isinstance(example, (tuple, list)) else (example,)
    return module, example


def load_weights(module, path) -> None:
    """Loads trained weights into `module`: a state_dict saved with `torch.save`, or a
    `.safetensors` file. Every tensor of the module must be there, with its shape, and nothing
    else (a UsageError names what is missing, extra or mis-shaped)."""
    import torch
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--weights {path}: no such file")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(path), device="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: said in one line
        raise UsageError(f"--weights {path}: cannot be read as a state_dict ({reason(e)})") \
            from None
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(f"--weights {path}: holds a {type(state).__name__}, not a state_dict of tensors")
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    shapes = sorted(f"{k} {list(state[k].shape)} (the module's: {list(own[k].shape)})"
                    for k in set(own) & set(state) if state[k].shape != own[k].shape)
    def few(kind, names, shown=3):
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        return [f"{kind} {', '.join(names[:shown])}{more}"] if names else []
    problems = few("missing", missing) + few("extra", extra) + few("mis-shaped", shapes, shown=1)
    if problems:
        raise UsageError(f"--weights {path} does not fit the module: {'; '.join(problems)}")
    with torch.no_grad():
        module.load_state_dict(state, strict=True)


def common_value(t):
    """The most common value of a non-float example input: what a mask or ids input of another
    size is filled with (a mask mostly attends)."""
    import torch
    values, counts = torch.unique(t, return_counts=True)
    return values[counts.argmax()].item()


def load_with_inputs(spec: str, input_specs=(), seed: int = 0, weights=None):
    """(module, example inputs, input names or None) of a `FILE.py:NAME` with the command line's
    `--seed`, `--weights` (a file of trained weights) and `--input NAME:SHAPE[:DTYPE]` texts; a
    UsageError where NAME gives no example inputs and no `--input` is given."""
    module, example = load(spec, seed)
    if weights is not None:
        load_weights(module, weights)
    names = None
    if input_specs:
        parsed = [parse_input(t) for t in input_specs]
        names, example = [p[0] for p in parsed], example_tensors(parsed)
        check_input_names(module, names, f"--module {spec}")
    elif example is None:
        raise UsageError(f"--module {spec}: give --input NAME:SHAPE for each input (the NAME gives no example inputs)")
    return module, example, names


def parse_input(text: str):
    """`NAME:SHAPE[:DTYPE]` (e.g. x:2x16x64, mask:2x16:bool) -> (name, shape, numpy dtype name)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise UsageError(f"--input takes NAME:SHAPE[:DTYPE] (e.g. x:2x16x64:float32), got {text!r}")
    try:
        shape = tuple(int(d) for d in parts[1].split("x"))
    except ValueError:
        raise UsageError(f"--input {text}: the shape is sizes joined by x, e.g. 2x16x64") from None
    if any(d < 1 for d in shape):
        raise UsageError(f"--input {text}: sizes must be >= 1")
    dtype = parts[2] if len(parts) == 3 else "float32"
    if dtype not in _DTYPES:
        raise UsageError(f"--input {text}: dtype must be one of {', '.join(_DTYPES)}")
    return parts[0], shape, _DTYPES[dtype]


def expand_cache_patterns(cache: dict, names: list[str]) -> dict:
    """{input: output} cache pairs with `{i}` (a layer's number) expanded over the inputs it
    matches: {"past.{i}.key": "present.{i}.key"} with inputs past.0.key, past.1.key gives two
    pairs. A pattern that matches no input is kept as written (and refused as not an input)."""
    out = {}
    for past, present in cache.items():
        if "{i}" not in past:
            out[past] = present
            continue
        pattern = re.compile(re.escape(past).replace(re.escape("{i}"), r"(\d+)"))
        matched = [(n, m.group(1)) for n in names if (m := pattern.fullmatch(n))]
        if not matched:
            out[past] = present
        for n, i in matched:
            out[n] = present.replace("{i}", i)
    return out


def parse_dynamic(text: str):
    """`NAME:AXIS=DIM` -> (input name, axis, dim name)."""
    m = re.fullmatch(r"([^:]+):(-?\d+)=([A-Za-z_]\w*)", text)
    if not m:
        raise UsageError(f"--dynamic takes NAME:AXIS=DIM (e.g. x:1=seq), got {text!r}")
    return m.group(1), int(m.group(2)), m.group(3)


def example_tensors(specs, seed: int = 0):
    """Seeded tensors for --input specs: floats standard normal, bools True, ints 0."""
    import torch
    rng = np.random.default_rng(seed)
    out = []
    for _, shape, dtype in specs:
        if dtype.startswith("float"):
            out.append(torch.from_numpy(rng.standard_normal(shape).astype(dtype)))
        elif dtype == "bool":
            out.append(torch.ones(shape, dtype=torch.bool))
        else:
            out.append(torch.zeros(shape, dtype=getattr(torch, dtype)))
    return tuple(out)


# --- routing -----------------------------------------------------------------------------------

@contextlib.contextmanager
def routed():
    """Within the block, F.scaled_dot_product_attention is attnexport's core, and
    nn.MultiheadAttention's fast path (one fused torch op the exporter cannot route) is off.
    Attention written out with torch's ops (nn.MultiheadAttention's when asked for its weights,
    eager implementations), and a call this cannot take (other ranks: torch's own op is left in
    the program), are found in the traced program by `attnexport.recognize`, which routes or
    reports them; the calls routed are counted there too."""
    import torch

    attend = models.core.attend
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p:
            raise ExportError(f"scaled_dot_product_attention was called with dropout_p={dropout_p} at export: "
                              "pass 0.0 when the module is not training (the export is an inference graph)")
        rank = query.dim()
        if rank not in (3, 4) or key.dim() != rank:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if rank == 3:  # (N, L, E): one head
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(1)
        out = attend(query, key, value, attn_mask, core=Core(scale, bool(is_causal))).output
        return out.squeeze(1) if rank == 3 else out

    fastpath = torch.backends.mha.get_fastpath_enabled()
    functional.scaled_dot_product_attention = sdpa
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original
        torch.backends.mha.set_fastpath_enabled(fastpath)


@contextlib.contextmanager
def export_semantics():
    """Within the block, the module computes what its export computes: its attention calls routed
    through the core, and a query with no key to attend to giving zeros (not NaN) in attention
    written by hand too. What a module's outputs are compared with, at export and in verify."""
    with routed(), dead_softmax_rows_zero():
        yield


@contextlib.contextmanager
def dead_softmax_rows_zero():
    """Within the block, a softmax over a row that is -inf everywhere (a query with no key to
    attend to) gives zeros, attnexport's semantics, where torch gives NaN: what the torch module
    computes under those semantics when its attention is written out by hand."""
    import torch
    functional = torch.nn.functional
    originals = (torch.softmax, torch.Tensor.softmax, functional.softmax)

    def zeroing(softmax):
        def wrapped(input, dim=None, *args, **kwargs):
            out = softmax(input, dim, *args, **kwargs)
            if dim is None or not input.is_floating_point():
                return out
            return out.masked_fill(torch.isneginf(input).all(dim=dim, keepdim=True), 0.0)
        return wrapped

    torch.softmax, torch.Tensor.softmax, functional.softmax = (zeroing(f) for f in originals)
    try:
        yield
    finally:
        torch.softmax, torch.Tensor.softmax, functional.softmax = originals


def expected_of(module, feed, name, dtype: str, compute):
    """What an export of `module` in `dtype` is compared with on `feed`, and the tolerance.

    `compute(module, feed)` gives the module's outputs (under whatever semantics the caller
    holds). fp32: those outputs, the policy's tolerance. fp16: the module run in float32 on the
    same parameters and inputs (both already rounded to fp16), the fp16 model's own truth, and a
    tolerance derived as for the golden cases: FP16_FACTOR times the error torch's fp16 run makes
    against it, never below the policy. Two fp16 computations of a deep module round differently
    at every layer, so comparing one with the other (a 2-layer BERT: 1 ulp at values near 4, past
    the policy's atol) would fail a correct export.

    Returns (list of float64 outputs, Tolerance)."""
    import torch

    with torch.no_grad():
        half = outputs_of(compute(module, feed))
    if dtype != "fp16":
        return [t.detach().double() for t in half], tolerance(dtype)
    module.float()  # fp16 -> fp32 -> fp16 restores every value exactly
    try:
        with torch.no_grad():
            single = outputs_of(compute(module, tuple(t.float() if t.is_floating_point() else t for t in feed)))
    finally:
        module.half()
    err = 0.0
    for h, f in zip(half, single, strict=True):
        if h.is_floating_point():
            diff = (h.double() - f.double()).abs()
            finite = torch.isfinite(diff)
            err = max(err, float(diff[finite].max()) if finite.any() else 0.0)
    tol = derived_tolerance(dtype, err)
    basis = tol.basis.replace("fp16-emulated reference error", "torch's fp16 error against the module in fp32")
    return [t.detach().double() for t in single], type(tol)(tol.rtol, tol.atol, basis)


# --- a forward's inputs and outputs --------------------------------------------------------------

def call_forward(module, args, name):
    """module(*args); whatever it raises is the user's to read, in one line (a UsageError)."""
    try:
        return module(*args)
    except (ExportError, UsageError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's code
        shapes = ", ".join("x".join(map(str, t.shape)) for t in args)
        raise UsageError(f"{name}: forward raised {type(e).__name__} on inputs of shapes {shapes}: {first_line(e)}") \
            from None


def named_outputs(out) -> list[tuple[str | None, object]]:
    """A forward's result as (name, tensor) pairs in the order the exporter flattens it: one
    tensor is `output`, a tuple's are `output_0`, `output_1`, ..., a dict's (a transformers
    ModelOutput) keep their keys; None values are left out. A name is None where the structure
    is nested (the exporter then names it)."""
    import torch
    if isinstance(out, dict):
        items = [(k, v) for k, v in out.items() if v is not None]
    elif isinstance(out, (tuple, list)):
        items = [(f"output_{i}", v) for i, v in enumerate(out) if v is not None]
    else:
        items = [("output", out)]
    return [(k if isinstance(v, torch.Tensor) else None, v) for k, v in items]


def outputs_of(out) -> list:
    """A forward's result as a list of tensors (see named_outputs)."""
    return [v for _, v in named_outputs(out)]


def default_output_names(out) -> list[str] | None:
    """Stable output names from the module's return structure, so that a deployment app does not
    depend on internal node names (`add_161`); None for anything nested."""
    names = [n for n, _ in named_outputs(out)]
    return None if None in names else [n for n in names if n is not None]


def check_input_names(module, names: list[str], what: str) -> None:
    """`--input` names are `forward`'s parameters, in its order (the tensors are passed to it by
    position): a name that is not the parameter at its place would silently rename an input."""
    import inspect
    sig = inspect.signature(module.forward).parameters.values()
    if any(p.kind == p.VAR_POSITIONAL for p in sig):
        return  # forward(*args): any names
    params = [p.name for p in sig if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(names) > len(params):
        raise UsageError(f"{what}: {len(names)} --input for forward({', '.join(params)}), which takes "
                         f"{len(params)}")
    wrong = [(n, p) for n, p in zip(names, params, strict=False) if n != p]
    if wrong:
        n, p = wrong[0]
        raise UsageError(f"{what}: --input {n} is not forward's parameter at its place ({p}); give the inputs "
                         f"in forward's order, named as its parameters: {', '.join(params)}")


def forward_names(module, n):
    import inspect
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) >= n:
        return [p.name for p in params[:n]]
    return [f"input_{i}" for i in range(n)]

