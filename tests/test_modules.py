"""Users' own modules: the examples in every flavour against the module itself at other shapes,
the command line, and bad input."""

import copy
import json
import textwrap

import numpy as np
import onnx
import pytest
import torch
from conftest import cli as run

from attnexport import export as E
from attnexport import modules as M
from attnexport import runtimes as R
from attnexport.compare import compare, tolerance

EXAMPLES = ["causal_self_attention", "encoder_layer", "cross_attention"]


# Three of the exports are also verified from their files with `verify --module` (each example
# once, in one flavour), sharing the export.
VERIFIED = {("causal_self_attention", "ort"), ("encoder_layer", "attention"), ("cross_attention", "primitives")}


@pytest.mark.parametrize("flavor", ["primitives", "attention", "ort"])
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_exports_and_matches_the_module_at_other_shapes(example, flavor, tmp_path):
    module, inputs = M.load(f"examples/{example}.py:example")
    path = tmp_path / "m.onnx" if (example, flavor) in VERIFIED else None
    result = E.export_module(module, inputs, flavor=flavor, name=f"examples/{example}.py:example", output=path)
    assert result.routed == 1
    # Said only where this torch gives NaN for a fully masked row (2.13 gives zeros, as the export).
    said = any(n.startswith("a fully masked query row gives zeros in the export") for n in result.notes)
    assert said == M.torch_gives_nan_rows("fp32")
    assert result.attention_op == {"primitives": "MatMul+Softmax", "attention": "Attention",
                                   "ort": "com.microsoft.MultiHeadAttention"}[flavor]
    names = list(result.dynamic)
    assert all(axes[0] == "batch" for axes in result.dynamic.values())
    assert len(result.checked) == 2  # length 1, and longer, before anything was written
    # Odd lengths and batch 3 (and 1), on the reference evaluator and ONNX Runtime.
    sessions = {rt: R.prepare_onnx(rt, result.model) for rt in ("ort-cpu", "onnx-ref")}
    for batch, length in ((3, 7), (1, 1), (1, 5)):
        feed = _resized(inputs, result.dynamic, names, batch, length)
        with torch.no_grad():
            want = module(*feed).numpy()
        for rt, session in sessions.items():
            got = session.run({n: t.numpy() for n, t in zip(names, feed, strict=True)})
            c = compare("output", next(iter(got.values())), want, tolerance("fp32"))
            assert c, f"{example} {flavor} {rt} at batch {batch}, length {length}: {c}"
    if path is not None:
        _verify_module_everywhere(path, f"examples/{example}.py:example")


def _resized(inputs, dynamic, names, batch, length):
    """The example's inputs at another batch and length (every symbolic length; masks attend)."""
    rng = np.random.default_rng(batch * 10 + length)
    out = []
    for n, t in zip(names, inputs, strict=True):
        shape = [batch if a == 0 else length if a in dynamic.get(n, {}) else s for a, s in enumerate(t.shape)]
        if t.is_floating_point():
            out.append(torch.from_numpy(rng.standard_normal(shape).astype(np.float32)))
        else:
            out.append(torch.zeros(shape, dtype=t.dtype))  # key padding: True = padding, so none
    return tuple(out)


def test_cli_export_writes_the_model_with_its_metadata(tmp_path):
    path = tmp_path / "block.onnx"
    r = run("export", "--module", "examples/causal_self_attention.py:example", "--flavor", "ort", "-o", path, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["routed"] == 1 and doc["attention_op"] == "com.microsoft.MultiHeadAttention"
    meta = {p.key: p.value for p in onnx.load(path).metadata_props}
    assert set(meta) == {f"attnexport.{k}" for k in ("module", "inputs", "routed", "flavor", "graph_flavor", "opset",
                                                     "dtype", "seed", "params_source", "params", "params_sha256",
                                                     "version", "torch_version", "signature")}
    assert json.loads(meta["attnexport.routed"]) == [
        {"kind": "scaled_dot_product_attention",
         "where": "causal_self_attention.py:25 (y = F.scaled_dot_product_attention(q, k, v, is_causal=True))"}]
    assert meta["attnexport.module"] == "examples/causal_self_attention.py:example"
    assert (meta["attnexport.flavor"], meta["attnexport.opset"], meta["attnexport.dtype"]) == ("ort", "18", "fp32")
    assert (meta["attnexport.seed"], meta["attnexport.params_source"]) == ("0", "seed")
    assert json.loads(meta["attnexport.inputs"])[0] == {"name": "x", "shape": [2, 16, 64], "dtype": "float32",
                                                         "dynamic": {"0": "batch", "1": "x_len"}}
    params = json.loads(meta["attnexport.params"])
    assert set(params) == {"c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"}
    assert all(len(e["sha256"]) == 64 for e in params.values())


def _write(tmp_path, body):
    path = tmp_path / "user.py"
    path.write_text(textwrap.dedent(body))
    return path


GOOD = """
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            q = self.proj(x).unsqueeze(1)
            return F.scaled_dot_product_attention(q, q, q).squeeze(1)

    class NoAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return self.proj(x)

    class Broken(nn.Module):
        def __init__(self):
            raise RuntimeError("no weights here")

    class WithWeights(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            return self.attn(x, x, x)[0]  # need_weights defaults to True
"""


@pytest.mark.parametrize("target, args, text", [
    ("missing.py:Block", ["--input", "x:2x5x8"], "is not a file"),
    ("{file}:Nope", ["--input", "x:2x5x8"], "has no 'Nope' (it defines Block, Broken, NoAttention, WithWeights)"),
    ("{file}:Broken", ["--input", "x:2x5x8"], "Broken() raised RuntimeError: no weights here"),
    ("{file}:Block", [], "give --input NAME:SHAPE"),
    ("{file}:Block", ["--input", "x:2x5x8", "--input", "y:2x5x8"], "2 --input for forward(x), which takes 1"),
    ("{file}:Block", ["--input", "y:2x5x8"], "--input y is not forward's parameter at its place (x)"),
    ("{file}:Block", ["--input", "x:2x5x9"], "forward raised RuntimeError on inputs of shapes 2x5x9"),
    ("{file}:Block", ["--input", "x:2x5x8", "--dynamic", "x:2=width"],
     "--dynamic x:2=width: {file}:Block fixes that axis"),
    ("{file}:Block", ["--input", "x:2x5"], "forward raised RuntimeError on inputs of shapes 2x5"),
    ("{file}:Block", ["--input", "x:2by5"], "the shape is sizes joined by x"),
    ("{file}:Block", ["--input", "x:2x5x8", "--dynamic", "y:1=seq"], "not an input"),
    ("{file}", ["--input", "x:2x5x8"], "--module takes FILE.py:NAME"),
])
def test_bad_module_input_is_one_line_and_exit_2(tmp_path, target, args, text):
    path = _write(tmp_path, GOOD)
    out = tmp_path / "out.onnx"
    r = run("export", "--module", target.format(file=path), *args, "-o", out)
    assert r.exit_code == 2 and text.format(file=path) in r.output and "Traceback" not in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not out.exists()


def test_a_module_without_attention_exports_and_says_so(tmp_path):
    path = _write(tmp_path, GOOD)
    r = run("export", "--module", f"{path}:NoAttention", "--input", "x:2x5x8", "-o", tmp_path / "p.onnx")
    assert r.exit_code == 0, r.output
    assert "0 attention call(s) routed" in r.output and "no attention call was routed" in r.output
    r = run("export", "--module", f"{path}:Block", "--input", "x:2x5x8", "--dynamic", "x:1=seq", "-o",
            tmp_path / "b.onnx")
    assert r.exit_code == 0 and "1 attention call(s) routed" in r.output
    shape = onnx.load(tmp_path / "b.onnx").graph.input[0].type.tensor_type.shape
    dims = [d.dim_param or d.dim_value for d in shape.dim]
    assert dims == [2, "seq", 8]
    # Asked for its weights, nn.MultiheadAttention writes attention out with its own ops: recognized.
    r = run("export", "--module", f"{path}:WithWeights", "--input", "x:2x5x8", "-o", tmp_path / "w.onnx")
    assert r.exit_code == 0 and "1 attention call(s) routed" in r.output, r.output
    assert "routed: hand-written attention at user.py:" in r.output


def _verify_module_everywhere(path, spec):
    """`verify MODEL --module SPEC` passes on every CPU runtime at the export's shape and at others."""
    r = run("verify", path, "--module", spec, "--runtimes", "torch,onnx-ref,ort-cpu", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    rows = doc["results"]
    assert {row["case"] for row in rows} == {"export shape", "batch 1, length 1", "batch 1, length 5",
                                             "batch 3, length 7"}
    assert {row["runtime"] for row in rows} == {"torch", "onnx-ref", "ort-cpu"}
    assert all(row["passed"] and row["outputs"] for row in rows)


def test_verify_module_names_changed_parameters(tmp_path):
    spec = "examples/causal_self_attention.py:example"
    path = tmp_path / "m.onnx"
    assert run("export", "--module", spec, "-o", path).exit_code == 0
    other = tmp_path / "other.py"
    other.write_text("import torch\nimport sys\nsys.path.insert(0, 'examples')\n"
                     "from causal_self_attention import CausalSelfAttention\n\n"
                     "def example():\n    torch.manual_seed(1)\n"
                     "    return CausalSelfAttention(), (torch.randn(2, 16, 64),)\n")
    r = run("verify", path, "--module", f"{other}:example", "--runtimes", "ort-cpu")
    assert r.exit_code == 1 and "the module's parameters differ from the model's: c_attn.bias" in r.output
    r = run("verify", path, path, "--module", spec)
    assert r.exit_code == 2 and "give one MODEL" in r.output


def test_bench_module_times_it_beside_torch(tmp_path):
    r = run("bench", "--module", "examples/cross_attention.py:example", "--batch", "2", "--seq", "8,12",
            "--runtimes", "torch,ort-cpu", "--flavor", "attention", "--warmup", "1", "--iters", "2", "--repeat", "2",
            "--threads", "1", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert {(row["runtime"], row["flavor"], row["shape"]["seq"]) for row in rows} == \
        {(rt, f, s) for rt, f in (("torch", "-"), ("ort-cpu", "attention")) for s in (8, 12)}
    for row in rows:
        assert row["variant"] == "examples/cross_attention.py:example"
        assert row["max_abs_err"] < 1e-4 and row["tflops"] > 0 and 0 < row["peak_fraction"] <= 1
    r = run("bench", "--module", "examples/cross_attention.py:example", "--decode", "--context", "8")
    assert r.exit_code == 2 and "--module takes --batch and --seq" in r.output
    r = run("bench", "--variant", "mha", "--module", "examples/cross_attention.py:example")
    assert r.exit_code == 2 and "one of them" in r.output


@pytest.mark.parametrize("nan", [True, False])
def test_fully_masked_rows_agree_with_this_torch_or_nan_rows_keeps_its_nan(nan, monkeypatch):
    """A memory that is all padding. Where torch gives NaN there (releases before 2.13), --nan-rows
    (primitives only) keeps it; where it gives zeros (2.13), so does the export, and --nan-rows
    says there is nothing to keep. Both branches run on any torch (the detection monkeypatched);
    either way the graph without the guard gives NaN."""
    from attnexport.onnx_attention import torch_dead_rows
    this_torch_nan = M.torch_gives_nan_rows("fp32")
    monkeypatch.setattr(M, "torch_gives_nan_rows", lambda dtype: nan)
    module, example = M.load("examples/cross_attention.py:example")
    target, memory, padding = example
    padding = padding.clone()
    padding[1] = True  # the second sequence's memory is all padding (the export's example has none)
    with torch.no_grad():
        want = module(target, memory, padding).numpy()
    feed = {"target": target.numpy(), "memory": memory.numpy(), "memory_padding": padding.numpy()}
    default = E.export_module(module, example, flavor="primitives")
    got = R.prepare_onnx("ort-cpu", default.model).run(feed)["output"]
    assert not np.isnan(got).any()
    compared = want if not this_torch_nan else want[:1]  # this torch's own NaN rows are not compared
    assert compare("output", got[:len(compared)], compared, tolerance("fp32"))
    if nan:
        kept = E.export_module(module, example, flavor="primitives", nan_rows=True)
        got = R.prepare_onnx("ort-cpu", kept.model).run(feed)["output"]
        assert np.isnan(got[1]).all() and not np.isnan(got[0]).any()  # NaN where torch < 2.13 has it
        assert compare("output", got[:1], want[:1], tolerance("fp32"))
        with pytest.raises(M.UsageError, match="needs --flavor primitives"):
            E.export_module(module, example, flavor="attention", nan_rows=True)
    else:
        with pytest.raises(M.UsageError, match="there is no NaN to keep"):
            E.export_module(module, example, flavor="primitives", nan_rows=True)
    with torch_dead_rows():  # what --nan-rows exports: the softmax alone, NaN for that sequence
        unguarded = E.export_module(module, example, flavor="primitives")
    got = R.prepare_onnx("ort-cpu", unguarded.model).run(feed)["output"]
    assert np.isnan(got[1]).all() and not np.isnan(got[0]).any()


@pytest.mark.parametrize("nan", [True, False])
def test_the_semantics_note_on_either_torch(nan, monkeypatch):
    """Both branches of the torch-version check run on any torch: an older torch (NaN for a fully
    masked row, before 2.13) gets the note, a newer one none."""
    monkeypatch.setattr(M, "torch_gives_nan_rows", lambda dtype: nan)
    module, inputs = M.load("examples/causal_self_attention.py:example")
    result = E.export_module(module, inputs, flavor="attention")
    notes = [n for n in result.notes if n.startswith("a fully masked query row gives zeros in the export")]
    assert len(notes) == int(nan)
    if nan:
        assert notes[0].endswith("(--nan-rows keeps torch's)") and "torch 2." in notes[0]


def test_the_api_at_the_package_top(tmp_path):
    import attnexport
    module, _ = M.load(f"{_write(tmp_path, GOOD)}:Block")
    result = attnexport.export_module(module, (torch.randn(2, 5, 8),), flavor="ort", output=tmp_path / "b.onnx")
    assert result.routed == 1 and result.attention_op == "com.microsoft.MultiHeadAttention"
    assert (tmp_path / "b.onnx").stat().st_size == result.size
    module.train()
    half = attnexport.export_module(module, (torch.randn(2, 5, 8),), flavor="primitives", dtype="fp16")
    assert half.dtype == "fp16" and half.model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    # The caller's module is left as it was: its dtype and its training mode.
    assert module.training and all(p.dtype == torch.float32 for p in module.parameters())


PLAIN = """
import torch
from torch import nn
import torch.nn.functional as F


class Plain(nn.Module):  # no seed anywhere: its weights come from torch's generator
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, 16))


class Raises(Plain):
    def forward(self, x):
        raise ValueError("not today")
"""


def test_a_class_without_a_seed_is_seeded_and_exports_the_same_bytes(tmp_path):
    spec = f"{_write(tmp_path, PLAIN)}:Plain"
    a, b, c = tmp_path / "a.onnx", tmp_path / "b.onnx", tmp_path / "c.onnx"
    for path, seed in ((a, "0"), (b, "0"), (c, "7")):
        r = run("export", "--module", spec, "--input", "x:2x6x16", "--seed", seed, "-o", path)
        assert r.exit_code == 0, r.output
        assert r.output.endswith("KiB\n")  # the one size unit of every export
    assert a.read_bytes() == b.read_bytes() and a.read_bytes() != c.read_bytes()
    meta = {p.key: p.value for p in onnx.load(c).metadata_props}
    assert meta["attnexport.seed"] == "7" and meta["attnexport.params_source"] == "seed"
    assert [o.name for o in onnx.load(a).graph.output] == ["output"]
    # verify takes the recorded seed; a contradicting one builds other weights and fails.
    assert run("verify", c, "--module", spec, "--runtimes", "ort-cpu").exit_code == 0
    r = run("verify", c, "--module", spec, "--runtimes", "ort-cpu", "--seed", "0")
    assert r.exit_code == 1 and "the module's parameters differ from the model's" in r.output


def test_trained_weights_from_a_state_dict_or_safetensors(tmp_path):
    from safetensors.torch import save_file
    spec = f"{_write(tmp_path, PLAIN)}:Plain"
    module, _ = M.load(spec, seed=123)
    torch.save(module.state_dict(), tmp_path / "w.pt")
    save_file(module.state_dict(), str(tmp_path / "w.safetensors"))
    for weights in ("w.pt", "w.safetensors"):
        path = tmp_path / f"{weights}.onnx"
        r = run("export", "--module", spec, "--input", "x:2x6x16", "--weights", tmp_path / weights, "-o", path)
        assert r.exit_code == 0, r.output
        meta = {p.key: p.value for p in onnx.load(path).metadata_props}
        assert meta["attnexport.params_source"] == f"given: {weights}"
        r = run("verify", path, "--module", spec, "--weights", tmp_path / weights, "--runtimes", "torch,ort-cpu")
        assert r.exit_code == 0, r.output
        r = run("verify", path, "--module", spec, "--runtimes", "ort-cpu")  # the seeded weights are not these
        assert r.exit_code == 1 and f"it was exported with --weights {weights}" in r.output
    state = module.state_dict()
    bad = {"extra.pt": {**state, "extra": torch.zeros(1)},
           "short.pt": {k: v for k, v in state.items() if k != "qkv.bias"},
           "shape.pt": {**state, "proj.weight": torch.zeros(3, 3)}}
    for name, sd in bad.items():
        torch.save(sd, tmp_path / name)
    (tmp_path / "junk.pt").write_text("junk")
    for name, text in (("extra.pt", "does not fit the module: extra extra"),
                       ("short.pt", "does not fit the module: missing qkv.bias"),
                       ("shape.pt", "mis-shaped proj.weight [3, 3] (the module's: [16, 16])"),
                       ("junk.pt", "cannot be read as a state_dict"), ("none.pt", "no such file")):
        r = run("export", "--module", spec, "--input", "x:2x6x16", "--weights", tmp_path / name,
                "-o", tmp_path / "x.onnx")
        assert r.exit_code == 2 and text in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "x.onnx").exists()


def test_verify_a_plain_torch_onnx_export_with_external_data_from_another_folder(tmp_path, monkeypatch):
    """A model from torch.onnx.export (its weights in model.onnx.data) is verified against its
    module given --input, from any working folder; its inputs are matched by name, else order."""
    spec = f"{_write(tmp_path, PLAIN)}:Plain"
    module, _ = M.load(spec, seed=0)
    (tmp_path / "out").mkdir()
    path = tmp_path / "out" / "plain.onnx"
    batch, length = torch.export.Dim("b"), torch.export.Dim("t")
    with torch.no_grad():
        torch.onnx.export(module.eval(), (torch.randn(2, 6, 16),), str(path), dynamo=True, input_names=["x"],
                          dynamic_shapes=({0: batch, 1: length},), external_data=True, verbose=False)
    assert (tmp_path / "out" / "plain.onnx.data").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = run("verify", path, "--module", spec, "--runtimes", "torch,onnx-ref,ort-cpu")
    assert r.exit_code == 2 and "give its inputs, e.g. --input x:" in r.output
    other = tmp_path / "out" / "other.onnx"  # the same module, its input named by another exporter
    with torch.no_grad():
        torch.onnx.export(module.eval(), (torch.randn(2, 6, 16),), str(other), dynamo=True, input_names=["input_0"],
                          dynamic_shapes=({0: batch, 1: length},), verbose=False)
    for model in (path, other):  # by name, then by order
        r = run("verify", model, "--module", spec, "--input", "x:2x6x16", "--runtimes", "torch,onnx-ref,ort-cpu",
                "--json")
        assert r.exit_code == 0, r.output
        doc = json.loads(r.output)
        assert len(doc["results"]) == 12 and all(row["passed"] for row in doc["results"])
        assert all(row["median_ms"] > 0 for row in doc["results"])  # each run timed
    r = run("verify", path, "--module", spec, "--input", "tokens:2x6x16", "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and "--input tokens is not forward's parameter at its place (x)" in r.output
    assert run("inspect", path).exit_code == 0
    r = run("verify", path, "--module", spec, "--input", "x:2x6", "--runtimes", "ort-cpu")
    assert r.exit_code == 2 and "rank 2" in r.output


def test_verify_module_bad_input_is_one_line(tmp_path):
    spec = f"{_write(tmp_path, PLAIN)}"
    path = tmp_path / "m.onnx"
    assert run("export", "--module", f"{spec}:Plain", "--input", "x:2x6x16", "-o", path).exit_code == 0
    cross = tmp_path / "cross.onnx"
    assert run("export", "--variant", "cross", "-o", cross).exit_code == 0
    for args, text in (([path, "--module", f"{spec}:Raises"], "forward raised ValueError on inputs of shapes"),
                       ([cross, "--module", "examples/encoder_layer.py:example"],
                        "was exported from the variant 'cross', not from a module: verify it without --module"),
                       ([path, "--module", f"{spec}:Plain", "--heads", "2"], "--module takes no --variant")):
        r = run("verify", *args, "--runtimes", "ort-cpu")
        assert r.exit_code == 2 and text in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_module_torch_cannot_export_is_an_export_error_in_one_line(tmp_path):
    """The same failure kind as for a variant: torch.export or torch.onnx refusing the module is
    an ExportError (exit 1) naming it, with torch's reason, and nothing is written."""
    source = """
import torch


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on values: torch.export cannot trace it
            return torch.nn.functional.scaled_dot_product_attention(x, x, x)
        return x
"""
    spec = f"{_write(tmp_path, source)}:DataDependent"
    out = tmp_path / "dd.onnx"
    r = run("export", "--module", spec, "--input", "x:2x4x8", "-o", out)
    assert r.exit_code == 1 and f"torch.onnx could not export {spec}:" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output and not out.exists()


def test_rotary_embeddings_export_fused_and_run_at_every_batch(tmp_path):
    """transformers' rotary form (cos and sin of batch 1) is fused into RotaryEmbedding at opset
    23; the operator takes them per sequence, so the export expands them to the batch (ONNX
    Runtime refused batch 1 for batch 2 before): the check at other sizes passes, and so does
    every CPU runtime at batch 3."""
    module, inputs = M.load("examples/rotary_attention.py:example")
    result = E.export_module(module, inputs, flavor="attention", name="rotary")
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("RotaryEmbedding") == 2 and "Attention" in ops
    assert result.checked  # batch 1 and 5, lengths 1 and 9, before anything was written
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        want = module(x).numpy()
    for rt in ("ort-cpu", "onnx-ref"):
        got = R.prepare_onnx(rt, result.model).run({"x": x.numpy()})["output"]
        assert compare("output", got, want, tolerance("fp32")), rt


def test_a_model_onnx_runtime_cannot_run_at_other_sizes_is_one_line_and_exit_2(tmp_path, monkeypatch):
    from attnexport import runtimes as RT

    class Refusing:
        def run(self, feed):
            raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : shapes differ\nmore lines")
    monkeypatch.setattr(RT, "prepare_onnx", lambda name, model, **kw: Refusing())
    r = run("export", "--module", "examples/causal_self_attention.py:example", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 2 and not (tmp_path / "m.onnx").exists()
    line = r.output.strip()
    assert "\n" not in line and "does not run at" in line and "INVALID_ARGUMENT : shapes differ" in line, line


def test_verify_module_draws_real_padding_and_a_fully_padded_sequence(tmp_path):
    """At every shape the padding mask pads (its example's two values: False = token for a key
    padding mask), the last of several sequences entirely; where torch's own kernels give NaN for
    that sequence, the expected values are the module's with its attention routed through the
    core (zeros there, as the export), and every runtime passes."""
    from attnexport import verify as VF
    path = tmp_path / "enc.onnx"
    E.export_module(*M.load("examples/encoder_layer.py:example"), flavor="attention", output=path,
                    name="examples/encoder_layer.py:example")
    report = VF.verify_module(path, "examples/encoder_layer.py:example", ["torch", "ort-cpu"])
    assert report.ok, "\n".join(r.describe() for r in report.failures)
    rows = {r.case: r for r in report.rows if r.runtime == "ort-cpu"}
    mask = next(v for k, v in rows["batch 3, length 7"].inputs.items() if v.dtype == np.bool_)
    assert mask.shape == (3, 7) and mask[-1].all() and not mask[0, 0]  # True = padding; the last all padding
    assert rows["batch 3, length 7"].expected_kind.startswith("the torch module, its attention routed")
    assert rows["batch 1, length 5"].expected_kind == "the torch module"


TIED = """
import torch
from torch import nn

class Padded(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x, mask):
        return self.attn(x, x, x, key_padding_mask=mask == 0, need_weights=False)[0]

def example():
    mask = torch.ones(2, 5, dtype=torch.int64)
    mask[1, 3:] = 0
    return Padded(), (torch.randn(2, 5, 8), mask)
"""


def test_inputs_the_program_needs_equal_share_one_symbol_and_inspect_shows_the_calls(tmp_path):
    """x's length and the mask's are one in the traced program: one symbol in the model, so that a
    deployment app reads from the file that they must be fed equal. inspect shows the module's
    inputs with their symbolic axes and where each attention call was routed."""
    path = _write(tmp_path, TIED)
    out = tmp_path / "tied.onnx"
    r = run("export", "--module", f"{path}:example", "-o", out)
    assert r.exit_code == 0, r.output
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in onnx.load(out).graph.input]
    assert dims == [["batch", "x_len", 8], ["batch", "x_len"]]
    r = run("inspect", out)
    text = " ".join(r.output.split())
    assert "inputs: x 2x5x8 float32, axis 0 batch, axis 1 x_len; mask 2x5 int64, axis 0 batch, axis 1 x_len" in text
    assert "routed: 1 attention call(s); scaled_dot_product_attention at" in text


def test_an_fp16_export_is_compared_with_the_module_in_float32():
    """modules.expected_of: fp32 gives the module's own outputs under the policy; fp16 gives the
    module run in float32 on its (fp16) parameters and inputs, with a tolerance of 4x the error
    torch's fp16 run makes against it, and leaves the module as it was."""
    from attnexport.compare import TOLERANCES
    torch.manual_seed(0)
    module = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))
                                   for _ in range(4)]).eval()
    feed = (torch.randn(3, 5, 32),)
    want, tol = M.expected_of(module, feed, "m", "fp32", lambda m, f: m(*f))
    # the module's own outputs (run again here: close, not bitwise, as two runs of a kernel need not be)
    assert tol == TOLERANCES["fp32"]
    torch.testing.assert_close(want[0], module(*feed).detach().double(), rtol=1e-6, atol=1e-7)
    half = module.half()
    before = {k: v.clone() for k, v in half.state_dict().items()}
    feed16 = (feed[0].half(),)
    want, tol = M.expected_of(half, feed16, "m", "fp16", lambda m, f: m(*f))
    assert all(v.dtype == torch.float16 and torch.equal(v, before[k]) for k, v in half.state_dict().items())
    single = copy.deepcopy(half).float()(feed16[0].float()).detach().double()
    assert torch.allclose(want[0], single, rtol=0, atol=1e-6)
    with torch.no_grad():
        err = float((half(feed16[0]).double() - single).abs().max())
    assert err > 0 and tol.atol == pytest.approx(max(TOLERANCES["fp16"].atol, 4 * err))
    assert tol.basis.startswith("torch's fp16 error against the module in fp32")


def test_the_rotary_example_exports_in_fp16():
    module, inputs = M.load("examples/rotary_attention.py:example")
    result = E.export_module(module, inputs, flavor="attention", dtype="fp16")
    assert result.routed == 1 and len(result.checked) == 2


def test_a_module_file_imports_its_sibling(tmp_path):
    """As `python user.py` would: the file's folder is on the import path while it loads (and
    while NAME runs), and is taken off again."""
    import sys
    (tmp_path / "user_helpers.py").write_text("import torch\n\ndef width():\n    return 8\n")
    path = _write(tmp_path, """
        import torch
        import torch.nn.functional as F
        from torch import nn
        from user_helpers import width


        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(width(), width())

            def forward(self, x):
                q = self.proj(x)
                return F.scaled_dot_product_attention(q, x, x)
    """)
    r = run("export", "--module", f"{path}:Block", "--input", "x:2x5x8", "-o", tmp_path / "b.onnx")
    assert r.exit_code == 0, r.output
    assert str(tmp_path) not in sys.path


def test_output_names_must_name_every_output(tmp_path):
    path = _write(tmp_path, GOOD)
    r = run("export", "--module", f"{path}:Block", "--input", "x:2x5x8", "--output-names", "a,b,c",
            "-o", tmp_path / "o.onnx")
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1
    assert "--output-names gives 3 name(s) (a, b, c);" in r.output and "returns 1 output(s)" in r.output
    assert not (tmp_path / "o.onnx").exists()
    r = run("export", "--module", f"{path}:Block", "--input", "x:2x5x8", "--output-names", "y",
            "-o", tmp_path / "o.onnx")
    assert r.exit_code == 0, r.output
    assert [o.name for o in onnx.load(tmp_path / "o.onnx").graph.output] == ["y"]


def test_scoped_semantics_restore_what_they_found():
    """`torch_dead_rows` and `reference.rounded_to` hold their setting for their block only and give
    back the one they found, nested too (an inner block once reset zeroed dead rows to on inside an
    outer one that had them off)."""
    from attnexport import reference as ref
    from attnexport.onnx_attention import _needs_guard, torch_dead_rows
    mask = object()
    with torch_dead_rows():
        with torch_dead_rows():
            assert not _needs_guard(mask, None)
        assert not _needs_guard(mask, None)
    assert _needs_guard(mask, None)
    third = np.array(1 / 3)
    with ref.rounded_to(np.float16):
        with ref.rounded_to(np.float32):
            assert ref._r(third) == np.float64(np.float32(1 / 3))
        assert ref._r(third) == np.float64(np.float16(1 / 3))
    assert ref._r(third) == 1 / 3


def test_strict_placement_fails_a_modules_rows_that_left_nodes_on_the_cpu(tmp_path, monkeypatch):
    """verify --module --strict-placement judges a module's rows as the golden rows are judged: on
    a runtime whose line says it is accelerated, compute nodes on the CPU fail the row. (The CPU
    provider's line is marked accelerated here, so every compute node counts as left behind.)"""
    import dataclasses

    from attnexport import runtimes as R
    path = tmp_path / "block.onnx"
    spec = "examples/kv_cache_module.py:example"
    cache = ["--cache", "past_key:present_key", "--cache", "past_value:present_value"]
    assert run("export", "--module", spec, *cache, "-o", path).exit_code == 0
    monkeypatch.setitem(R.REGISTRY, "ort-cpu", dataclasses.replace(R.REGISTRY["ort-cpu"], accelerated=True))
    args = ["verify", path, "--module", spec, "--runtimes", "ort-cpu", "--json"]
    loose = json.loads(run(*args).output)["results"]
    assert all(r["passed"] and r["cpu_nodes"] for r in loose)  # reported, not failed
    r = run(*args, "--strict-placement")
    strict = json.loads(r.output)["results"]
    assert r.exit_code == 1 and len(strict) == len(loose) and any(x["case"].startswith("decode") for x in strict)
    assert all(not x["passed"] and "ran on the CPU" in x["error"] for x in strict)
