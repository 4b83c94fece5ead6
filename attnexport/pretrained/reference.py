"""The numerics of a whole language model: the same model run in float64 is the reference, and each
output's budget is derived from the error torch's own fp32 forward makes against it.

A single attention op in fp32 is within rtol 1e-4 / atol 1e-5 of its float64 value; thirty layers
of a trained model are not (SmolLM2-135M's logits: 3e-5 to 5e-4 from float64 in torch itself), so
the policy's constants would refuse every correct export of a real model. Here each step is run
three times on the same feed: as exported in torch (fp32, attention through attnexport's core), in
float64 everywhere (`float64_everywhere`: the casts to float32 that transformers' norms, rotary
tables and softmaxes make become float64 too), and on the runtime under test. An output passes when
the runtime's error against float64 is within `compare.derived_tolerance`: FACTOR times torch's
own fp32 error on that output, never below the fp32 policy. Positions that are padding are never
compared (their values are whatever each kernel does with a query that sees no key), and a static
cache's buffers are compared up to where each sequence has written. The caches a checked step
reads come from running the model on token prefixes (real text where the model has a tokenizer),
never from random numbers that no model writes.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import numpy as np
import torch

from attnexport import dtypes as D
from attnexport import modules as M
from attnexport import usage as U
from attnexport.compare import Comparison, Tolerance, compare, derived_tolerance, failed, largest_error, tolerance
from attnexport.pretrained import layers as L
from attnexport.pretrained import model as hf

# Where the budget comes from, said in every report.
BASIS = "torch's {dtype} error against the model in float64"

# Text the checks read when the model has a tokenizer: the prefixes its caches are written from,
# and the sequences the decode property runs over.
PASSAGE = (
    "A lighthouse keeper kept a log of every ship that passed the point, the hour it was seen, the "
    "direction of the wind and the state of the sea. Over forty years the log filled eleven volumes. "
    "When the light was automated, the volumes went to the town library, where a schoolteacher used "
    "them to show her class how the harbour had changed: fewer fishing boats each decade, more "
    "ferries, and in the last years pleasure yachts that came only in summer. The children drew "
    "charts of the traffic and found that storms had grown rarer in spring but stronger in autumn."
)

class _Float64(torch.overrides.TorchFunctionMode):
    """float32 asked for by name (`.float()`, `.to(torch.float32)`, `dtype=torch.float32`) becomes
    float64: what a model computes when nothing in it is rounded to single precision."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_everywhere():
    """Within the block a float64 model computes in float64 throughout: transformers' RMS norms,
    rotary tables and softmaxes cast to float32 on purpose (for fp16 and bf16 models), which in a
    float64 model would round every layer to single precision; here those casts keep float64, and
    tensors made without a dtype are float64."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Float64():
            yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def layers_in_float64(model):
    """Within the block `model` computes in float64 with no float64 copy of it: each module that
    holds parameters or floating buffers of its own is cast to float64 as its forward starts and
    back as it ends (float32 to float64 and back is exact), so at any time one layer's weights are
    held twice (as float64) beside the model, not the whole model. Run it inside
    `float64_everywhere`. A weight read outside its module's forward stays float32: where it meets
    float64 activations an elementwise op promotes it exactly, a matrix product refuses it (loud,
    never a silent float32 computation)."""
    # A large matrix (a vocabulary's embedding and head, an MLP's projections) is not cast whole: its
    # module computes in float64 a block of its rows at a time (`_blockwise`).
    # A module given a forward of its own (`emulate.decoding_from_file`'s) computes in the input's type itself.
    # The float64 rows live in one buffer, reused by every such matrix (`_Rows`): a fresh
    # allocation of each block costs the kernel's page faults on every call, ten times the cast.
    rows = _Rows()
    blockwise = {m: f for m in model.modules() if (f := _blockwise(m, rows)) is not None}
    own = [m for m in model.modules() if m not in blockwise and "forward" not in vars(m) and
           any(t is not None and t.is_floating_point() for t in (*m._parameters.values(), *m._buffers.values()))]
    # What each module held before its forward, put back as it was after it (the float32 storage
    # itself, never a conversion back: within float64_everywhere `.float()` gives float64).
    kept: dict = {}

    def up(module, *_):
        if module in kept:  # called again within its own forward
            return
        params = {n: t.data for n, t in module._parameters.items() if t is not None and t.dtype == torch.float32}
        buffers = {n: b for n, b in module._buffers.items() if b is not None and b.dtype == torch.float32}
        kept[module] = params, buffers
        for n, data in params.items():
            module._parameters[n].data = data.double()
        for n, b in buffers.items():
            module._buffers[n] = b.double()

    def down(module, *_):
        params, buffers = kept.pop(module, ({}, {}))
        for n, data in params.items():
            module._parameters[n].data = data
        for n, b in buffers.items():
            module._buffers[n] = b

    handles = [h for m in own for h in (m.register_forward_pre_hook(up), m.register_forward_hook(down))]
    for m, forward in blockwise.items():
        m.forward = forward  # the instance's own, over its class's until the block ends
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
        for m in own:  # a forward that raised left its module in float64
            down(m)
        for m in blockwise:
            del m.forward


# The float64 rows `_blockwise` casts at a time: a matrix this large or larger is never cast whole.
# 4 MiB: a matrix cast whole is a fresh float64 copy at every forward, which the allocator takes from
# the kernel above a few MiB (an 8 MiB key projection), and a smaller block stays in the cache while
# it is used (the 1.07B fp32 export's three float64 runs: 3.0 s at 32 MiB, 2.2 s at 4 MiB).
BLOCK_BYTES = 1 << 22


class _Rows:
    """One float64 buffer that a block of a matrix's rows is cast into, grown to the largest block
    asked for and reused by every call (within one `layers_in_float64` block)."""

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.float64)

    def cast(self, block: torch.Tensor) -> torch.Tensor:
        """`block` in float64, in the reused buffer (valid until the next call)."""
        if self.buffer.numel() < block.numel():
            self.buffer = torch.empty(block.numel(), dtype=torch.float64)
        return self.buffer[:block.numel()].view(block.shape).copy_(block)


def _blockwise(module, rows: _Rows):
    """For a plain Linear or Embedding whose float32 weight would take BLOCK_BYTES or more in
    float64, a forward that computes what the module computes in float64 without a float64 copy
    of its weight: a Linear's output a block of output features at a time (each from those rows
    of its weight cast into `rows`' buffer), an Embedding's rows gathered in float32 and then
    cast (exact). None for any other module."""
    w = module._parameters.get("weight")
    if "forward" in vars(module) or w is None or w.dtype != torch.float32 or w.ndim != 2 or w.numel() * 8 < BLOCK_BYTES:
        return None
    if type(module) is torch.nn.Embedding and module.max_norm is None:
        def gather(ids):
            return torch.nn.functional.embedding(ids, module.weight, module.padding_idx).double()
        return gather
    if type(module) is torch.nn.Linear:
        step = max(1, BLOCK_BYTES // (w.shape[1] * 8))

        def linear(x):
            weight, bias = module.weight, module.bias
            x = x.double()
            out = x.new_empty((*x.shape[:-1], weight.shape[0]))
            for first in range(0, weight.shape[0], step):
                out[..., first:first + step] = x @ rows.cast(weight[first:first + step]).T
            return out + bias.double() if bias is not None else out
        return linear
    return None


def valid_positions(layout: hf.Layout, feed: dict) -> dict:
    """{output: boolean array broadcastable to it}: the positions a check compares (padding never;
    a static buffer up to each sequence's write_pos + the block): the form's
    (`forms.CacheForm.valid_positions`)."""
    return layout.cache_form.valid_positions(layout, feed)


def _window(array, valid: np.ndarray):
    """`array` cut along its positions (axis 2 of a cache) to the extent of its `valid` mask, where
    the mask is shorter (a static buffer past its furthest written position)."""
    if array.ndim == 4 and valid.ndim == 4 and valid.shape[2] < array.shape[2]:
        return array[:, :, :valid.shape[2]]
    return array


def masked(arrays: dict, valid: dict) -> dict:
    """`arrays` in float64 over the positions compared (a static buffer cut to its written window),
    with those that are not compared within it set to 0."""
    out = {}
    for n, a in arrays.items():
        a = np.asarray(a)
        out[n] = np.where(valid[n], np.asarray(_window(a, valid[n]), np.float64), 0.0) if n in valid else \
            np.asarray(a, np.float64)
    return out


@dataclass
class Expected:
    """What a runtime's outputs of one step are compared with: the float64 model's outputs (the
    positions compared only), each output's budget, the positions compared, and each output's
    whole shape (a static buffer's outputs are its written window; the runtime's must still have
    the model's shape)."""

    outputs: dict
    tolerances: dict
    valid: dict
    shapes: dict
    layers: L.LayerSide | None = None  # each decoder layer's float64 input and output, and its budget

    def compare(self, got: dict, names: list[str]) -> list[Comparison]:
        """Every declared output matched by name and shape, compared over its valid positions with
        its budget."""
        out = []
        for name in names:
            tol = self.tolerances[name]
            shape = tuple(np.shape(got[name])) if name in got else None
            if shape is None:
                out.append(failed(name, "output missing", tol))
            elif shape != self.shapes[name]:
                out.append(failed(name, f"shape {shape} != expected {self.shapes[name]}", tol))
            else:
                out.append(compare(name, masked({name: got[name]}, self.valid)[name], self.outputs[name], tol))
        out += [failed(n, f"unexpected output (the model declares {', '.join(names)})", Tolerance(0, 0))
                for n in got if n not in names]
        return out


def budget(torch_out: np.ndarray, fp64: np.ndarray, dtype: str = "fp32", rtol: float | None = None,
           atol: float | None = None, factor: float | None = None) -> Tolerance:
    """An output's budget: the user's (--rtol/--atol), or derived from the error torch's run in the
    export's dtype makes against float64 (`compare.derived_tolerance`)."""
    if rtol is not None or atol is not None:
        return tolerance(dtype, rtol, atol)
    error = largest_error(torch_out, fp64)
    if error is None:  # no error to derive from: the policy's own
        base = tolerance(dtype)
        return Tolerance(base.rtol, base.atol, f"policy (torch's {dtype} run or the float64 one is not finite)")
    return derived_tolerance(dtype, error, BASIS.format(dtype=dtype), factor)


class Reference:
    """A language model's step graph of `layout` in torch twice: as exported (in the export's
    dtype, its attention through attnexport's core) and in float64 everywhere (the same model, its
    layers cast to float64 one at a time as they run: `layers_in_float64`; `model64` is the model,
    to be called within `in_float64()`).

    Args:
        model: transformers' model, in float32 (kept as it is).
        layout: the step graph's layout.
        dtype: the export's float type (fp32, fp16).
        rtol, atol: the user's budget for every output instead of the derived one.
        factor: the derivation's factor (default compare's for the dtype; a quantized graph's
            float-activation twin takes compare.QUANTIZED_FACTOR).
    """

    def __init__(self, model, layout: hf.Layout, dtype: str = "fp32", rtol: float | None = None,
                 atol: float | None = None, factor: float | None = None):
        self.layout, self.dtype, self.rtol, self.atol, self.factor = layout, dtype, rtol, atol, factor
        self.model = model
        self.torch_dtype = D.torch_dtype(dtype)
        low = model if self.torch_dtype == torch.float32 else copy.deepcopy(model).to(self.torch_dtype)
        self.low = low
        self.step = hf.step_module(low, layout)
        self.model64 = model
        self.step64 = hf.step_module(model, layout)
        self.numpy_dtype = D.NUMPY[dtype]

    @contextlib.contextmanager
    def in_float64(self):
        """The block computes `model64` in float64 throughout (`float64_everywhere`, `layers_in_float64`)."""
        with float64_everywhere(), layers_in_float64(self.model64):
            yield

    def release(self) -> None:
        """Lets the model go (a two-pass verify, its expectations kept: `check.Context.expect`), so
        that its weights are not resident beside the ONNX file's; running the step after is an error."""
        self.model = self.low = self.step = self.model64 = self.step64 = None
        U.give_back()

    def run(self, feed: dict) -> dict:
        """The step in torch as the export computes it (arrays of the export's dtype by output name)."""
        return self._run(self.step, feed, self.torch_dtype, contextlib.nullcontext(),
                         L.counting(self.low, self.layout.layers, f"torch {self.dtype}, layer"))

    def run64(self, feed: dict) -> dict:
        """The step in float64 (float64 arrays by output name)."""
        return self._run(self.step64, feed, torch.float64, self.in_float64(),
                         L.counting(self.model64, self.layout.layers, "torch float64, layer"))

    def _run(self, step, feed: dict, dtype, mode, counting) -> dict:
        """`counting`: each decoder layer's run told to a terminal's bar (`layers.counting`)."""
        args = [torch.from_numpy(np.ascontiguousarray(v)) for v in feed.values()]
        args = [a.to(dtype) if a.is_floating_point() else a for a in args]
        with torch.no_grad(), M.export_semantics(), mode, counting:
            out = M.outputs_of(step(*args))
        return {n: t.detach().numpy() for n, t in zip(self.layout.outputs, out, strict=True)}

    def expect(self, feed: dict, layers: bool = False) -> Expected:
        """The float64 outputs of one step and each output's budget (see the module docstring);
        `layers`: each decoder layer's too (`layers.LayerSide`), where the model has one stack of
        them: its float64 input and output kept from the same run, and its budget derived from
        torch's run of it alone (its input the float64 one)."""
        valid = valid_positions(self.layout, feed)
        window, cut = self._written_window(feed, valid)
        stack = L.decoder_layers(self.model64, self.layout.layers) if layers else None
        ins64: dict = {}
        outs64: dict = {}
        with L.layer_io(stack, ins64, outs64) if stack is not None else contextlib.nullcontext():
            run64 = self.run64(window)
        shapes = {n: cut.get(n, a.shape) for n, a in run64.items()}
        want = masked(run64, valid)
        count = self.layout.layers
        sides = stack is not None and len(outs64) == count and \
            all(t.ndim == 3 for t in (*ins64.values(), *outs64.values()))
        low, outs_low = self._low(window, ins64 if sides else None)
        low = masked(low, valid)
        expected = Expected(want, {n: budget(low[n], want[n], self.dtype, self.rtol, self.atol, self.factor)
                                   for n in want}, valid, shapes)
        if outs_low is not None:
            expected.layers = self._layer_side(outs64, outs_low, valid)
        return expected

    def _low(self, window: dict, ins64: dict | None) -> tuple[dict, dict | None]:
        """(torch's run of the step in the export's dtype, and where `ins64` is given each layer's
        output in that dtype with its input replaced by the float64 one). Both in one run where the
        step's inputs have one batch axis: the feed twice over, the second copy's layers reading the
        float64 inputs (each run reads every weight of the model once: a 1.07B model's three check
        shapes, 1.8 s fewer of them); else two runs."""
        count = self.layout.layers
        replace = {i: ins64[i] for i in range(1, count)} if ins64 is not None else {}
        doubled = _twice(window, self.layout.cache_form.dynamic_axes(self.layout)) if ins64 is not None else None
        if doubled is not None:
            feed2, batch = doubled
            outs: dict = {}
            with L.layer_io(L.decoder_layers(self.low, count), {}, outs, replace=replace, rows=batch):
                both = self.run(feed2)
            if all(a.shape[:1] == (2 * batch,) for a in both.values()):
                return {n: a[:batch] for n, a in both.items()}, {i: t[batch:] for i, t in outs.items()}
        low = self.run(window)
        if ins64 is None:
            return low, None
        outs_low: dict = {}
        with L.layer_io(L.decoder_layers(self.low, count), {}, outs_low, replace=replace):
            self.run(window)
        return low, outs_low

    def _layer_side(self, outs64: dict, outs_low: dict, valid: dict) -> L.LayerSide:
        """Each layer's float64 output, and its budget from torch's run of each layer alone
        in the export's dtype (its input replaced by the float64 one: `outs_low`)."""
        count = self.layout.layers
        outputs = [outs64[i].numpy() for i in range(count)]
        mask = L.valid_mask(valid, self.layout.outputs[0], outputs[0].shape)

        def on(a):
            return a if mask is None else np.where(mask, a, 0.0)
        budgets = [budget(on(outs_low[i].double().numpy()), on(outputs[i]), self.dtype, self.rtol, self.atol,
                          self.factor) for i in range(count)]
        return L.LayerSide(outputs, mask, budgets)

    def _written_window(self, feed: dict, valid: dict) -> tuple[dict, dict]:
        """(the feed the model runs for a check, the whole shape of each output it cuts). A static
        step runs over its buffers cut to the furthest written position: the positions past it are
        masked out of every attention, so the model's outputs over the window are those over the
        whole buffers, and a check at thousands of positions computes and holds a few rows in
        float64. Its presents' whole shapes are their buffers'."""
        return self.layout.cache_form.window(self.layout, feed, valid)



def _twice(feed: dict, axes: dict) -> tuple[dict, int] | None:
    """(`feed` with every input whose axis 0 is the batch given twice over along it, the batch), or
    None where no input has that axis or they disagree on its size."""
    batched = [n for n in feed if axes.get(n, {}).get(0) == "batch"]
    sizes = {np.shape(feed[n])[0] for n in batched}
    if len(sizes) != 1:
        return None
    return {n: np.concatenate([a, a]) if n in batched else a for n, a in feed.items()}, sizes.pop()


# --- what the checks feed ------------------------------------------------------------------------

def token_rows(tokenizer, vocab: int, batch: int, length: int, seed: int) -> np.ndarray:
    """(batch, length) token ids: windows of PASSAGE at seeded offsets where the model has a
    tokenizer, else seeded ids (the first three, special in most vocabularies, left out)."""
    rng = np.random.default_rng(seed)
    if tokenizer is None:
        return rng.integers(min(3, vocab - 1), vocab, (batch, length), dtype=np.int64)
    text = np.asarray(tokenizer(PASSAGE)["input_ids"], np.int64)
    while len(text) < length + batch:
        text = np.concatenate([text, text])
    starts = rng.integers(0, len(text) - length, batch)
    return np.stack([text[s:s + length] for s in starts])


def prefilled_feed(reference: Reference, ids: np.ndarray, past: int, padded: int = 0) -> dict:
    """The feed of one step over ids[:, past:] after a cache the model itself wrote from
    ids[:, :past] (in torch, as the export runs): none: the whole of ids (no cache); concat: the
    past's keys and values, sequence 0's first `padded` positions padding (mask 0, positions
    counting tokens); static: buffers of max_seq positions written up to `past`, write_pos `past`."""
    return reference.layout.cache_form.prefilled_feed(reference.run, reference.layout, ids, past, padded,
                                                      reference.numpy_dtype)
