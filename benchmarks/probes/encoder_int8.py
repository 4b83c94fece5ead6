"""What ONNX Runtime's dynamic int8 quantizer costs an encoder's embeddings when it is run on the
`ort` flavour's fp32 graph (the graph that is the anchor's kernel for kernel), and what it saves:
each way of quantizing judged as verify judges an int8 encoder (1 - the lowest cosine of the 40
sentences' embeddings against the fp32 graph's, the int8 budget 0.01), timed beside the fp32 graph
(median of 20 runs after 3, 2 threads, the 40 sentences padded to the longest). docs/encoders.md's
int8 figures are this script's output:

    attnexport export --hf MINILM_FOLDER --flavor ort -o minilm-ort.onnx
    python benchmarks/probes/encoder_int8.py minilm-ort.onnx MINILM_FOLDER OUT_DIR

Ways: per tensor (the quantizer's default), per channel (QAttention too), per channel MatMuls only,
then each MatMul quantized alone (per channel) to find the one that costs most, and per channel
with that one (then the two costliest) kept in float."""

import contextlib
import io
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import QuantType, quantize_dynamic

from attnexport.pretrained import model as hf
from attnexport.pretrained.encoders import measures as EM


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 2, 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def embed(s: ort.InferenceSession, feed: dict) -> np.ndarray:
    return s.run(["sentence_embedding"], {i.name: feed[i.name] for i in s.get_inputs()})[0]


def timed(s: ort.InferenceSession, feed: dict, runs: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        embed(s, feed)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        embed(s, feed)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def cost(got: np.ndarray, want: np.ndarray) -> float:
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    return float(1 - cos.min())


def quantized(src: Path, out: Path, **options) -> Path:
    with contextlib.redirect_stdout(io.StringIO()):
        quantize_dynamic(src, out, weight_type=QuantType.QInt8, **options)
    return out


def main() -> None:
    logging.disable(logging.WARNING)
    src, folder, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = hf.tokenizer_of(folder)
    feed = EM.encoded(tokenizer, EM.sentences(), 256, ("input_ids", "attention_mask", "token_type_ids"))
    fp32 = session(src)
    want, base = embed(fp32, feed), timed(fp32, feed)
    print(f"fp32 graph: {base:.1f} ms for {len(EM.sentences())} sentences")

    def report(name: str, path: Path) -> None:
        s = session(path)
        print(f"{name:40s} 1 - lowest cosine {cost(embed(s, feed), want):.4f}   time {timed(s, feed) / base:.2f}x fp32")

    report("per tensor", quantized(src, out / "per-tensor.onnx"))
    report("per channel", quantized(src, out / "per-channel.onnx", per_channel=True))
    report("per channel, MatMuls only", quantized(src, out / "per-channel-mm.onnx", per_channel=True,
                                                  op_types_to_quantize=["MatMul"]))
    matmuls = [n.name for n in onnx.load(src, load_external_data=False).graph.node if n.op_type == "MatMul"]
    alone = []
    for name in matmuls:
        path = quantized(src, out / "one.onnx", per_channel=True, nodes_to_quantize=[name])
        alone.append((cost(embed(session(path), feed), want), name))
    alone.sort(reverse=True)
    print("each MatMul alone, costliest first:", ", ".join(f"{n} {c:.4f}" for c, n in alone[:4]))
    for keep in (1, 2):
        kept = [n for _, n in alone[:keep]]
        report(f"per channel, {keep} costliest kept float", quantized(src, out / f"keep{keep}.onnx", per_channel=True,
                                                                    nodes_to_exclude=kept))


if __name__ == "__main__":
    main()
