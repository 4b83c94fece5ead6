#!/usr/bin/env bash
# SmolLM2's fused static step on ONNX Runtime's CUDA provider, in the forms meant for a GPU, beside
# onnxruntime-genai's CUDA int4 build (see docs/benchmarks.md): q4f16 with the GGUF grid's minimums
# folded (the default) and as float zero points (`--minimums float`: one MatMulNBits a matrix), and
# fp16. Each is exported at 8193 positions and timed in a CUDA graph up to 8000 (genai's rotary
# table ends at 8192), with its accuracy on the path timed; the optimized graphs' op counts beside.
# Run from the project root with ONNX Runtime's CUDA build importable and PACK a folder holding
# smollm2.gguf, site/ (benchmarks/gpu-hf.sh says what they are) and genai-smollm2-int4/, and
# exports/ with the three exports made on the development machine (`bash benchmarks/gpu-q4f16.sh
# --make-exports DIR` there): on the H200 of 2026-11-26 the exports made on the GPU machine's CPU
# (three side by side, 8193 positions, under transformers 5.17) did not finish in 180 s, and an
# export made elsewhere is the same file (verify checks it where it runs).
# FORMS="q4f16 fp16" (labels) keeps only those forms, here and with --make-exports.
set -u
forms=("q4f16" "q4f16-float:--minimums float" "fp16")
if [ -n "${FORMS:-}" ]; then
    kept=()
    for f in "${forms[@]}"; do [[ " $FORMS " == *" ${f%%:*} "* ]] && kept+=("$f"); done
    forms=("${kept[@]}")
fi
if [ "${1:-}" = --make-exports ]; then  # on the development machine: the exports the GPU run carries
    dir=${2:?--make-exports DIR}
    mkdir -p "$dir"
    for f in "${forms[@]}"; do
        label=${f%%:*} extra=""
        [ "$f" != "$label" ] && extra=${f#*:}
        precision=${label%%-*}
        # shellcheck disable=SC2086 # extra is the form's own options, split on purpose
        python3 -m attnexport export --hf "${GGUF:?GGUF: SmolLM2-135M-Instruct.Q4_1.gguf}" --kv-cache static \
            --max-seq 8193 --flavor ort --precision "$precision" $extra -o "$dir/smollm2-static-$label.onnx" || exit
    done
    exit 0
fi
logs=/tmp/hf
. "$(dirname "$0")/gpu-common.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import transformers, onnxruntime; print('transformers', transformers.__version__, 'onnxruntime', onnxruntime.__version__)" | tee -a "$out/gpu.txt"

gguf=$pack/smollm2.gguf
for f in "${forms[@]}"; do
    label=${f%%:*} extra=""
    [ "$f" != "$label" ] && extra=${f#*:}
    precision=${label%%-*}
    if [ -f "$pack/exports/smollm2-static-$label.onnx" ]; then
        cp "$pack/exports/smollm2-static-$label.onnx" $work/ && echo "carried: $label" > "$logs/export-smollm2-static-$label.txt"
        continue
    fi
    # shellcheck disable=SC2086 # extra is the form's own options, split on purpose
    ( OMP_NUM_THREADS=5 timeout ${EXPORT_SECONDS:-300} python3 -m attnexport export --hf "$gguf" --kv-cache static \
          --max-seq 8193 --flavor ort --precision "$precision" $extra -o $work/smollm2-static-$label.onnx \
          > "$logs/export-smollm2-static-$label.txt" 2>&1
      echo "exit $?" >> "$logs/export-smollm2-static-$label.txt" ) &
done
wait
say "exports done"
tail -n 4 "$logs"/export-*.txt | tee "$out/exports.txt"

onnx=()
for f in "${forms[@]}"; do onnx+=("static-${f%%:*}=$work/smollm2-static-${f%%:*}.onnx"); done
genai=()
[ -d "$pack/genai-smollm2-int4" ] && genai+=(--genai "genai-int4=$pack/genai-smollm2-int4")
ITERS=${ITERS:-50} run smollm2 ${SMOLLM2_SECONDS:-180} ${SMOLLM2_CONTEXTS:-128,1024,4096,8000} --source "$gguf" \
    "${onnx[@]}" "${genai[@]}"
timeout 60 python3 benchmarks/graph_ops.py --provider cuda --json "$out/ops.json" "${onnx[@]#static-}" \
    "genai-int4=$pack/genai-smollm2-int4/model.onnx" > "$out/ops.txt" 2>&1
say "ops: exit $?"
