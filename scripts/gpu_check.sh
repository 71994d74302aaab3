#!/usr/bin/env bash
# On a CUDA machine, in one go (about 6 minutes, never more than 11): install kvlab without fetching
# anything, run the kernel tests natively (every kernel: paged attention with and without sliding
# windows, split-KV, FP8, the cache write, MLA decode and its latent write, the exercise's tile
# kernel, check_kernel and its mutants), benchmark the kernels against SDPA (the goal shape first,
# sliding-window decodes last) with a tile sweep, benchmark MLA decode (the absorbed kernel against
# decompressing, with the bytes each reads), run the engine tests natively (the hard paths included),
# and write logs and JSON (device and date inside) to the folder given as $1, or $OUT, or data/measurements/.
#
#   scripts/gpu_check.sh                # results into data/measurements/, ready to commit
#   scripts/gpu_check.sh /tmp/results
#
# Needs, for $PYTHON (default: .venv/bin/python if there, else python3): a CUDA build of torch,
# triton, numpy, pytest, transformers, safetensors, xxhash; cbor2 for the engine tests. A machine
# that cannot reach PyPI gets cbor2 as a wheel: run `make gpu-wheels` where pip works, carry .whl/
# along, and this script installs whatever .whl/ holds first. pytest-xdist, if present, runs the
# tests in parallel (Triton compiles each kernel variant once per process; the disk cache is shared).
# GPU_CHECK_ALLOW_CPU=1 runs the same steps without a GPU (interpreter, smoke bench): it tests this
# script, not the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="$(mkdir -p "${1:-${OUT:-data/measurements}}" && cd "${1:-${OUT:-data/measurements}}" && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
START=$SECONDS
step() { echo; echo "== $1 ($((SECONDS - START)) s in)"; }
# The limits are for a GPU; a dry run on a CPU runs every kernel through the interpreter, so it gets 5x.
SCALE=1
if [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then SCALE=5; fi

step "machine"
if [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then
    "$PY" -c 'import torch, triton; print("NO GPU CHECK: a dry run of the script | torch", torch.__version__, "| triton", triton.__version__)' || exit 1
else
    "$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "no CUDA device"; print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| triton", triton.__version__)' || exit 1
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>/dev/null
    export KVLAB_KERNEL_BACKEND=cuda
fi

step "install (nothing is downloaded)"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
    echo "installed from .whl/: $(cd .whl && ls *.whl | tr '\n' ' ')"
fi
if ! "$PY" -c "import kvlab.kernels" 2>/dev/null; then
    # Editable, as `make` installs it: kernels/ becomes kvlab.kernels, and the data stay in data/.
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
fi
"$PY" -c "import kvlab.kernels as K; print(K.describe_backend())" || exit 1
PARALLEL=()
if "$PY" -c "import xdist" 2>/dev/null; then PARALLEL=(-n 8); fi
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= "${PARALLEL[@]}")

step "kernel tests, natively (limit $((200 * SCALE)) s)"
timeout $((200 * SCALE)) "${PYTEST[@]}" tests/test_kernels_*.py 2>&1 | tee "$OUT_DIR/paged_attention_gpu_tests.log" | tail -15
KERNEL_TESTS=${PIPESTATUS[0]}

step "benchmark against SDPA, then the tile sweep (limit $((240 * SCALE)) s)"
timeout $((240 * SCALE)) "$PY" benchmarks/bench_kernels.py --out "$OUT_DIR" --sweep 2>&1 | tee "$OUT_DIR/paged_attention_gpu_bench.log"
BENCH=${PIPESTATUS[0]}

step "MLA decode: the absorbed Triton kernel against decompressing, bytes read counted (limit $((90 * SCALE)) s)"
timeout $((90 * SCALE)) "$PY" benchmarks/bench_mla.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/mla_decode_gpu_bench.log"
MLA_BENCH=${PIPESTATUS[0]}

if "$PY" -c "import cbor2, transformers, safetensors" 2>/dev/null; then
    step "engine tests, natively: tokens against transformers, the Llama and the MLA model (limit $((100 * SCALE)) s)"
    timeout $((100 * SCALE)) "${PYTEST[@]}" tests/engine 2>&1 | tee "$OUT_DIR/engine_gpu_tests.log" | tail -15
    ENGINE_TESTS=${PIPESTATUS[0]}
else
    step "engine tests skipped: cbor2, transformers or safetensors missing (make gpu-wheels, then carry .whl/)"
    ENGINE_TESTS=0
fi

step "done: kernel tests exit $KERNEL_TESTS, benchmark exit $BENCH, MLA benchmark exit $MLA_BENCH, engine tests exit $ENGINE_TESTS; results in $OUT_DIR"
ls -l "$OUT_DIR"
exit $(( KERNEL_TESTS != 0 || BENCH != 0 || MLA_BENCH != 0 || ENGINE_TESTS != 0 ))
