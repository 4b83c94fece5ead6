#!/usr/bin/env bash
# int4 on ONNX Runtime's CUDA provider (see docs/benchmarks.md). The H100 run of 2026-11-26 found
# every MatMulNBits right on CUDA (benchmarks/probes/int4_cuda_probe.py) and the fp32-activation static
# steps wrong when stepped through their buffers. This run: the CUDA and placement test files beside
# the exports; the random Llama's static fp32, int4 and q4f16 exports stepped and timed (is the fp32
# step wrong too, is q4f16 right and captured in a CUDA graph?); SmolLM2's q4f16 beside
# onnxruntime-genai's CUDA int4 build where PACK has one (genai-smollm2-int4/). PROBE=1 runs the
# MatMulNBits probe over the exports too. SmolLM2 is exported at 8193 positions, in q4f16 and fp16 (the
# fp16 static step re-measured after its fusion fix), and timed up to 8000 (genai's rotary table ends at 8192).
# Run from the project root with ONNX Runtime's CUDA build importable and PACK a folder holding
# smollm2.gguf and site/ (benchmarks/gpu-hf.sh says what they are), and optionally genai-int4/ (the
# random Llama's genai CUDA int4 build) and genai-smollm2-int4/.
set -u
logs=/tmp/hf
. "$(dirname "$0")/gpu-common.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"

( python3 benchmarks/cuda_hf.py random $work/rand > "$work/random-digest.txt" 2>&1
  for p in q4f16 fp32 int4; do ex $work/rand rand static $p 1025; done ) &
OMP_NUM_THREADS=4 ex "$pack/smollm2.gguf" smollm2 static q4f16 "${SMOLLM2_MAX_SEQ:-8193}" &
OMP_NUM_THREADS=4 ex "$pack/smollm2.gguf" smollm2 static fp16 "${SMOLLM2_MAX_SEQ:-8193}" &
( timeout ${TEST_SECONDS:-200} python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py tests/test_placement.py \
      > "$out/cuda-tests.txt" 2>&1
  echo "exit $?" >> "$out/cuda-tests.txt" ) &
wait
say "exports and tests done: $(tail -2 "$out/cuda-tests.txt" | head -1)"
tail -n 4 "$work"/export-*.txt | tee "$out/exports.txt"

if [ "${PROBE:-0}" = 1 ]; then
    timeout ${PROBE_SECONDS:-120} python3 benchmarks/probes/int4_cuda_probe.py $work/rand-static-int4.onnx \
        $work/rand-static-q4f16.onnx --no-ops --json "$out/int4-probe.json" > "$work/probe.txt" 2>&1
    say "probe: exit $?"
fi

genai=()
[ -d "$pack/genai-int4" ] && genai+=(--genai "genai-int4=$pack/genai-int4")
ITERS=${ITERS:-50} run random ${RANDOM_SECONDS:-90} 128,1024 --source $work/rand \
    static-q4f16=$work/rand-static-q4f16.onnx static-fp32=$work/rand-static-fp32.onnx \
    static-int4=$work/rand-static-int4.onnx "${genai[@]}"
genai=()
[ -d "$pack/genai-smollm2-int4" ] && genai+=(--genai "genai-int4=$pack/genai-smollm2-int4")
ITERS=${ITERS:-50} run smollm2 ${SMOLLM2_SECONDS:-180} ${SMOLLM2_CONTEXTS:-128,1024,4096,8000} --source "$pack/smollm2.gguf" \
    static-q4f16=$work/smollm2-static-q4f16.onnx static-fp16=$work/smollm2-static-fp16.onnx "${genai[@]}"
