#!/usr/bin/env bash
# The ort flavour's static step on the GPU machine (see docs/benchmarks.md), since its
# total_sequence_length is shape arithmetic: GroupQueryAttention alone against NumPy
# (benchmarks/probes/gqa_cuda_probe.py), the CUDA and placement tests, then the random Llama's static
# exports captured in a CUDA graph beside its concat export, onnxruntime-genai's CUDA builds and
# transformers, and SmolLM2's static fp16 the same way.
# Run from the project root with ONNX Runtime's CUDA build importable and PACK the folder
# benchmarks/gpu-hf.sh describes (smollm2.gguf, genai-fp16/, genai-int4/, site/).
set -u
logs=/tmp/hf  # the export logs stay on the device: eight files at most come back
. "$(dirname "$0")/gpu-common.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/probe.txt"
python3 benchmarks/probes/gqa_cuda_probe.py --json "$out/gqa-probe.json" >> "$out/probe.txt" 2>&1
say "probe: exit $?"

ex "$pack/smollm2.gguf" smollm2 static fp16 "${SMOLLM2_MAX_SEQ:-4097}" &
( python3 benchmarks/cuda_hf.py random $work/rand > "$work/random-digest.txt" 2>&1
  for p in fp16 int4; do ex $work/rand rand static $p 8193; done; ex $work/rand rand concat fp16 ) &
( timeout ${TEST_SECONDS:-240} python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py tests/test_placement.py \
      > "$out/cuda-tests.txt" 2>&1
  echo "exit $?" >> "$out/cuda-tests.txt" ) &
wait
say "exports and tests done: $(tail -2 "$out/cuda-tests.txt" | head -1)"
say "random model: $(tail -1 "$work/random-digest.txt") (genai's builds: ${RANDOM_DIGEST:-?})" | tee -a "$out/probe.txt"
tail -n 5 "$work"/export-*.txt > "$out/exports.txt"
grep -h "exit\|MiB" "$work"/export-*.txt | head -20

run random ${RANDOM_SECONDS:-150} 128,1024,4096,8192 --source $work/rand \
    static-fp16=$work/rand-static-fp16.onnx static-int4=$work/rand-static-int4.onnx \
    concat-fp16=$work/rand-concat-fp16.onnx \
    --genai genai-fp16=$pack/genai-fp16 --genai genai-int4=$pack/genai-int4 --torch fp16
run smollm2 ${SMOLLM2_SECONDS:-150} 128,1024,4096 --source "$pack/smollm2.gguf" \
    static-fp16=$work/smollm2-static-fp16.onnx --torch fp16
