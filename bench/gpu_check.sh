#!/usr/bin/env bash
# On a CUDA machine, in at most 8 minutes: the kernel tests with the kernels compiled for the GPU,
# then each kernel against its torch twin, the quantized GEMMs and MoE against bf16 at V4-Flash's
# shapes, and the model's tokens/s at the real head sizes (bench/bench_gpu.py), written to
# bench/results/bench_gpu.json.
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
# Kernel tests first: a kernel that is wrong on the GPU makes its timings meaningless.
timeout 240 "$PY" -m pytest -q -x tests/test_kernels.py tests/test_triton_backend.py tests/test_quant_linear.py
timeout 60 "$PY" -m pytest -q -x tests/test_kv_fp8.py -k "encoding_rounds or byte_for_byte or compressors_write or round_keys"
timeout 240 "$PY" bench/bench_gpu.py --device cuda
