#!/usr/bin/env bash
# On a CUDA machine, in at most 14 minutes (the sum of the steps' timeouts: 3 + 4 + 1 + 3.5 + 2.5): every
# Triton specialization the engine launches compiled for sm_80/sm_90/sm_100 (bench/aot_check.py,
# results in bench/results/aot.json), then the kernel tests with the kernels compiled for this GPU,
# then each kernel against its torch twin, the quantized GEMMs and MoE against bf16 at V4-Flash's
# shapes, and the model's decode and prefill tokens/s at the real head sizes (bench/bench_gpu.py,
# results in bench/results/bench_gpu.json), then decode through the engine with and without CUDA
# graphs, plain and with MTP drafts (bench/bench_decode_graphs.py, results in
# bench/results/bench_decode_graphs.json; the first time graphs are captured and replayed at all, the
# drafted passes' and the MTP layer's included). bench/gpu_model.py predicts the same, on paper.
#
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to $PY (a CPU build of torch?)" >&2
    exit 2
fi
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
                                        torch.cuda.get_device_name())'
# 1. Ahead-of-time compile of every specialization for every target (no GPU needed, but a compile
#    error or spill found here explains a test failure below): one compile process per core. A
#    problem it finds fails the script at the end, not here: GPU time is scarce, the rest still runs.
aot_status=0
timeout 180 "$PY" bench/aot_check.py --jobs "$(nproc)" || aot_status=$?
# 2. Kernel tests, compiled for this GPU: a kernel that is wrong here makes its timings meaningless.
timeout 240 "$PY" -m pytest -q -x tests/test_kernels.py tests/test_triton_backend.py tests/test_quant_linear.py
timeout 60 "$PY" -m pytest -q -x tests/test_kv_fp8.py -k "encoding_rounds or byte_for_byte or compressors_write or round_keys"
# 3. Timings: kernels, quantized GEMMs and MoE, and the model's prefill and decode tokens/s (the
#    model's eager step).
timeout 210 "$PY" bench/bench_gpu.py --device cuda
# 4. Decode through the engine, CUDA graphs against --enforce-eager, same requests, side by side;
#    then with MTP drafts (two per pass).
timeout 150 "$PY" bench/bench_decode_graphs.py --device cuda --speculative none,mtp
if [ "$aot_status" -ne 0 ]; then
    echo "gpu_check: bench/aot_check.py failed (exit $aot_status; 124: out of time): see its problems above" >&2
    exit "$aot_status"
fi
