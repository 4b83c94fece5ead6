"""Users' own attention modules: load one from a file, export it in any flavour.

During the export, every call of `torch.nn.functional.scaled_dot_product_attention` goes through
attnexport's attention core (`attnexport.models.core.attend`), so the flavour decides the graph
exactly as for the built-in variants. `nn.MultiheadAttention` (and with it
`nn.TransformerEncoderLayer`/`DecoderLayer`) calls that function when it is not asked for its
weights, with its fast path off, which the export turns off. Before the file is written, the
model runs on ONNX Runtime at other sizes than the example's (length 1 included) and is compared
with the module itself.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from attnexport import dtypes as D
from attnexport import files as F
from attnexport import flavors as FL
from attnexport import weights as W
from attnexport.compare import compare, tolerance
from attnexport.errors import ExportError, UsageError

SEMANTICS_NOTE = "a fully masked query row gives zeros in the export, where torch {version} gives NaN"


def torch_gives_nan_rows(dtype: str) -> bool:
    """Whether this torch's scaled_dot_product_attention (on the CPU, in `dtype`) gives NaN for a
    query row whose mask hides every key. torch 2.13 gives zeros; earlier releases gave NaN."""
    import torch
    from attnexport.models.core import torch_sdpa
    q = torch.ones((1, 1, 1, 4), dtype=D.torch_dtype(dtype))
    mask = torch.zeros((1, 1, 1, 2), dtype=torch.bool)
    return bool(torch.isnan(torch_sdpa(q, q.expand(1, 1, 2, 4), q.expand(1, 1, 2, 4), attn_mask=mask)).any())
_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "bool": "bool", "int64": "int64",
           "int32": "int32"}


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
        loader_spec.loader.exec_module(source)
    except Exception as e:  # noqa: BLE001 - the user's file: any error is theirs, said in one line
        raise UsageError(f"--module {spec}: importing {path.name} raised {type(e).__name__}: {_line(e)}") from None
    if not hasattr(source, name):
        names = sorted(n for n, v in vars(source).items() if not n.startswith("_") and callable(v)
                       and getattr(v, "__module__", None) == mod_name)
        raise UsageError(f"--module {spec}: {path.name} has no {name!r} (it defines {', '.join(names) or 'nothing'})")
    obj = getattr(source, name)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise UsageError(f"the seed must be an integer >= 0, got {seed!r}")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            made = obj()
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"--module {spec}: {name}() raised {type(e).__name__}: {_line(e)}") from None
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
        raise UsageError(f"--weights {path}: cannot be read as a state_dict ({type(e).__name__}: {_line(e)})") \
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


def _common_value(t):
    """The most common value of a non-float example input: what a mask or ids input of another
    size is filled with (a mask mostly attends)."""
    import torch
    values, counts = torch.unique(t, return_counts=True)
    return values[counts.argmax()].item()


def _line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


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

@dataclass
class Routing:
    calls: int = 0
    unrouted: list[str] = field(default_factory=list)


@contextlib.contextmanager
def routed(routing: Routing):
    """Within the block, F.scaled_dot_product_attention is attnexport's core, and
    nn.MultiheadAttention's fast path (one fused torch op the exporter cannot route) is off."""
    import torch
    from attnexport.models.core import attend
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p:
            raise ExportError(f"scaled_dot_product_attention was called with dropout_p={dropout_p} at export: "
                              "pass 0.0 when the module is not training (the export is an inference graph)")
        rank = query.dim()
        if rank not in (3, 4) or key.dim() != rank:
            routing.unrouted.append(f"scaled_dot_product_attention on rank-{rank} inputs")
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        routing.calls += 1
        if rank == 3:  # (N, L, E): one head
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if attn_mask is not None and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(1)
        out = attend(query, key, value, attn_mask, scale=scale, is_causal=is_causal).output
        return out.squeeze(1) if rank == 3 else out

    fastpath = torch.backends.mha.get_fastpath_enabled()
    functional.scaled_dot_product_attention = sdpa
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield routing
    finally:
        functional.scaled_dot_product_attention = original
        torch.backends.mha.set_fastpath_enabled(fastpath)


# --- export -------------------------------------------------------------------------------------

@dataclass
class ModuleExportResult:
    path: Path | None
    module: str
    flavor: str
    opset: int
    dtype: str
    attention_op: str
    routed: int
    dynamic: dict  # input name -> {axis: dim name}
    checked: list  # sizes checked before writing: [{input: shape}]
    size: int = 0
    notes: list = field(default_factory=list)
    model: onnx.ModelProto | None = field(default=None, repr=False)
    outputs: list = field(default_factory=list)  # the model's output names

    def summary(self) -> str:
        line = (f"{self.path}: {self.module}, flavor {self.flavor}, opset {self.opset}, {self.dtype}, attention op "
                f"{self.attention_op}, {self.routed} attention call(s) routed, {F.human_size(self.size)}")
        return "\n".join([line] + [f"note: {n}" for n in self.notes])

    def to_dict(self) -> dict:
        """The result as `export --module ... --json` prints it."""
        return {"path": str(self.path), "module": self.module, "flavor": self.flavor, "opset": self.opset,
                "dtype": self.dtype, "attention_op": self.attention_op, "routed": self.routed,
                "dynamic": self.dynamic, "checked": self.checked, "outputs": self.outputs, "size": self.size,
                "notes": self.notes}


def export_module(module, example_inputs, *, flavor: str = FL.DEFAULT, opset: int | None = None,
                  dtype: str = "fp32", dynamic: dict | None = None, output=None, input_names=None,
                  name: str = "module", nan_rows: bool = False, seed: int | None = None,
                  weights_file: str | None = None, output_names=None) -> ModuleExportResult:
    """Exports a user's attention module through attnexport's core.

    Args:
        example_inputs: a tuple of tensors for `forward`.
        dynamic: {input name: {axis: dim name}}; default: axes 0 (`batch`) and 1 (`<input>_len`)
            of every input of rank 2 or more, wherever torch.export can keep them symbolic.
        output: the file to write (atomically); None: build in memory only.
        nan_rows: keep torch's behaviour for a query row whose mask hides every key (NaN, where
            attnexport gives zeros); only the primitives flavour can, the fused ops define zeros.
        output_names: the model's output names; default: `output` for one tensor, `output_0`,
            `output_1`, ... for a tuple, the keys of a dict (a transformers ModelOutput).
        seed, weights_file: where the module's parameters came from (recorded in the metadata):
            the seed its file was loaded with (`load`), or the file its weights were loaded from.
    """
    import torch
    from attnexport import export as E
    from attnexport.onnx_attention import torch_dead_rows

    FL.check(flavor)
    D.check(dtype)
    opset = FL.opset_for(flavor, opset)
    torch_nan = torch_gives_nan_rows(dtype)
    if nan_rows and not torch_nan:
        raise UsageError(f"--nan-rows: torch {torch.__version__} gives zeros for a fully masked row too (on the "
                         "CPU), as the export does: there is no NaN to keep")
    if nan_rows and flavor != "primitives":
        raise UsageError(f"--nan-rows needs --flavor primitives: the {flavor} flavor's fused op gives zeros for "
                         "a fully masked row by its own definition")
    if output is not None:
        F.resolve_target(Path(output))
    example_inputs = tuple(example_inputs)
    names = list(input_names or _forward_names(module, len(example_inputs)))
    tdtype = D.torch_dtype(dtype)
    args = tuple(t.to(tdtype) if t.is_floating_point() else t for t in example_inputs)
    module = copy.deepcopy(module).to(tdtype).eval()  # the caller's module keeps its dtype and mode
    dims = _dynamic_shapes(names, args, dynamic)
    with torch.no_grad(), routed(Routing()):
        sample = call_forward(module, args, name)
    out_names = list(output_names) if output_names else default_output_names(sample)
    routing = Routing()
    hooks = [m.register_forward_pre_hook(_weights_asked(routing, n), with_kwargs=True)
             for n, m in module.named_modules() if isinstance(m, torch.nn.MultiheadAttention)]
    try:
        with routed(routing), (torch_dead_rows() if nan_rows else contextlib.nullcontext()):
            program = E.to_onnx(module, args, flavor=flavor, opset=opset, input_names=names, output_names=out_names,
                                dynamic_shapes=dims[0], what=name)
    finally:
        for h in hooks:
            h.remove()
    model = program.model_proto
    # Calls routed: the core's nodes in the traced program (tracing may run forward more than once).
    routing.calls = sum(1 for node in program.exported_program.graph.nodes
                        if node.target is torch.ops.attnexport.attention.default)
    kept = _name_dims(model, names, dims[1])
    if dynamic is not None:
        fixed = [f"{n}:{a}={d}" for n, axes in dims[1].items() for a, d in axes.items() if a not in kept.get(n, {})]
        if fixed:
            raise UsageError(f"--dynamic {', '.join(fixed)}: {name} fixes that axis (the export would be static "
                             f"there)")
    model = E.convert_opset(model, opset, name)
    params = {k: v.detach().float().numpy() for k, v in module.state_dict().items()}
    entries = W.record(model, params, D.NUMPY[dtype])
    spec = [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
             "dynamic": {str(a): d for a, d in kept.get(n, {}).items()}} for n, t in zip(names, args)]
    E.stamp(model, {"attnexport.module": name, "attnexport.inputs": json.dumps(spec), "attnexport.flavor": flavor,
                  "attnexport.graph_flavor": flavor, "attnexport.opset": str(opset), "attnexport.dtype": dtype,
                  "attnexport.params": json.dumps(entries, sort_keys=True),
                  "attnexport.params_sha256": W.total_sha256(entries),
                  **({"attnexport.seed": str(seed)} if seed is not None else {}),
                  "attnexport.params_source": ("given: " + Path(weights_file).name) if weights_file else "seed"},
          name)
    op_name = E.check_flavor_op(model, flavor, name, applies=routing.calls > 0)
    checked = _check_other_sizes(module, model, names, args, kept, dtype, name)
    version = torch.__version__.split("+")[0]
    semantics = ["fully masked query rows give NaN, as in torch (--nan-rows)"] if nan_rows else \
        [SEMANTICS_NOTE.format(version=version) + " (--nan-rows keeps torch's)"] if torch_nan else []
    notes = semantics if routing.calls else ["no attention call was routed: the module calls neither "
                                                    "scaled_dot_product_attention nor nn.MultiheadAttention "
                                                    "without weights"]
    notes += [f"not routed: {u}" for u in sorted(set(routing.unrouted))]
    static = [f"{n} axis {a}" for n, axes in dims[1].items() for a in axes if a not in kept.get(n, {})]
    if static:
        notes.append(f"fixed by the model (not symbolic): {', '.join(static)}")
    data = model.SerializeToString(deterministic=True)
    path = None
    if output is not None:
        path = Path(output)
        F.atomic_write(path, data)
    return ModuleExportResult(path, name, flavor, opset, dtype, op_name, routing.calls, kept, checked, len(data),
                              notes, model, [o.name for o in model.graph.output])


def call_forward(module, args, name):
    """module(*args); whatever it raises is the user's to read, in one line (a UsageError)."""
    try:
        return module(*args)
    except (ExportError, UsageError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's code
        shapes = ", ".join("x".join(map(str, t.shape)) for t in args)
        raise UsageError(f"{name}: forward raised {type(e).__name__} on inputs of shapes {shapes}: {_line(e)}") \
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
    return None if None in names else names


def _weights_asked(routing, name):
    """A pre-hook that notes an nn.MultiheadAttention asked for its weights: torch computes those
    with its own ops, outside scaled_dot_product_attention, so that call is not routed."""
    def hook(module, args, kwargs):
        need = kwargs.get("need_weights", args[4] if len(args) > 4 else True)
        if need:
            routing.unrouted.append(f"nn.MultiheadAttention {name or '(the module)'} with need_weights=True "
                                    "(torch computes its weights with its own ops)")
    return hook


def _forward_names(module, n):
    import inspect
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(params) >= n:
        return [p.name for p in params[:n]]
    return [f"input_{i}" for i in range(n)]


def _dynamic_shapes(names, args, dynamic):
    """(dynamic_shapes for torch.export, wanted {input: {axis: name}})."""
    import torch
    if dynamic is None:
        wanted = {n: {0: "batch", **({1: f"{n}_len"} if t.dim() >= 2 else {})}
                  for n, t in zip(names, args) if t.dim() >= 2}
        shapes = tuple({a: torch.export.Dim.AUTO for a in wanted.get(n, {})} for n in names)
        return shapes, wanted
    unknown = set(dynamic) - set(names)
    if unknown:
        raise UsageError(f"--dynamic names {', '.join(sorted(unknown))}, not an input (inputs: {', '.join(names)})")
    wanted = {}
    for n, t in zip(names, args):
        for axis, dim in dynamic.get(n, {}).items():
            if not -t.dim() <= axis < t.dim():
                raise UsageError(f"--dynamic {n}:{axis}={dim}: {n} has {t.dim()} axes")
            wanted.setdefault(n, {})[axis % t.dim()] = dim
    dims = {d: torch.export.Dim(d) for axes in wanted.values() for d in axes.values()}
    shapes = tuple({a: dims[d] for a, d in wanted.get(n, {}).items()} for n in names)
    return shapes, wanted


def _name_dims(model, names, wanted):
    """Names the symbolic input axes as asked; returns those that stayed symbolic."""
    kept, renames = {}, {}
    inputs = {i.name: i for i in model.graph.input}
    for n, axes in wanted.items():
        for axis, dim_name in axes.items():
            d = inputs[n].type.tensor_type.shape.dim[axis]
            if d.dim_param:
                dim_name = renames.setdefault(d.dim_param, dim_name)  # a symbol shared by inputs: one name
                d.dim_param = dim_name
                kept.setdefault(n, {})[axis] = dim_name
    from attnexport.export import rename_symbols
    rename_symbols(model, renames)
    return kept


def probe_inputs(args, names, kept, seed):
    """Inputs at other sizes: each symbolic axis 1, and the example's size + 3; floats seeded,
    other inputs filled with the example's most common value (a mask mostly attends)."""
    import torch
    sizes = {}
    for n, t in zip(names, args):
        for axis, d in kept.get(n, {}).items():
            sizes.setdefault(d, t.shape[axis])
    rng = np.random.default_rng(seed)
    out = []
    for variant in ({d: 1 for d in sizes}, {d: s + 3 for d, s in sizes.items()}):
        feed = []
        for n, t in zip(names, args):
            shape = [variant.get(kept.get(n, {}).get(a), s) for a, s in enumerate(t.shape)]
            if t.is_floating_point():
                feed.append(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(t.dtype))
            else:
                feed.append(torch.full(shape, _common_value(t), dtype=t.dtype))
        out.append(tuple(feed))
    return out


def _check_other_sizes(module, model, names, args, kept, dtype, name):
    """Runs the model on ONNX Runtime at other sizes against the module itself; an ExportError
    (nothing written) when they differ."""
    import torch
    from attnexport import runtimes as R
    if not kept:
        return []
    session = R.prepare_onnx("ort-cpu", model)
    tol = tolerance(dtype)
    checked = []
    for feed in probe_inputs(args, names, kept, 1):
        with torch.no_grad():
            want = outputs_of(call_forward(module, feed, name))
        got = session.run({n: t.numpy() for n, t in zip(names, feed)})
        for out_name, w in zip(list(got), want):
            c = compare(out_name, got[out_name], w.float().numpy(), tol)
            if not c:
                sizes = {n: list(t.shape) for n, t in zip(names, feed)}
                raise ExportError(f"{name}: the export differs from the module at {sizes}: {c}")
        checked.append({n: list(t.shape) for n, t in zip(names, feed)})
    return checked



# --- verify ---------------------------------------------------------------------------------------

# The shapes a module's model is checked at besides the export's: (batch, length) of its symbolic
# axes; length 1, odd lengths, batch 1 and 3.
VERIFY_SIZES = ((1, 1), (1, 5), (3, 7))


def verify_module(model_path, spec: str, runtimes: list[str] | None = None, rtol: float | None = None,
                  atol: float | None = None, skip_unavailable: bool = False, *, input_specs=None,
                  seed: int | None = None, weights_file=None):
    """The model file against the torch module it was exported from, at the export's shape and
    at VERIFY_SIZES, on every selected runtime; a `verify.Report` like the golden runs'.

    A model from any exporter (a plain `torch.onnx.export`) works too, given `input_specs`
    (`parse_input` results, in `forward`'s order): its inputs are matched by name, else by order,
    and its symbolic axes are read from the graph. `seed` (default: the one the export recorded,
    else 0) seeds torch while the module is built; `weights_file` loads trained weights.

    The `torch` runtime is the module with its attention calls routed through attnexport's core
    (in eager torch): it shows the core agrees with torch's own kernels on these inputs.
    """
    from attnexport.compare import check_tolerance_values

    check_tolerance_values(rtol, atol)
    with np.errstate(all="ignore"):  # a NaN is reported by the comparison, not by a RuntimeWarning
        return _verify_module(model_path, spec, runtimes, rtol, atol, skip_unavailable, input_specs, seed,
                              weights_file)


def _verify_module(model_path, spec, runtimes, rtol, atol, skip_unavailable, input_specs, seed, weights_file):
    import torch
    from attnexport import runtimes as R
    from attnexport import verify as VF
    from attnexport.compare import compare_outputs
    from attnexport.inspect import load_model

    model = load_model(model_path)
    meta = {p.key: p.value for p in model.metadata_props}
    if "attnexport.variant" in meta:
        raise UsageError(f"{model_path} was exported from the variant {meta['attnexport.variant']!r}, not from a "
                         f"module: verify it without --module (`attnexport verify {model_path}`)")
    spec_inputs = _model_inputs(model, model_path, meta, input_specs)
    dtype = meta.get("attnexport.dtype") or VF.dtype_of(model)
    flavor = meta.get("attnexport.flavor") or VF.flavor_of(model)
    if seed is None:
        seed = int(meta.get("attnexport.seed", 0))
    module, example = load(spec, seed)
    if weights_file is not None:
        load_weights(module, weights_file)
    module = module.to(D.torch_dtype(dtype)).eval()
    names = [i["name"] for i in spec_inputs]
    changed = _changed_params(module, json.loads(meta.get("attnexport.params", "{}")), dtype)
    used, table = R.select(runtimes, skip_unavailable)
    tol = tolerance(dtype, rtol, atol)
    declared = [o.name for o in model.graph.output]
    prepared = {rt: R.prepare_onnx(rt, model) for rt in used if rt in R.ONNX_RUNTIMES}
    rows = []
    for label, feed in _verify_feeds(spec_inputs, example, dtype):
        with torch.no_grad():
            want = outputs_of(call_forward(module, feed, spec))
        if len(want) != len(declared):
            raise UsageError(f"{spec} returns {len(want)} tensor(s), {Path(model_path).name} declares "
                             f"{len(declared)} output(s) ({', '.join(declared)}): it is not this model's module")
        expected = {n: w.detach().double().numpy() for n, w in zip(declared, want)}
        arrays = {n: t.numpy() for n, t in zip(names, feed)}
        for rt in used:
            row = VF.Row(case=label, variant=spec, flavor="-" if rt.startswith("torch") else flavor, runtime=rt,
                         dtype=dtype, model=Path(model_path).name, tolerance=tol,
                         expected_kind="the torch module", inputs=arrays, expected=expected)
            rows.append(row)
            if changed:
                source = meta.get("attnexport.params_source", "seed")
                hint = f"; it was exported with --weights {source[len('given: '):]}" \
                    if source.startswith("given: ") and weights_file is None else ""
                row.error = (f"the module's parameters differ from the model's: {', '.join(changed[:3])} "
                             f"(sha256 in the metadata{hint})")
                continue
            try:
                if rt == "torch":
                    with torch.no_grad(), routed(Routing()):
                        got_t = outputs_of(module(*feed))
                    got = {n: g.detach().double().numpy() for n, g in zip(declared, got_t)}
                elif rt in prepared:
                    got = prepared[rt].run(arrays)
                else:
                    row.skipped = f"{rt} runs no module"
                    continue
            except Exception as e:  # noqa: BLE001 - a runtime failing on the model fails verification
                row.error = f"{type(e).__name__}: {_line(e)}"
                continue
            row.comparisons = compare_outputs(declared, got, expected, tol)
            row.passed = bool(row.comparisons) and all(c.passed for c in row.comparisons)
            if not row.comparisons:
                row.error = "compared nothing: no output was declared or produced"
    return VF.Report(rows, table, dtype, [flavor], [str(model_path)])


_ELEM_NAMES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BOOL: "bool",
               onnx.TensorProto.INT64: "int64", onnx.TensorProto.INT32: "int32"}


def _model_inputs(model, model_path, meta, input_specs) -> list[dict]:
    """The model's inputs as [{name, shape, dtype, dynamic}]: from `--input` (matched with the
    graph's inputs by name, else by order; symbolic axes from the graph), else from the input
    spec an `export --module` recorded."""
    inits = {i.name for i in model.graph.initializer}
    graph = [i for i in model.graph.input if i.name not in inits]
    if input_specs:
        given = [n for n, _, _ in input_specs]
        if len(given) != len(graph):
            raise UsageError(f"{model_path} takes {len(graph)} input(s) ({', '.join(i.name for i in graph)}); "
                             f"--input gives {len(given)}")
        by_name = {i.name: i for i in graph}
        matched = [by_name[n] for n in given] if set(given) == set(by_name) else graph  # by name, else by order
        specs = []
        for (n, shape, dtype), vi in zip(input_specs, matched):
            dims = vi.type.tensor_type.shape.dim
            if len(dims) != len(shape):
                raise UsageError(f"--input {n}: rank {len(shape)}, but {model_path}'s input {vi.name!r} has rank "
                                 f"{len(dims)}")
            want = _ELEM_NAMES.get(vi.type.tensor_type.elem_type)
            if want is not None and want != dtype and not (dtype.startswith("float") and want.startswith("float")):
                raise UsageError(f"--input {n}: {dtype}, but {model_path}'s input {vi.name!r} is {want}")
            for axis, (d, size) in enumerate(zip(dims, shape)):
                if d.HasField("dim_value") and d.dim_value != size:
                    raise UsageError(f"--input {n}: axis {axis} is {size}, {model_path} fixes it at {d.dim_value}")
            specs.append({"name": vi.name, "shape": list(shape), "dtype": want or dtype,
                          "dynamic": {str(a): d.dim_param for a, d in enumerate(dims) if d.dim_param}})
        return specs
    if "attnexport.inputs" not in meta:
        raise UsageError(f"{model_path} records no input spec (it was not exported by `attnexport export --module`): "
                         f"give its inputs, e.g. --input {graph[0].name if graph else 'x'}:2x16x64 (one per input)")
    specs = json.loads(meta["attnexport.inputs"])
    if [i["name"] for i in specs] != [i.name for i in graph]:
        raise UsageError(f"{model_path}: its inputs are not those of its metadata")
    return specs


def _changed_params(module, entries, dtype) -> list[str]:
    """The parameters whose sha256 differs from the model's record (stored as the model holds
    them: a transposed layout is hashed transposed)."""
    state = {k: v.detach().float().numpy().astype(D.NUMPY[dtype]) for k, v in module.state_dict().items()}
    changed = []
    for name, entry in sorted(entries.items()):
        p = state.get(name)
        if p is None or W.sha256_of(p.T if entry["layout"] == "transposed" else p) != entry["sha256"]:
            changed.append(name)
    return changed


def _verify_feeds(spec_inputs, example, dtype):
    """(label, inputs): the export's shape, then VERIFY_SIZES on the symbolic axes."""
    import torch
    rng = np.random.default_rng(0)
    common = {i["name"]: _common_value(t) for i, t in zip(spec_inputs, example or ()) if not t.is_floating_point()}
    feeds = []
    for batch, length in ((None, None), *VERIFY_SIZES):
        feed, label = [], "export shape" if batch is None else f"batch {batch}, length {length}"
        for i in spec_inputs:
            shape = list(i["shape"])
            if batch is not None:
                for axis, dim in i["dynamic"].items():  # a plain export names them s0, s1, ...
                    shape[int(axis)] = batch if dim == "batch" or int(axis) == 0 else length
            if i["dtype"].startswith("float"):
                feed.append(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(D.torch_dtype(dtype)))
            else:
                feed.append(torch.full(shape, common.get(i["name"], True if i["dtype"] == "bool" else 0),
                                       dtype=getattr(torch, i["dtype"])))
        feeds.append((label, tuple(feed)))
    return feeds


# --- bench ------------------------------------------------------------------------------------------

def as_variant(spec: str, module, example_inputs, input_names=None):
    """The module as a variant that `attnexport.bench.bench` times: options `batch` and `seq`
    (axis 0, and axis 1 of every input of rank 2 or more: all lengths take --seq), its own
    export, and FLOPs counted by torch's FlopCounterMode at each shape."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from attnexport import variants as V
    example = tuple(example_inputs)
    names = list(input_names or _forward_names(module, len(example)))
    kinds = {}
    for n, t in zip(names, example):
        if t.is_floating_point():
            kinds[n] = ("float", "data")
        else:
            kinds[n] = ("bool", "true" if _common_value(t) else "false") if t.dtype == torch.bool else \
                (str(t.dtype).replace("torch.", ""), "zeros")

    def inputs(o):
        return tuple(V.TensorSpec(n, tuple("batch" if a == 0 and t.dim() >= 2 else "seq" if a == 1 and t.dim() >= 2
                                           else s for a, s in enumerate(t.shape)), *kinds[n])
                     for n, t in zip(names, example))

    def tensors(o, dtype="fp32"):
        arrays = V.make_inputs(variant, o, 0)
        return tuple(torch.from_numpy(a).to(D.torch_dtype(dtype)) if a.dtype.kind == "f" else torch.from_numpy(a)
                     for a in arrays.values())

    def flops(o):
        counter = FlopCounterMode(display=False)
        param = next(module.parameters(), None)  # inputs in the dtype the bench left the module in
        args = tuple(t.to(param.dtype) if param is not None and t.is_floating_point() else t for t in tensors(o))
        with counter, torch.no_grad():
            module(*args)
        return counter.get_total_flops()

    def export(o, flavor, dtype, params):
        return export_module(module, tensors(o, dtype), flavor=flavor, dtype=dtype, input_names=names, name=spec).model

    b = example[0].shape[0] if example and example[0].dim() >= 2 else 1
    t = example[0].shape[1] if example and example[0].dim() >= 2 else 1
    variant = V.Variant(name=spec, summary="your module", options=(V.Option("batch", int, b, "batch size"),
                                                                     V.Option("seq", int, t, "sequence length")),
                        build=lambda o: module, inputs=inputs,
                        outputs=lambda o: (V.TensorSpec("output", ("batch", "seq"), "float"),),
                        reference=None, flops=flops, dot_product_core=True, dynamic=("batch", "seq"), export=export)
    return variant
