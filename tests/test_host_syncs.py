"""A decode step on the Triton backend never makes the host wait for the device: its forward, at
DeepSeek-V4-Flash's shapes on the `meta` device (packed weights, bf16 and FP8 KV, batch 1 to 32,
contexts 300 to 64K), records every op and every Python-level read under `HostSyncs` and finds no
value read back (`.item()`, `nonzero`, `unique`, `bincount`, ...), no blocking copy between host
and device and no `.tolist()`/`.item()` of a device tensor. The step's metadata crosses in one
non-blocking copy. And the recorder can fail: each kind of sync is found."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers import requires_triton
from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.layout import KVLayout, key_record
from v4serve.engine.model.gpu.aot import DECODE_STEPS, Scenario, meta_model, run_step
from v4serve.kernels.launches import HostSyncs, LaunchRecorder

pytestmark = requires_triton


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_decode_step_never_waits_for_the_device(kv_cache_dtype: str) -> None:
    model = meta_model(Scenario("deepseek-v4-flash", kv_cache_dtype))
    cfg = model.cfg
    record = key_record(cfg.head_dim, cfg.rope_dim, "bfloat16", kv_cache_dtype)
    kv = DeviceKV(KVLayout.from_config(cfg, record), num_slots=32, num_blocks=32 * 513, dtype=torch.bfloat16,
                  device="meta")
    for step in DECODE_STEPS:
        with LaunchRecorder() as launches, HostSyncs() as syncs:
            run_step(model, kv, step)
        assert syncs.found == [], step.name
        assert syncs.transfers == 1, step.name  # the step's metadata, non-blocking
        assert sum(launches.launches.values()) > 0


def test_every_kind_of_sync_is_found() -> None:
    device = torch.zeros(4, device="meta")
    with HostSyncs() as syncs:
        for read in (lambda: device.nonzero(), lambda: torch.bincount(device.long()), lambda: device.item(),
                     lambda: device.tolist(), lambda: device.unique(), lambda: bool(device.sum())):
            try:
                read()
            except (RuntimeError, NotImplementedError):
                pass  # a meta tensor has no values to give: the attempt is what counts
        torch.zeros(4).to("meta")
        torch.zeros(4).to("meta", non_blocking=True)
        device[[0, 1]]  # a list index is built on the host and copied up, blocking
        with contextlib.suppress(RuntimeError):  # meta refuses it; a GPU op would copy it up, blocking
            torch.add(device, torch.ones(4))
    found = "\n".join(syncs.found)
    for expected in ("aten.nonzero", "aten.bincount", "Tensor.item()", "Tensor.tolist()", "unique",
                     "Tensor.__bool__()", "copies host → device, blocking", "Tensor.__getitem__",
                     "aten.add takes host tensors"):
        assert expected in found, expected
    assert found.count("copies host → device") == 1  # the non-blocking copy is fine
