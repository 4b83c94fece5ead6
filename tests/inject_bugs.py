"""The injected-bug check: one plausible bug at a time in a copy of the checkout, and the tests
that must catch it (see tests/README.md). Not a test itself (pytest does not collect it); run it
from the checkout with the project's Python: `python tests/inject_bugs.py [NAME ...]`."""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

BUGS = [
    ("dropped scale (primitives scores unscaled)",
     [("attnexport/onnx_attention.py", "    return op.Mul(scores, _const(scale, scores))", "    return scores")], False,
     ["tests/test_export.py", "-k", "fp32_matches or static_scale"]),
    ("causal mask not offset by the cache",
     [("attnexport/models/core.py", "            rows = rows + past", "            rows = rows")], False,
     ["tests/test_models.py", "tests/test_decode.py"]),
    ("hand-written attention routed without its scale",
     [("attnexport/recognize.py", "                scale *= n if t is aten.mul.Tensor else 1.0 / n",
       "                scale *= 1.0")], False,
     ["tests/test_recognize.py"]),
    ("static cache reads the whole buffer",
     [("attnexport/models/multi_head.py", "        valid = valid_keys(write_pos, x.shape[1])",
       "        valid = write_pos * 0 + key_cache.shape[2]")], False,
     ["tests/test_models.py", "tests/test_decode.py", "tests/test_verify.py", "-k", "static or mha"]),
    ("verify skips the weights output",
     [("attnexport/verify.py",
       'declared = ["output"] if step.decode_chunk else [s.name for s in variant.outputs(case.options)]',
       'declared = ["output"] if step.decode_chunk else '
       '[s.name for s in variant.outputs(case.options) if s.name != "weights"]')], False,
     ["tests/test_verify.py", "-k", "wrong_value"]),
    ("verify compares the first output only",
     [("attnexport/verify.py",
       'declared = ["output"] if step.decode_chunk else [s.name for s in variant.outputs(case.options)]',
       'declared = ["output"] if step.decode_chunk else [s.name for s in variant.outputs(case.options)][:1]')],
     False, ["tests/test_verify.py", "-k", "wrong_value"]),
    ("FP16_FACTOR 4 -> 400", [("attnexport/compare.py", "FP16_FACTOR = 4.0", "FP16_FACTOR = 400.0")], False,
     ["tests/test_compare.py"]),
    ("fp32 atol 1e-5 -> 1e-3",
     [("attnexport/compare.py", '"fp32": Tolerance(rtol=1e-4, atol=1e-5)', '"fp32": Tolerance(rtol=1e-4, atol=1e-3)')],
     False, ["tests/test_compare.py"]),
    ("mha FLOPs: attention term halved",
     [("attnexport/variants.py", "    return proj + 2 * B * H * Tq * Tk * 2 * hd",
       "    return proj + B * H * Tq * Tk * 2 * hd")], False,
     ["tests/test_variants.py", "tests/test_bench.py"]),
    ("mha-tied scaled by 1/sqrt(head size) in module and reference, golden rewritten",
     [("attnexport/models/multi_head.py", "self.scale = 1.0 / math.sqrt(dim)",
       "self.scale = 1.0 / math.sqrt(dim // heads)"),
      ("attnexport/reference.py", "scale=1.0 / np.sqrt(E))", "scale=1.0 / np.sqrt(E // h))")], True,
     ["tests/test_oracles.py", "tests/test_models.py", "tests/test_golden.py"]),
    ("a whole model's budget factor 4 -> 400",
     [("attnexport/compare.py", "FP32_FACTOR = 4.0", "FP32_FACTOR = 400.0")], False,
     ["tests/test_hf_reference.py"]),
    ("a whole model's padding compared",
     [("attnexport/hf_reference.py", '    mask = np.asarray(feed["attention_mask"]).astype(bool)  # (B, past + T)',
       '    mask = np.ones_like(np.asarray(feed["attention_mask"]), bool)  # (B, past + T)')], False,
     ["tests/test_hf_reference.py", "tests/test_real_models.py"]),
    ("a whole model's float64 reference rounded to float32 inside (the casts kept)",
     [("attnexport/hf_reference.py", "        if func is torch.Tensor.float:\n            func = torch.Tensor.double\n",
       "")], False, ["tests/test_hf_reference.py"]),
    ("kernel weights softmax(-d^2) in module and reference, golden rewritten",
     [("attnexport/models/kernel.py", "torch.softmax(-(diff * diff) / 2, dim=-1)",
       "torch.softmax(-(diff * diff), dim=-1)"),
      ("attnexport/reference.py", "w = softmax_rows(_r(-(d**2) / 2))", "w = softmax_rows(_r(-(d**2)))")], True,
     ["tests/test_oracles.py", "tests/test_models.py", "tests/test_golden.py"]),
]
src = pathlib.Path(__file__).resolve().parent.parent
py = sys.executable
results = []
only = sys.argv[1:]
for name, edits, rewrite, tests in BUGS:
    if only and not any(o in name for o in only):
        continue
    dst = pathlib.Path(tempfile.mkdtemp(prefix="attnexport-inject-")) / "checkout"
    def ignore(folder, names):
        skip = {".git", ".venv", ".ci-venv", "__pycache__"} | ({"models"} if pathlib.Path(folder) == src else set())
        return [n for n in names if n in skip]
    shutil.copytree(src, dst, ignore=ignore)
    for f, old, new in edits:
        p = dst / f
        text = p.read_text()
        assert old in text, (name, f, old)
        p.write_text(text.replace(old, new))
    env = dict(os.environ, PYTHONPATH=str(dst))
    if rewrite:
        subprocess.run([py, "-m", "attnexport", "golden", "--write", "--dir", "golden"], cwd=dst, env=env, check=True,
                       capture_output=True)
    r = subprocess.run([py, "-m", "pytest", "-q", "-n", "2", "-p", "no:logging", *tests], cwd=dst, env=env,
                       capture_output=True, text=True)
    failed = [line.split(" - ")[0].replace("FAILED ", "") for line in r.stdout.splitlines()
              if line.startswith("FAILED")]
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
    results.append((name, r.returncode, failed, last))
    print(f"{name}: rc={r.returncode} {last}", flush=True)
    for f in failed[:4]:
        print("   caught by", f, flush=True)
    shutil.rmtree(dst.parent, ignore_errors=True)
missed = [name for name, rc, _, _ in results if rc == 0]
print("every bug was caught" if not missed else f"NOT caught: {', '.join(missed)}")
sys.exit(1 if missed else 0)
