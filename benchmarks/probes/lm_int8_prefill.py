"""Whether the integer int8 form (DynamicQuantizeMatMul: int8 weights per column, the input rounded to
uint8 per tensor) pays for a language model at prefill shapes, where its many rows are what integer
GEMM is for: SmolLM2-135M's full-sequence graph (no cache) in fp32, in the blockwise int8 form
(MatMulNBits, `export --precision int8 --requantize`: ONNX Runtime's own rounding, not the GGUF
file's grid carried) and in the integer form (the fp32 graph quantized here, `precision.quantize`
with `kernel="integer"`), every matrix as it is and as `calibrate.choose` smooths them on the
first `CALIBRATION_TOKENS` tokens of `accuracy.HELD_OUT` (the cost: mean KL of the logits against
the model's own; the target a quarter of the int8 budget's 0.05); each timed on a prefill of
`SEQS` tokens (2 threads, sessions not spinning, the forms in turns, rounds of `ITERS`), and its
cost against fp32's logits teacher-forced over `accuracy.EVAL_TEXT` (mean KL, top-1), which the
calibration never reads.

    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf -o fp32.onnx
    attnexport export --hf SmolLM2-135M-Instruct.Q4_1.gguf -o int8b.onnx --precision int8 --requantize
    python benchmarks/probes/lm_int8_prefill.py SmolLM2-135M-Instruct.Q4_1.gguf fp32.onnx int8b.onnx OUT.json
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from attnexport.pretrained import calibrate
from attnexport.pretrained import model as hf
from attnexport.pretrained import precision as P
from attnexport.pretrained.causal import accuracy

SEQS, ROUNDS, ITERS, THREADS = (128, 512), 3, 5, 2
CALIBRATION_TOKENS, TARGET = 128, 0.25 * 0.05


def session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def feed(ids: np.ndarray) -> dict:
    n = ids.shape[1]
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(n)[None].astype(np.int64)}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def calibrated(graph: onnx.ModelProto, source, tokenizer) -> tuple[P.Calibration, float]:
    """`calibrate.choose` on the no-cache step of `source` (the module `graph` was exported from)."""
    model, _ = hf.load(source, 0)
    layout = hf.layout_of(model, None, 0, source)
    ids = np.asarray([tokenizer(accuracy.HELD_OUT)["input_ids"][:CALIBRATION_TOKENS]], np.int64)

    def cost(want: list[dict], got: list[dict]) -> float:
        a, b = log_softmax(want[0]["logits"][0]), log_softmax(got[0]["logits"][0])
        kl = float((np.exp(a) * (a - b)).sum(-1).mean())
        return kl if np.isfinite(kl) else float("inf")
    start = time.perf_counter()
    chosen = calibrate.choose(hf.step_module(model, layout), graph, P.sites(graph, layout.vocab, attention=True),
                              [feed(ids)], layout.outputs, cost, TARGET)
    return chosen, time.perf_counter() - start


def main() -> None:
    source, fp32, blockwise, out = sys.argv[1:]
    model, _ = hf.load(source, 0)
    config = model.config
    tokenizer = hf.tokenizer_of(source)
    del model
    plan = P.plan_for("int8", kernel="integer")
    with tempfile.TemporaryDirectory() as tmp:
        graph = onnx.load(fp32)
        done = P.quantize(graph, plan, config.num_hidden_layers, config.vocab_size)
        integer = str(Path(tmp) / "integer.onnx")
        onnx.save(graph, integer)
        graph = onnx.load(fp32)
        chosen, seconds = calibrated(graph, source, tokenizer)
        smoothed = P.quantize(graph, plan, config.num_hidden_layers, config.vocab_size, calibration=chosen)
        integer_calibrated = str(Path(tmp) / "integer-calibrated.onnx")
        onnx.save(graph, integer_calibrated)
        del graph
        forms = {"fp32": session(fp32), "int8 blockwise": session(blockwise), "int8 integer": session(integer),
                 "int8 integer calibrated": session(integer_calibrated)}
        ids = np.asarray([tokenizer(accuracy.EVAL_TEXT)["input_ids"]], np.int64)
        want = log_softmax(forms["fp32"].run(None, feed(ids))[0][0])
        result: dict = {"source": str(source), "threads": THREADS, "tokens_judged": int(ids.shape[1]),
                        "integer": done.summary(), "integer_calibrated": smoothed.summary(),
                        "calibration": {"seconds": seconds, "tokens": CALIBRATION_TOKENS, "target": TARGET,
                                        "whole": chosen.table["whole"], "kept": list(chosen.kept),
                                        "smoothed": len(chosen.smoothing)}, "forms": {}}
        for name, s in forms.items():
            got = log_softmax(s.run(None, feed(ids))[0][0])
            kl = (np.exp(want) * (want - got)).sum(-1)
            result["forms"][name] = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                                     "top1": float((got.argmax(-1) == want.argmax(-1)).mean()), "ms": {}}
        rng = np.random.default_rng(0)
        for seq in SEQS:
            x = feed(rng.integers(0, config.vocab_size, (1, seq)).astype(np.int64))
            for s in forms.values():
                s.run(None, x)
            rounds: dict = {name: [] for name in forms}
            for _ in range(ROUNDS):
                for name, s in forms.items():
                    times = []
                    for _ in range(ITERS):
                        t = time.perf_counter()
                        s.run(None, x)
                        times.append(1e3 * (time.perf_counter() - t))
                    rounds[name].append(statistics.median(times))
            for name, medians in rounds.items():
                result["forms"][name]["ms"][str(seq)] = {"median": statistics.median(medians), "rounds": medians}
    whole = result["calibration"]["whole"][-1]
    print(f"calibration: {result['calibration']['seconds']:.0f} s, {result['calibration']['smoothed']} matrices "
          f"smoothed, {len(whole['kept_float'])} kept in float, mean KL {whole['cost']:.4g} on its own text")
    for name, f in result["forms"].items():
        times = ", ".join(f"{seq} tokens {v['median']:.1f} ms ({min(v['rounds']):.1f}-{max(v['rounds']):.1f})"
                          for seq, v in f["ms"].items())
        print(f"{name}: mean KL {f['kl_mean']:.4g} (max {f['kl_max']:.3g}), top-1 {f['top1']:.1%}; prefill {times}")
    Path(out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
