"""Why a Q4_1 grid is not carried with float zero points: one MatMulNBits (K 1536, N 576, 4 bits,
blocks of 32, one token) with integer zero points (0, the minimums apart) and with float zero
points (`-m / d`, which MatMulNBits also accepts), at accuracy levels 0 and 4, timed on ONNX
Runtime's CPU provider.

    python benchmarks/probes/float_zero_points.py --threads 2
"""

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from attnexport.pretrained import precision as P

K, N, BLOCK = 1536, 576, 32


def session(zeros: np.ndarray, scales: np.ndarray, q: np.ndarray, level: int, threads: int):
    inits = [numpy_helper.from_array(P.pack(q, 4, BLOCK), "b"), numpy_helper.from_array(scales.T.reshape(-1), "s"),
             numpy_helper.from_array(zeros, "z")]
    node = helper.make_node("MatMulNBits", ["x", "b", "s", "z"], ["y"], domain="com.microsoft", K=K, N=N, bits=4,
                            block_size=BLOCK, accuracy_level=level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, N])], inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 9
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    a = parser.parse_args()
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (K, N)).astype(np.uint8)
    d = (rng.random((K // BLOCK, N)) * 0.01 + 0.001).astype(np.float16).astype(np.float32)
    m = (-rng.random((K // BLOCK, N)) * 0.1).astype(np.float16).astype(np.float32)
    x = {"x": rng.standard_normal((1, 1, K)).astype(np.float32)}
    kinds = {"integer zero points": P.pack_zeros(np.zeros((N, K // BLOCK), np.uint8), 4).reshape(-1),
             "float zero points": (-m / d).T.reshape(-1).astype(np.float32)}
    for level in (0, 4):
        for name, zeros in kinds.items():
            s = session(zeros, d, q, level, a.threads)
            for _ in range(20):
                s.run(None, x)
            ms = []
            for _ in range(200):
                started = time.perf_counter()
                s.run(None, x)
                ms.append((time.perf_counter() - started) * 1e3)
            print(f"accuracy level {level}, {name}: {statistics.median(ms) * 1e3:.0f} us a run ({a.threads} threads)")


if __name__ == "__main__":
    main()
