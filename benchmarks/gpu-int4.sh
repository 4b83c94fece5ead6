#!/usr/bin/env bash
# int4 on ONNX Runtime's CUDA provider (see docs/benchmarks.md): where the quantized exports go
# wrong there (benchmarks/int4_cuda_probe.py: MatMulNBits alone over a grid of its settings, then
# every node of a random Llama's and SmolLM2's static int4 exports on the CPU and CUDA providers),
# the CUDA and placement test files beside the exports, then both exports timed and measured
# (benchmarks/cuda_hf.py).
# Run from the project root with ONNX Runtime's CUDA build importable and PACK a folder holding
# smollm2.gguf and site/ (benchmarks/gpu-hf.sh says what they are). SmolLM2 is exported with
# --max-seq 1025: the check before writing runs the model in float64 at every position.
set -u
logs=/tmp/hf
. "$(dirname "$0")/gpu-common.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"

( python3 benchmarks/cuda_hf.py random $work/rand > "$work/random-digest.txt" 2>&1
  ex $work/rand rand static int4 1025 ) &
OMP_NUM_THREADS=6 ex "$pack/smollm2.gguf" smollm2 static int4 1025 &
( timeout ${TEST_SECONDS:-200} python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py tests/test_placement.py \
      > "$out/cuda-tests.txt" 2>&1
  echo "exit $?" >> "$out/cuda-tests.txt" ) &
wait
say "exports and tests done: $(tail -2 "$out/cuda-tests.txt" | head -1)"
tail -n 4 "$work"/export-*.txt | tee "$out/exports.txt"

timeout ${PROBE_SECONDS:-120} python3 benchmarks/int4_cuda_probe.py $work/rand-static-int4.onnx \
    $work/smollm2-static-int4.onnx --json "$out/int4-probe.json" > "$work/probe.txt" 2>&1
say "probe: exit $?"
grep -v '^{' "$work/probe.txt" | tee -a "$out/exports.txt"

ITERS=${ITERS:-50} run smollm2 ${SMOLLM2_SECONDS:-150} 128,1024 --source "$pack/smollm2.gguf" \
    static-int4=$work/smollm2-static-int4.onnx
ITERS=${ITERS:-50} run random ${RANDOM_SECONDS:-60} 128,1024 --source $work/rand static-int4=$work/rand-static-int4.onnx
