"""bench/gpu_model.py, the decode step-time model on paper: run at a small set (V4-Flash on H200 and
B200, TP 1 and 8, batch 1, 32 and 256; stored work-item counts, no GPU, no meta-device step) and
checked against what holds whatever the model's code says: the capacity plan's bytes, the datasheet
bandwidths, the order of eager and graphs, the growth with batch."""

from __future__ import annotations

import json
from functools import cache
from itertools import product
from typing import Any

import pytest

from bench import gpu_model
from bench.common import RESULTS
from v4serve.engine.model.plan import GIB, PlanSettings, plan_model, preset_config

MODEL = "deepseek-v4-flash"
GPUS = ("H200", "B200")
TPS = (1, 8)
BATCHES = (1, 32, 256)
HBM_TB_S = {"H200": 4.8, "B200": 8.0}  # datasheets
MEMORY_GIB = {"H200": 141, "B200": 180}
WEIGHT_KERNELS = {"proj_x", "proj_q", "proj_out", "moe_routed", "moe_shared", "head"}


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    gpu_model.main(["--models", MODEL, "--gpus", ",".join(GPUS), "--tp", ",".join(map(str, TPS)),
                    "--batches", ",".join(map(str, BATCHES)), "--stored-launches", "--results-name", "gpu_model_test"])
    return json.loads((RESULTS / "gpu_model_test.json").read_text())


@cache
def _plan(tp: int, gpu: str) -> Any:
    return plan_model(MODEL, PlanSettings(memory_bytes=int(MEMORY_GIB[gpu] * GIB), tensor_parallel_size=tp,
                                          max_model_len=gpu_model.CONTEXT + 1))


def _cases(results: dict[str, Any]) -> dict[tuple[str, int, int], dict[str, Any]]:
    return {(c["gpu"], c["tp"], c["batch"]): c for c in results["cases"]}


def test_every_case_is_written_and_fits_as_the_plan_says(results: dict[str, Any]) -> None:
    cases = _cases(results)
    assert set(cases) == set(product(GPUS, TPS, BATCHES))
    assert "PREDICTED, NOT MEASURED" in results["note"]
    for (gpu, tp, _), case in cases.items():
        plan = _plan(tp, gpu)
        assert case["fits"] == plan.fits
        assert case["weights_per_rank_bytes"] == plan.weights_per_rank.total
        if case["fits"]:
            assert {"eager", "graphs", "kernels"} <= set(case)
    # 145 GiB of packed weights: more than an H200 holds, within a B200's 180 GiB.
    assert not cases["H200", 1, 1]["fits"] and cases["B200", 1, 1]["fits"] and cases["H200", 8, 1]["fits"]


def test_graphs_are_never_slower_than_eager(results: dict[str, Any]) -> None:
    for case in (c for c in results["cases"] if c["fits"]):
        assert 0 < case["graphs"]["step_s"] < case["eager"]["step_s"]
        assert case["eager"]["overlapped_step_s"] <= case["eager"]["step_s"]
        for mode in ("eager", "graphs"):
            assert case[mode]["tok_s_per_gpu"] == pytest.approx(case["batch"] / case[mode]["step_s"] / case["tp"])


def test_a_bigger_batch_takes_longer_per_step_and_less_per_token(results: dict[str, Any]) -> None:
    cases = _cases(results)
    for gpu, tp in product(GPUS, TPS):
        if not cases[gpu, tp, 1]["fits"]:
            continue
        for mode in ("eager", "graphs"):
            steps = [cases[gpu, tp, b][mode]["step_s"] for b in BATCHES]
            per_gpu = [cases[gpu, tp, b][mode]["tok_s_per_gpu"] for b in BATCHES]
            assert steps == sorted(steps) and len(set(steps)) == len(steps)
            assert per_gpu == sorted(per_gpu)


def test_batch_one_reads_the_weights_one_token_touches_and_is_memory_bound(results: dict[str, Any]) -> None:
    cfg = preset_config(MODEL)
    share = cfg.num_experts_per_tok / cfg.n_routed_experts
    for (gpu, tp, batch), case in _cases(results).items():
        if batch != 1 or not case["fits"]:
            continue
        w = _plan(tp, gpu).weights_per_rank
        # Every weight but the experts not chosen and the embedding table (a third of embedding_and_head:
        # bf16 beside the fp32 head), whose one row is read; the hash layers' tid2eid tables ("other") are
        # read a row each too.
        touched = w.attention + w.shared_experts + w.other + w.routed_experts * share + w.embedding_and_head * 2 / 3
        assert case["weight_bytes"] == pytest.approx(touched, rel=0.02)
        kv = sum(case["kernels"][k]["bytes"] for k in ("attention", "indexer", "cache_write"))
        assert kv < 0.05 * case["bytes"]  # one sequence's KV is nothing beside the weights
        assert case["compute_s"] < 0.05 * case["memory_s"]  # the FLOPs are nothing beside the bytes
        floor = case["bytes"] / (HBM_TB_S[gpu] * 1e12)  # the datasheet bandwidth, all of it
        assert case["graphs"]["step_s"] > floor
        # Within the launch overheads, collectives, grid-limited kernels and measured floors (mHC): bytes at
        # 80% of the bandwidth.
        overheads = (case["launches"] * gpu_model.GRAPH_KERNEL_S + case["comm_s"] + case["program_s"]
                     + case["measured_s"])
        assert case["graphs"]["step_s"] <= floor / gpu_model.HBM_EFFICIENCY + overheads + 1e-9
        # The kernel that moves the most bytes reads weights: a projection, the MoE or the head.
        assert max(case["kernels"], key=lambda k: case["kernels"][k]["memory_s"]) in WEIGHT_KERNELS


def test_tp8_reads_an_eighth_of_the_weights(results: dict[str, Any]) -> None:
    cases = _cases(results)
    whole = _plan(1, "B200").weights_per_rank
    eighth = _plan(8, "B200").weights_per_rank
    for gpu in GPUS:
        # Batch 256 touches nearly every expert (256·(1−(1−6/256)^256) ≈ 255.8 of 256).
        read = cases[gpu, 8, 256]["weight_bytes"]
        assert read == pytest.approx(eighth.total - eighth.embedding_and_head / 2, rel=0.02)
        # An eighth of everything, plus what every rank holds whole (wq_a, wkv, compressors, router, mHC).
        assert whole.total / 8 < read < 1.1 * whole.total / 8
    assert cases["B200", 1, 256]["weight_bytes"] / cases["B200", 8, 256]["weight_bytes"] == pytest.approx(8, rel=0.1)


def test_the_peer_figures_are_printed_beside_the_predictions(results: dict[str, Any]) -> None:
    assert results["peer"]["ms_per_token_concurrency_1"] == 3.26
    rows = results["comparison"]
    assert {r["tp"] for r in rows} == {8}  # Flash on H200 fits at TP 8 only, of TP 1 and 8
    for row in rows:
        assert row["ratio"] == pytest.approx(row["predicted"] / row["peer"])


def test_only_the_modes_the_code_runs_are_predicted_with_the_host_work_in(results: dict[str, Any]) -> None:
    """CUDA graphs with async scheduling, on one rank or several: the larger of host and device."""
    for case in results["cases"]:
        if not case["fits"]:
            continue
        run, host = case["v4serve"], gpu_model.host_step_s(case["batch"])
        assert run["host_s"] == pytest.approx(host)
        assert run["mode"] == "CUDA graphs, async scheduling"
        assert run["step_s"] == pytest.approx(max(case["graphs"]["step_s"], host))
        assert run["tok_s_per_gpu"] == pytest.approx(case["batch"] / run["step_s"] / case["tp"])
    decode = [r for r in results["comparison"] if not r["figure"].startswith("TTFT")]
    assert decode and {r["mode"] for r in decode} == {"CUDA graphs, async scheduling"}  # Flash on H200: TP 4/8


def test_all_reduce_times_are_the_published_measurements_by_size_and_group() -> None:
    for nbytes, seconds in gpu_model.NCCL_ALL_REDUCE_8:
        assert gpu_model.nccl_all_reduce_s(nbytes, 8) == pytest.approx(seconds)
    assert gpu_model.nccl_all_reduce_s(24 << 10, 8) == pytest.approx((20.7 + (23.1 - 20.7) / 6) * 1e-6)
    assert gpu_model.nccl_all_reduce_s(8, 8) == pytest.approx(19.2e-6)  # the smallest message's latency
    assert gpu_model.nccl_all_reduce_s(32 << 20, 8) > gpu_model.nccl_all_reduce_s(16 << 20, 8)  # at its slope
    assert gpu_model.nccl_all_reduce_s(1 << 20, 4) == pytest.approx(0.85 * 32.4e-6)  # fewer ranks, less time
