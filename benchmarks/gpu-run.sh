#!/usr/bin/env bash
# attnexport's CUDA checks and benchmarks, as run on the GPU machine (see docs/benchmarks.md).
# Run from the project root with ONNX Runtime's CUDA build importable:
#   bash benchmarks/gpu-run.sh env verify bench tests
# Each step writes its files under $OUT (default: gpu-results/); a failing step does not stop
# the next one, and every step says its exit status and time.
set -u
out=${OUT:-gpu-results}
mkdir -p "$out"
export ATTNEXPORT_CACHE=${ATTNEXPORT_CACHE:-/tmp/attnexport-cache}
export PYTHONUNBUFFERED=1
ax() { python3 -m attnexport "$@"; }

step() {  # step NAME SECONDS COMMAND...: runs COMMAND with a time limit, says how it went
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "== $name"
    timeout "$limit" bash -c '"$@"' _ "$@"
    echo "== $name: exit $?, $((SECONDS - t0)) s"
}

env_report() {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 - <<'EOF'
import platform, numpy, onnx, onnxruntime, onnxscript, torch
from attnexport import runtimes as R
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "onnx", onnx.__version__, "onnxscript", onnxscript.__version__, "onnxruntime", onnxruntime.__version__,
      "numpy", numpy.__version__)
for name in R.RUNTIMES:
    s = R.status(name)
    print(f"{name}: {'available' if s.available else 'NOT available'}: {s.reason}")
EOF
}

verify_cuda() {  # every golden case and flavour on torch-cuda and ort-cuda, fp32 (TF32 off) and fp16
    for dtype in fp32 fp16; do
        ax verify --runtimes torch-cuda,ort-cuda --strict-placement --dtype $dtype --json \
            > "$out/verify-cuda-$dtype.json"
        echo "verify $dtype: exit $?"
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d['summary']))" \
            "$out/verify-cuda-$dtype.json"
    done
}

bench_h100() {  # the MHA block of the issue: D=1024, 16 heads, fp16
    ax bench --variant mha --dim 1024 --heads 16 --dtype fp16 --batch 1,8,4,1 --seq 128,512,2048,8192 \
        --runtimes torch-cuda,ort-cuda --cuda-graph --warmup 20 --iters 100 --repeat 5 \
        --plot "$out/cuda-mha-latency.png" --json > "$out/cuda-mha-fp16.json"
    echo "bench: exit $?"
    python3 benchmarks/table.py "$out/cuda-mha-fp16.json"
}

export out
export -f ax env_report verify_cuda bench_h100
placement() { python3 benchmarks/cuda_placement.py --json "$out/cuda-placement.json"; }
kernels() {
    for shape in "1 128" "4 2048"; do
        set -- $shape
        python3 benchmarks/probes/cuda_kernels.py --batch $1 --seq $2 --json "$out/cuda-kernels-$1x$2.json"
    done
}

# Decoding (the issue's targets): mha and decoder, concat and static caches (the static buffer holds
# 8193 positions, so the step's cost at short contexts shows whether it follows the buffer), batch 1
# and 8, fp16, every flavour beside torch eager and in CUDA graphs.
decode() {  # decode VARIANT...; batch 8 without the primitives flavour (its prefill of 8 x 8192 tokens
    # materializes 16 GiB score matrices, several at once)
    for variant in "$@"; do
        for batch in 1 8; do
            flavors=""
            [ $batch = 8 ] && flavors="--flavor attention --flavor ort"
            ax bench --variant $variant --dim 1024 --heads 16 --dtype fp16 --batch $batch --decode \
                --context 128,1024,4096,8192 --kv-cache static --max-seq 8193 \
                --runtimes torch-cuda,ort-cuda --cuda-graph --warmup 5 --iters 40 --repeat 2 $flavors --json \
                > "$out/cuda-$variant-decode-b$batch.json"
            echo "decode $variant batch $batch: exit $?"
        done
    done
}
# The static step's attention alone: TensorScatter + Attention-24, GroupQueryAttention's shared buffer
# and torch over the valid prefix, at every context in one 8193-position buffer.
static_step() { python3 benchmarks/probes/cuda_static.py --json "$out/cuda-static-step.json"; }
# The examples' modules and the real transformers blocks exported in fp16 and verified on ort-cuda.
modules() {
    python3 benchmarks/real_modules.py --examples --dtype fp16 --runtimes torch,ort-cuda \
        --json "$out/cuda-modules-fp16.json"
}

export -f placement kernels decode static_step modules
for s in "$@"; do
    case $s in
        env) step env 60 env_report ;;
        verify) step verify 420 verify_cuda ;;
        bench) step bench 300 bench_h100 ;;
        placement) step placement 200 placement ;;
        kernels) step kernels 200 kernels ;;
        tests) step tests 400 python3 -m pytest -q -p no:cacheprovider -n 8 ;;
        cudatests) step cudatests 300 python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_cuda.py ;;
        decode-mha) step decode-mha 400 decode mha ;;
        decode-decoder) step decode-decoder 400 decode decoder ;;
        static) step static 200 static_step ;;
        modules) step modules 300 modules ;;
        *) echo "unknown step $s"; exit 2 ;;
    esac
done 2>&1 | tee -a "$out/log.txt"
