"""bench/bench_gpu.py (the measuring half of bench/gpu_check.sh) runs end to end at smoke sizes on
a CPU, with the Triton kernels interpreted, and writes every figure the GPU check reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.daemon import PATIENCE
from tests.helpers import requires_triton

ROOT = Path(__file__).resolve().parents[1]


@requires_triton
def test_gpu_bench_runs_at_smoke_sizes() -> None:
    done = subprocess.run([sys.executable, "bench/bench_gpu.py", "--device", "cpu", "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((ROOT / "bench" / "results" / "bench_gpu_smoke.json").read_text())
    kernels = {k["kernel"]: k for k in results["kernels"]}
    assert set(kernels) == {"sparse_attention (CSA top-k)", "sparse_attention (CSA top-k, FP8 keys)",
                            "sparse_attention (HCA)", "mhc_pre", "rms_norm_rope (queries)", "index_topk",
                            "compress_decodes (FP8 keys)", "write_window (FP8 keys)", "round_keys (FP8 keys)",
                            "write_decode_step (CSA, FP8 keys)"}
    assert all(k["torch_s"] > 0 and k["triton_s"] > 0 for k in kernels.values())
    gemms = {(g["weight"], g["tokens"]) for g in results["quantized_gemm"]}
    assert gemms == {(w, t) for w in ("wq_b", "wo_b", "expert w1") for t in (1, 4)}
    assert all(g[f"{f}_s"] > 0 and g[f"{f}_ratio"] > 0 for g in results["quantized_gemm"] for f in ("fp8", "fp4"))
    assert [m["tokens"] for m in results["quantized_moe"]] == [4, 16]
    assert all(m["dense_s"] > 0 and m["fp4_s"] > 0 and m["ratio"] > 0 for m in results["quantized_moe"])
    rows = {(r["backend"], r["context"]): r for r in results["model"]}
    assert set(rows) == {(b, c) for b in ("torch", "triton") for c in (64, 256)}
    for row in rows.values():
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s_batch1"] > 0 and row["decode_tok_s_batch2"] > 0


def test_gpu_check_refuses_a_machine_without_cuda() -> None:
    # No visible device, on any machine (a GPU node included): the script must stop before running.
    done = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE,
                          env={"PY": sys.executable, "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr


def test_decode_graphs_bench_runs_both_modes_at_smoke_sizes() -> None:
    """bench/bench_decode_graphs.py (gpu_check.sh's graphs-vs-eager timing) on a CPU: graphs are off here
    and each engine says why; both runs decode the same greedy tokens, with MTP drafts too."""
    done = subprocess.run([sys.executable, "bench/bench_decode_graphs.py", "--device", "cpu", "--smoke",
                           "--batches", "1,3", "--steps", "5", "--prompt", "40", "--speculative", "none,mtp"],
                          cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((ROOT / "bench" / "results" / "bench_decode_graphs.json").read_text())
    assert set(results["batches"]) == {"1", "3"}
    for row in results["batches"].values():
        assert row["graphs"]["cuda_graphs"] == "off (not on CUDA: cpu)"
        assert row["eager"]["cuda_graphs"] == "off (--enforce-eager)"
        assert row["same_tokens"] and row["graphs"]["steps"] == row["eager"]["steps"] == 4
        assert row["ratio_eager_over_graphs"] > 0
    drafted = results["drafted"]["mtp"]
    assert set(drafted) == {"1", "3"}
    for row in drafted.values():
        assert row["same_tokens"] and row["graphs"]["drafted_passes"] == row["eager"]["drafted_passes"] > 0
    assert "graphs, async off" in results["batches"]["1"] and results["batches"]["1"]["ratio_sync_over_async"] > 0


ENGINE_FILES = {path.name for folder in ("engine", "cache", "kernels") for path in (ROOT / folder).rglob("*.py")}


def test_profile_decode_names_where_a_step_goes_at_smoke_sizes() -> None:
    """bench/profile_decode.py (gpu_check.sh's host-against-device profile) on a CPU: the host's top
    operators per step, and no device column."""
    done = subprocess.run([sys.executable, "bench/profile_decode.py", "--device", "cpu", "--smoke", "--batch", "2",
                           "--steps", "3", "--prompt", "24"], cwd=ROOT, capture_output=True, text=True,
                          timeout=PATIENCE)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((ROOT / "bench" / "results" / "profile_decode.json").read_text())
    assert results["batch"] == 2 and results["device_busy_us_per_step"] is None and not results["top_device_ops"]
    names = [op["name"] for op in results["top_host_ops"]]
    assert "aten::mm" in names and all(op["self_us_per_step"] > 0 for op in results["top_host_ops"])
    assert "us per step" in done.stdout
    assert any("[[" in op["name"] for op in results["top_aten_ops_by_shape"])  # shapes told apart
    # Which functions lead by own time moves with the machine's load; that the engine's are profiled does not.
    python = results["top_python_functions"]
    assert python and all(f["calls_per_step"] > 0 and f["cumulative_us_per_step"] >= f["self_us_per_step"] > 0
                          for f in python), python
    assert any(f["name"].split(":")[0] in ENGINE_FILES for f in python), python
