# What benchmarks/gpu-hf.sh and benchmarks/gpu-static.sh share (sourced, not run): the results
# folder, PACK's gguf package made importable, the environment, and three helpers.
#   say TEXT                                   the text after the seconds since the start
#   ex SOURCE NAME FORM PRECISION [MAX_SEQ]    one `export --hf` (ort flavour) to $work, its log in $logs
#   run NAME SECONDS CONTEXTS ARGS...          benchmarks/cuda_hf.py run, only the exports that were written
out=${OUT:-gpu-results}
pack=${PACK:?PACK: the folder with smollm2.gguf, genai-fp16, genai-int4, site}
mkdir -p "$out"
# transformers reads gguf's version from its dist-info: a copied package folder alone reads as "N/A".
if [ -d "$pack/site/gguf" ] && ! ls -d "$pack"/site/gguf-*.dist-info >/dev/null 2>&1; then
    mkdir -p "$pack/site/gguf-0.19.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: gguf\nVersion: 0.19.0\n' > "$pack/site/gguf-0.19.0.dist-info/METADATA"
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=3 ATTNEXPORT_CACHE=/tmp/attnexport-cache
work=/tmp/hf
logs=${logs:-$out}
mkdir -p $work "$logs"
t0=$SECONDS
say() { echo "[$((SECONDS - t0)) s] $*"; }

ex() {
    local extra=""
    [ "$3" = static ] && extra="--max-seq ${5:-8193}"
    timeout ${EXPORT_SECONDS:-300} python3 -m attnexport export --hf "$1" --kv-cache "$3" $extra --flavor ort \
        --precision "$4" -o "$work/$2-$3-$4.onnx" > "$logs/export-$2-$3-$4.txt" 2>&1
    echo "exit $?" >> "$logs/export-$2-$3-$4.txt"
}

run() {
    local name=$1 limit=$2 contexts=$3
    shift 3
    local args=()
    for a in "$@"; do
        case $a in
            *=*.onnx) [ -f "${a#*=}" ] && args+=(--onnx "$a") ;;
            *) args+=("$a") ;;
        esac
    done
    timeout "$limit" python3 benchmarks/cuda_hf.py run "${args[@]}" --provider "${PROVIDER:-cuda}" \
        --contexts "$contexts" --iters "${ITERS:-100}" --json "$out/cuda-hf-$name.json" > "$out/cuda-hf-$name.txt" 2>&1
    say "$name: exit $?"
}
