#!/usr/bin/env bash
# On a CUDA machine, in at most 13 minutes (the sum of the steps' timeouts: 4 + 1 + 2.5 + 2 + 3.5; add 3 with
# --aot): the CUDA tests (tests/test_cuda.py: captured graphs against eager steps, with and without MTP,
# async scheduling, a prefix hit, the compiled kernels in the engine against the CPU reference) and the
# kernel tests with the kernels compiled for this GPU; then decode through the engine with and without
# CUDA graphs and async scheduling, plain and with MTP drafts (bench/bench_decode_graphs.py, results in
# bench/results/bench_decode_graphs.json); then where a decode step's time goes, host against device
# (bench/profile_decode.py at batch 1 and 32); then each kernel against its torch twin, the quantized
# GEMMs and MoE against bf16 at V4-Flash's shapes, and the model's decode and prefill tokens/s at the
# real head sizes (bench/bench_gpu.py, results in bench/results/bench_gpu.json). With --aot first every
# Triton specialization the engine launches is compiled for sm_80/sm_90/sm_100 (bench/aot_check.py; no
# GPU needed, so CI-like machines run it too). bench/gpu_model.py predicts the same, on paper.
#
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
#   bash bench/gpu_check.sh [--aot]
#
# Without network access (a machine with its own CUDA build of torch and Triton): carry the wheels of
# v4serve's other dependencies, install them with `pip install --no-deps --target DIR`, put DIR and a
# folder holding a `v4serve` link to this checkout on PYTHONPATH, and run `PY=python3 bash bench/gpu_check.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to $PY (a CPU build of torch?)" >&2
    exit 2
fi
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
                                        torch.cuda.get_device_name())'
# A step that fails fails the script at the end, not there: GPU time is scarce, the rest still runs.
status=0
# 0. Ahead-of-time compile of every specialization for every target (a compile error or spill found here
#    explains a test failure below): one compile process per core.
if [ "${1:-}" = "--aot" ]; then
    timeout 180 "$PY" bench/aot_check.py --jobs "$(nproc)" || status=$?
fi
# 1. What only a GPU runs, and the kernels compiled for it: a kernel that is wrong here makes every
#    timing below meaningless.
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kernels.py \
    tests/test_triton_backend.py tests/test_quant_linear.py || status=$?
timeout 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_kv_fp8.py \
    -k "encoding_rounds or byte_for_byte or compressors_write or round_keys" || status=$?
# 2. Decode through the engine: CUDA graphs against --enforce-eager and async scheduling against
#    synchronous steps, same requests, side by side; then with MTP drafts (two per pass).
timeout 150 "$PY" bench/bench_decode_graphs.py --device cuda --speculative none,mtp || status=$?
# 3. Host against device in a decode step.
for batch in 1 32; do
    timeout 60 "$PY" bench/profile_decode.py --device cuda --batch "$batch" || status=$?
done
# 4. Timings: kernels, quantized GEMMs and MoE, and the model's prefill and decode tokens/s (the
#    model's eager step).
timeout 210 "$PY" bench/bench_gpu.py --device cuda || status=$?
if [ "$status" -ne 0 ]; then
    echo "gpu_check: a step failed (last exit $status; 124: out of time): see above" >&2
fi
exit "$status"
