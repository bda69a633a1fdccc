"""Shared test helpers: small models and engines that record the logits they sample from."""

from __future__ import annotations

import functools
import platform
import sys

import pytest
import torch

from v4serve.engine.engine import EngineConfig, LLMEngine
from v4serve.engine.model.parallel.single import SingleSequence
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.request import Request, SamplingParams

# Triton publishes wheels for Linux on x86_64 only. There the Makefile installs it, so a missing
# triton fails the Triton tests rather than skipping them; elsewhere they cannot run.
requires_triton = pytest.mark.skipif(
    not (sys.platform == "linux" and platform.machine() == "x86_64"),
    reason=f"Triton has no wheel for {sys.platform} on {platform.machine()}")

# Window 8 and ratios 4/16 (blocks of 16 tokens): short prompts cross many edges.
SMALL = dict(hidden_size=64, num_heads=4, head_dim=32, rope_dim=8, q_lora_rank=32, o_groups=2,
             o_lora_rank=32, index_n_heads=16, index_head_dim=16, index_topk=6, moe_intermediate_size=32,
             n_routed_experts=6, num_experts_per_tok=2, num_layers=5, compress_ratios=(0, 4, 16, 4, 16),
             window=8, num_hash_layers=1)
# One layer of each kind (window only, CSA, HCA): what the tests of interpreted Triton kernels run. The
# interpreter's cost is per launch, and a second layer of a kind launches the same kernels again.
SMALL_ONE_OF_EACH = {**SMALL, "num_layers": 3, "compress_ratios": (0, 4, 16)}


@functools.cache
def small_model() -> DeepseekV4:
    return build_tiny(tiny_config(**SMALL), seed=11)


@functools.cache
def tiny_model() -> DeepseekV4:
    return build_tiny()


class RecordingEngine(LLMEngine):
    """An engine that keeps every logits row it samples from, per request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.logits: dict[str, list[torch.Tensor]] = {}

    def update(self, chunks, logits):
        first, i = {}, 0  # each completing chunk's first sampled row (a drafted chunk samples several)
        for chunk in chunks:
            i += len(self.logit_rows(chunk))
            if chunk.completes:
                first[chunk.request.request_id] = i - 1 - len(chunk.drafts)
        outputs = super().update(chunks, logits)
        made = {out.request_id: len(out.new_token_ids) for out in outputs}
        for rid, row in first.items():  # the rows of the tokens it kept (one row for a failed request)
            self.logits.setdefault(rid, []).extend(r.clone() for r in logits[row:row + max(made.get(rid, 0), 1)])
        return outputs

    def _sample_ahead(self, plan, logits, failed, ending):
        # Async scheduling samples here, each completing chunk's last row, and the token is kept unless
        # the request is already ending (in `ending`), as `update` keeps it in a synchronous step.
        i = 0
        for chunk, n, _, completes in plan:
            i += n
            if completes and id(chunk.request) not in ending:
                self.logits.setdefault(chunk.request.request_id, []).append(logits[i - 1].clone())
        return super()._sample_ahead(plan, logits, failed, ending)

    def check(self) -> None:
        self.kv.check_integrity([r.kv for r in self.scheduler.running])

    def run_checked(self) -> None:
        """Step to completion, checking cache integrity after every step."""
        while self.has_work():
            self.step()
            self.check()


def engine_for(model: DeepseekV4, **overrides) -> RecordingEngine:
    cfg = dict(max_model_len=4096, max_num_seqs=4, swa_checkpoint_interval=4 * model.cfg.block_size)
    cfg.update(overrides)
    return RecordingEngine(model, EngineConfig(**cfg))


def greedy(rid: str, prompt: list[int], n: int = 6, salt: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True), cache_salt=salt)


def reference(model: DeepseekV4, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """Each decision's logits from one uncached sequence: the prompt, then the chosen tokens."""
    seq = SingleSequence(model, len(prompt) + len(outputs) + 1)
    rows = [seq.step(prompt)[-1]]
    for tok in outputs[:-1]:
        rows.append(seq.step([tok])[-1])
    return torch.stack(rows)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def tokens(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(64, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def v41_rounding_off(monkeypatch) -> None:
    """DeepSeek-V4.1's KV rounding (FP8 window, MXFP4 indexer, NVFP4 entries) made the identity, for comparisons
    that differ in last bits (another chunking, another implementation), which a rounding bin would magnify."""
    from v4serve.engine.model.v41 import attention

    for name in ("round_fp8", "round_mxfp4", "round_nvfp4"):
        monkeypatch.setattr(attention, name, lambda rows: rows)

