#!/usr/bin/env bash
# On a CUDA machine, in one go and in under 8 minutes: run the kernel tests natively, benchmark the
# kernels against SDPA, and write the results (JSON with the device name and date) to the folder
# given as $1, or $OUT, or data/measurements/. Nothing is downloaded: torch (a CUDA build), triton,
# pytest and numpy must already be installed for $PYTHON (default: .venv/bin/python, else python3).
#   scripts/gpu_check.sh                # results into data/measurements/, ready to commit
#   scripts/gpu_check.sh /tmp/results
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="$(mkdir -p "${1:-${OUT:-data/measurements}}" && cd "${1:-${OUT:-data/measurements}}" && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
START=$SECONDS

"$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"; print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| triton", triton.__version__)' || exit 1

# kvlab.kernels lives in kernels/ (installed as kvlab.kernels). Without an install, use a scratch
# copy of the package with kernels/ linked in, and keep the data where it is.
if ! "$PY" -c "import kvlab.kernels" 2>/dev/null; then
    SCRATCH="$(mktemp -d)"
    cp -r kvlab "$SCRATCH/kvlab" && ln -s "$PWD/kernels" "$SCRATCH/kvlab/kernels"
    export PYTHONPATH="$SCRATCH${PYTHONPATH:+:$PYTHONPATH}"
    export KVLAB_DATA="$PWD/data"
fi
export KVLAB_KERNEL_BACKEND=cuda

echo "== kernel tests, natively (limit 180 s)"
timeout 180 "$PY" -m pytest tests/test_kernels_*.py -q -x -p no:cacheprovider --noconftest -o addopts="" \
    2>&1 | tee "$OUT_DIR/paged_attention_gpu_tests.log" | tail -15
TESTS=${PIPESTATUS[0]}

echo "== benchmark and tile sweep (limit 270 s)"
timeout 270 "$PY" benchmarks/bench_kernels.py --out "$OUT_DIR" --sweep 2>&1 | tee "$OUT_DIR/paged_attention_gpu_bench.log"
BENCH=${PIPESTATUS[0]}

echo "== done in $((SECONDS - START)) s: tests exit $TESTS, benchmark exit $BENCH; results in $OUT_DIR"
exit $(( TESTS != 0 || BENCH != 0 ))
