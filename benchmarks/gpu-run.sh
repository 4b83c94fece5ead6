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
        python3 benchmarks/cuda_kernels.py --batch $1 --seq $2 --json "$out/cuda-kernels-$1x$2.json"
    done
}

export -f placement kernels
for s in "$@"; do
    case $s in
        env) step env 60 env_report ;;
        verify) step verify 420 verify_cuda ;;
        bench) step bench 300 bench_h100 ;;
        placement) step placement 200 placement ;;
        kernels) step kernels 200 kernels ;;
        tests) step tests 400 python3 -m pytest -q -p no:cacheprovider -n 8 ;;
        *) echo "unknown step $s"; exit 2 ;;
    esac
done 2>&1 | tee -a "$out/log.txt"
