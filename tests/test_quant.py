"""FP8 block and packed FP4 dequantization against hand-built codes with known values."""

from __future__ import annotations

import pytest
import torch

from v4serve.engine.model.weights.quant import (
    FP4_E2M1_VALUES,
    dequant_fp4_packed,
    dequant_fp8_block,
    quantize_fp4_packed,
    quantize_fp8_block,
    scale_to_float32,
    unpack_fp4,
)

E8M0 = torch.float8_e8m0fnu


def e8m0(exponents: list[list[int]]) -> torch.Tensor:
    """Scale 2**e for each exponent, stored as e8m0 bytes (bias 127)."""
    return (torch.tensor(exponents, dtype=torch.int16) + 127).to(torch.uint8).view(E8M0)


# e4m3 bytes: sign | 4 exponent bits (bias 7) | 3 mantissa bits.
E4M3 = {
    0x00: 0.0,
    0x80: -0.0,
    0x38: 1.0,
    0xB8: -1.0,
    0x3C: 1.5,  # mantissa 100
    0x40: 2.0,
    0xC5: -3.25,  # exponent 8, mantissa 101: -(1 + 5/8) * 2
    0x7E: 448.0,  # the largest finite e4m3 value
    0x01: 2.0**-9,  # smallest subnormal: 1/8 * 2**-6
}


def fp8_bytes(grid: torch.Tensor) -> torch.Tensor:
    return grid.to(torch.uint8).view(torch.float8_e4m3fn)


def test_e4m3_byte_table_matches_torch() -> None:
    # The hand-written table above is what every expectation below is built from; pin it.
    codes = torch.tensor(list(E4M3), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    assert codes.tolist() == list(E4M3.values())


def test_fp8_block_dequant_non_multiple_shape_e8m0_scales() -> None:
    n, k = 130, 260  # 2 x 3 blocks of 128, the last row/column blocks partial
    grid = torch.full((n, k), 0x38, dtype=torch.int32)  # 1.0 everywhere
    picks = {(0, 0): 0xB8, (127, 127): 0x3C, (128, 128): 0xC5, (129, 259): 0x7E, (0, 256): 0x01, (5, 200): 0x00}
    for (i, j), byte in picks.items():
        grid[i, j] = byte
    exps = [[0, 1, -2], [3, -1, 4]]  # block (r, c) scales by 2**exps[r][c]
    out = dequant_fp8_block(fp8_bytes(grid), e8m0(exps))
    assert out.shape == (n, k) and out.dtype == torch.float32
    for (i, j), byte in picks.items():
        assert out[i, j].item() == E4M3[byte] * 2.0 ** exps[i // 128][j // 128], (i, j)
    # Unpicked entries are 1.0 times their block's scale; check one per block, edges included.
    for i, j in [(1, 1), (1, 129), (127, 255), (129, 0), (128, 255), (129, 258)]:
        assert out[i, j].item() == 2.0 ** exps[i // 128][j // 128], (i, j)
    assert out[0, 0].item() == -1.0


def test_fp8_block_dequant_fp32_scales_and_out_dtype() -> None:
    grid = torch.tensor([[0x38, 0xB8, 0x40], [0x3C, 0x00, 0x7E]])
    scale = torch.tensor([[0.25]])  # one (partial) block covers everything
    out = dequant_fp8_block(fp8_bytes(grid), scale, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [[0.25, -0.25, 0.5], [0.375, 0.0, 112.0]]


def test_fp8_block_dequant_batched_experts_and_custom_block() -> None:
    grid = torch.full((2, 4, 4), 0x38)
    scale = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])
    out = dequant_fp8_block(fp8_bytes(grid), scale, block=(2, 2))
    assert out[1, 3, 0].item() == 7.0 and out[0, 0, 3].item() == 2.0 and out[1, 2, 2].item() == 8.0


def test_fp8_rejects_wrong_scale_shape_and_dtype() -> None:
    w = fp8_bytes(torch.full((130, 260), 0x38))
    with pytest.raises(ValueError, match=r"scale has shape \(1, 3\).*\(130, 260\).*needs \(2, 3\)"):
        dequant_fp8_block(w, torch.ones(1, 3))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequant_fp8_block(torch.ones(4, 4), torch.ones(1, 1))


def test_e2m1_table() -> None:
    assert FP4_E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert FP4_E2M1_VALUES[8:] == tuple(-v for v in FP4_E2M1_VALUES[:8])


def packed(rows: list[list[int]]) -> torch.Tensor:
    """Bytes as int8 storage (values >= 0x80 wrap negative, as in real checkpoints)."""
    return torch.tensor(rows, dtype=torch.uint8).view(torch.int8)


def test_fp4_nibble_order_low_first() -> None:
    # 0x7F: low nibble 0xF = -6.0 is element 0, high nibble 0x7 = +6.0 is element 1.
    # 0x10: 0.0 then 0.5; 0x9A: 0xA = -1.0 then 0x9 = -0.5; 0x38: 0x8 = -0.0 then 0x3 = 1.5.
    vals = unpack_fp4(packed([[0x7F, 0x10, 0x9A, 0x38]]))
    assert vals.tolist() == [[-6.0, 6.0, 0.0, 0.5, -1.0, -0.5, -0.0, 1.5]]
    assert torch.signbit(vals[0, 6]).item()  # code 8 is negative zero


def test_fp4_all_codes() -> None:
    # Byte b = lo | hi << 4 for every pair of codes.
    rows = [[lo | (hi << 4) for lo in range(16)] for hi in range(16)]
    vals = unpack_fp4(packed(rows))
    for hi in range(16):
        for lo in range(16):
            assert vals[hi, 2 * lo].item() == FP4_E2M1_VALUES[lo]
            assert vals[hi, 2 * lo + 1].item() == FP4_E2M1_VALUES[hi]


def test_fp4_dequant_groups_of_32_with_e8m0_scales() -> None:
    # 2 rows x 64 logical elements = 32 bytes per row, 2 scale groups per row.
    raw = torch.full((2, 32), 0x22, dtype=torch.int32)  # 1.0, 1.0 everywhere
    raw[0, 0] = 0x7F  # (0,0) = -6, (0,1) = +6          group 0 of row 0
    raw[0, 15] = 0x9A  # (0,30) = -1, (0,31) = -0.5      last pair of group 0
    raw[0, 16] = 0x00  # (0,32) = 0, (0,33) = 0          first pair of group 1
    raw[1, 31] = 0xF7  # (1,62) = +6, (1,63) = -6
    exps = [[0, 1], [-1, 3]]
    out = dequant_fp4_packed(packed(raw.tolist()), e8m0(exps))
    assert out.shape == (2, 64)
    assert out[0, :2].tolist() == [-6.0, 6.0]
    assert out[0, 30:34].tolist() == [-1.0, -0.5, 0.0, 0.0]
    assert out[0, 34].item() == 2.0  # 1.0 * 2**1 in group 1
    assert out[1, 0].item() == 0.5  # 1.0 * 2**-1
    assert out[1, 62:].tolist() == [48.0, -48.0]  # +-6 * 2**3


def test_fp4_dequant_partial_group_fp32_scales_uint8_and_fp4x2_storage() -> None:
    raw = [[0x22] * 20]  # 40 logical elements: one full group of 32 and a partial one of 8
    raw[0][19] = 0x7F
    scale = torch.tensor([[0.5, 3.0]])
    expect = [0.5] * 32 + [3.0] * 6 + [-18.0, 18.0]
    assert dequant_fp4_packed(packed(raw), scale).tolist() == [expect]
    as_u8 = torch.tensor(raw, dtype=torch.uint8)
    assert dequant_fp4_packed(as_u8, scale).tolist() == [expect]
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert dequant_fp4_packed(as_u8.view(torch.float4_e2m1fn_x2), scale).tolist() == [expect]


def test_fp4_rejects_wrong_scale_shape_and_dtype() -> None:
    with pytest.raises(ValueError, match=r"scale has shape \(2, 1\).*needs \(2, 2\)"):
        dequant_fp4_packed(packed([[0] * 32, [0] * 32]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="int8"):
        unpack_fp4(torch.zeros(2, 2))


def test_raw_e8m0_bytes_and_nan() -> None:
    raw = torch.tensor([0, 126, 127, 130, 255], dtype=torch.uint8)
    got = scale_to_float32(raw)
    assert got[1:4].tolist() == [0.5, 1.0, 8.0] and got[0].item() == 2.0**-127 and got[4].isnan()
    assert torch.equal(scale_to_float32(raw[:4].view(E8M0)), got[:4])


@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0])
def test_quantizers_round_trip(scale_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 130, 70, generator=gen)
    q8, s8 = quantize_fp8_block(w, scale_dtype=scale_dtype)
    assert q8.dtype == torch.float8_e4m3fn and s8.shape == (3, 2, 1) and s8.dtype == scale_dtype
    assert torch.allclose(dequant_fp8_block(q8, s8), w, rtol=0.07, atol=1e-2)
    q4, s4 = quantize_fp4_packed(w, scale_dtype=scale_dtype)
    assert q4.dtype == torch.int8 and q4.shape == (3, 130, 35) and s4.shape == (3, 130, 3)
    deq = dequant_fp4_packed(q4, s4)
    # e2m1 has one mantissa bit: within half a step of the group's scale grid.
    assert (deq - w).abs().max() <= s4.float().max() * 1.0 + 1e-6
    exact = torch.tensor([[6.0, -6.0, 0.5, -0.0, 3.0, -1.5] + [0.0] * 26])
    q, s = quantize_fp4_packed(exact, scale_dtype=scale_dtype)
    assert dequant_fp4_packed(q, s).tolist() == exact.tolist()
