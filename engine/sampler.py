"""Turn one row of logits into the next token for a request, per its sampling parameters.

Order: logit_bias → grammar mask, or else min_tokens (no EOS or stop token yet) → penalties →
(logprobs reported from here) → temperature → top-k → top-p → min-p → draw. A request with a `seed` draws from its own
generator, so the same seed gives the same output whatever else shares the batch.
"""

from __future__ import annotations

import torch

from v4serve.engine.request import Request, Sample, SamplingParams


class NonFiniteLogits(ValueError):
    """A row of logits (after bias and penalties) holds NaN or +inf."""


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output and (params.presence_penalty or params.frequency_penalty):
        ids = torch.tensor(output, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[0]).to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to −inf."""
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[0]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest set reaching top_p
        drop[0] = False  # the most likely token always stays, however small top_p is in this dtype
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0, eos_token_id: int | None = None) -> None:
        self.eos_token_id = eos_token_id
        self._default = torch.Generator().manual_seed(seed)
        self._per_request: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator:
        if request.sampling.seed is None:
            return self._default
        gen = self._per_request.get(request.request_id)
        if gen is None:
            gen = self._per_request[request.request_id] = torch.Generator().manual_seed(request.sampling.seed)
        return gen

    def sample(self, request: Request, logits: torch.Tensor) -> Sample:
        params = request.sampling
        logits = logits.float().cpu().clone()
        for token, bias in params.logit_bias.items():  # ids were checked against the vocabulary
            logits[token] += bias
        if request.grammar is not None and request.grammar.active:
            request.grammar.mask(logits)  # the grammar decides when the output may end
        elif len(request.output_token_ids) < params.min_tokens:  # too early to stop
            ends = [*params.stop_token_ids, *([self.eos_token_id] if self.eos_token_id is not None else [])]
            logits[ends] = float("-inf")
        apply_penalties(logits, params, request.prompt_token_ids, request.output_token_ids)
        if torch.isnan(logits).any() or torch.isposinf(logits).any():
            raise NonFiniteLogits("the logits are not finite (NaN or +inf); nothing can be sampled from them")
        logprobs = logits.log_softmax(-1)
        if params.greedy:
            token = int(logits.argmax())
        else:
            probs = filter_logits(logits, params).softmax(-1)
            token = int(torch.multinomial(probs, 1, generator=self._generator(request)))
        top: list[tuple[int, float]] = []
        if params.logprobs:
            vals, ids = logprobs.topk(params.logprobs)
            top = list(zip(ids.tolist(), vals.tolist(), strict=True))
        return Sample(token=token, logprob=float(logprobs[token]), top=top)
