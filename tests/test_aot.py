"""Ahead-of-time compile check, without a GPU: the Triton specializations a DeepSeek-V4-Flash step
launches at its real shapes (decode at batch 1, 8 and 32 and contexts 300 to 64K, a prefill chunk,
a mixed step; bf16 and FP8 KV; packed FP8/FP4 weights; one of each kind: see
`kernels.aot.representatives`) compile for sm_80, sm_90 and sm_100 with no compile error, no shared
memory over the target's limit and no spill. `bench/aot_check.py` sweeps every specialization of
both models at TP 1 and TP 8. And the check can fail: kernels that run interpreted but that a GPU
would refuse or run badly are caught, each for its own reason."""

from __future__ import annotations

import pytest

from tests.helpers import requires_triton
from v4serve.engine.model.gpu.aot import DECODE_STEPS, PREFILL_STEPS, Scenario, record_scenarios
from v4serve.kernels.aot import ALLOWED_SPILLS, TARGETS, compile_launches, problems, representatives
from v4serve.kernels.launches import Launch, TensorArg

pytestmark = requires_triton

FLASH = (Scenario("deepseek-v4-flash"), Scenario("deepseek-v4-flash", kv_cache_dtype="fp8"))


@pytest.fixture(scope="module")
def recorded():
    return record_scenarios(FLASH, DECODE_STEPS, PREFILL_STEPS)


def test_a_flash_step_records_every_kernel_of_the_model(recorded) -> None:
    """On the meta device: nothing runs, and nothing reads a value back (a meta tensor has none)."""
    kernels = {launch.name for launch in recorded.scenarios}
    assert {"sparse_attention", "index_scores", "index_topk", "decode_step", "compress_chunk", "mhc_pre", "mhc_post",
            "norm_rope", "route", "packed_up", "packed_down", "quant_linear", "grouped", "round_keys"} <= kernels
    assert {"decode_step", "index_topk", "packed_up", "sparse_attention"} <= recorded.decode_kernels
    assert "compress_chunk" not in recorded.decode_kernels


def test_flash_kernels_compile_for_every_target_without_spills(recorded) -> None:
    launches = representatives(recorded.scenarios)
    results = compile_launches(launches, jobs=2)
    assert len(results) == len(launches) * len(TARGETS)
    assert {(r.kernel, r.target) for r in results} == {(x.name, t.name) for x in launches for t in TARGETS}
    assert problems(results, recorded.decode_kernels) == []
    assert all(r.registers > 0 for r in results)  # the ptxas report was read


def test_the_check_catches_what_a_gpu_would_refuse() -> None:
    f32, f16 = TensorArg("float32", True), TensorArg("float16", True)
    samples = [
        Launch("tests.aot_samples", "loop_changes_a_shape", (TensorArg("int32", True), 64), (("BLOCK", 16),)),
        Launch("tests.aot_samples", "too_much_shared_memory", (f16, f16, f32, 4096),
               (("BLOCK", 128), ("num_stages", 6), ("num_warps", 8))),
        Launch("tests.aot_samples", "holds_too_much", (f32, f32), (("BLOCK", 128), ("num_warps", 1))),
    ]
    error, shared, spill = compile_launches(samples, [TARGETS[0]])
    assert error.error is not None and "Loop-carried variable" in error.error
    assert shared.error is None and shared.shared > shared.shared_limit
    assert spill.error is None and spill.spills
    found = problems([error, shared, spill], decode_kernels={"holds_too_much"})
    assert [p.split(":")[0] for p in found] == ["holds_too_much on sm_80", "loop_changes_a_shape on sm_80",
                                                "too_much_shared_memory on sm_80"]
    assert ALLOWED_SPILLS == {}  # nothing in v4serve is excused from the no-spill rule


def test_a_block_whose_registers_do_not_fit_an_sm_is_a_problem() -> None:
    """ptxas reports registers per thread; a block of `num_warps` warps must fit in the SM's 65,536
    (allocated 8 per thread at a time): 255 registers at 8 warps just fit, 129 at 16 do not."""
    from v4serve.kernels.aot import Compiled, registers_per_block

    assert registers_per_block(255, 8) == 65_536 and registers_per_block(129, 16) == 69_632

    def compiled(registers: int, num_warps: int) -> Compiled:
        return Compiled("k", "sm_90", registers, shared_limit=1, num_warps=num_warps)

    assert compiled(255, 8).problems() == []
    (problem,) = compiled(129, 16).problems()
    assert problem.startswith("k on sm_90: 129 registers × 512 threads") and "cannot launch" in problem
