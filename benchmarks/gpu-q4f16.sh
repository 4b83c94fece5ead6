#!/usr/bin/env bash
# SmolLM2's fused static step on ONNX Runtime's CUDA provider, in the forms meant for a GPU, beside
# onnxruntime-genai's CUDA int4 build (see docs/benchmarks.md): q4f16 with the GGUF grid's minimums
# folded (the default) and as float zero points (`--minimums float`: one MatMulNBits a matrix), and
# fp16. Each is exported at 8193 positions and timed in a CUDA graph up to 8000 (genai's rotary
# table ends at 8192), with its accuracy on the path timed; the optimized graphs' op counts beside.
# Run from the project root with ONNX Runtime's CUDA build importable and PACK a folder holding
# smollm2.gguf, site/ (benchmarks/gpu-hf.sh says what they are) and genai-smollm2-int4/.
set -u
logs=/tmp/hf
. "$(dirname "$0")/gpu-common.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import transformers, onnxruntime; print('transformers', transformers.__version__, 'onnxruntime', onnxruntime.__version__)" | tee -a "$out/gpu.txt"

gguf=$pack/smollm2.gguf
OMP_NUM_THREADS=5 ex "$gguf" smollm2 static q4f16 8193 &
OMP_NUM_THREADS=5 ex "$gguf" smollm2 static fp16 8193 &
( export OMP_NUM_THREADS=5
  timeout ${EXPORT_SECONDS:-300} python3 -m attnexport export --hf "$gguf" --kv-cache static --max-seq 8193 \
      --flavor ort --precision q4f16 --minimums float -o $work/smollm2-static-q4f16-float.onnx \
      > "$logs/export-smollm2-static-q4f16-float.txt" 2>&1
  echo "exit $?" >> "$logs/export-smollm2-static-q4f16-float.txt" ) &
wait
say "exports done"
tail -n 4 "$logs"/export-*.txt | tee "$out/exports.txt"

genai=()
[ -d "$pack/genai-smollm2-int4" ] && genai+=(--genai "genai-int4=$pack/genai-smollm2-int4")
ITERS=${ITERS:-50} run smollm2 ${SMOLLM2_SECONDS:-180} ${SMOLLM2_CONTEXTS:-128,1024,4096,8000} --source "$gguf" \
    static-q4f16=$work/smollm2-static-q4f16.onnx static-q4f16-float=$work/smollm2-static-q4f16-float.onnx \
    static-fp16=$work/smollm2-static-fp16.onnx "${genai[@]}"
timeout 60 python3 benchmarks/graph_ops.py --provider cuda --json "$out/ops.json" \
    q4f16=$work/smollm2-static-q4f16.onnx q4f16-float=$work/smollm2-static-q4f16-float.onnx \
    fp16=$work/smollm2-static-fp16.onnx "genai-int4=$pack/genai-smollm2-int4/model.onnx" > "$out/ops.txt" 2>&1
say "ops: exit $?"
