"""Turn the step's rows of logits into the next token of each request, per its sampling parameters,
all rows at once on the logits' device.

Order: logit_bias → grammar mask, or else min_tokens (no EOS or stop token yet) → penalties →
(logprobs reported from here) → temperature → top-k → top-p → min-p → draw. A request with a `seed`
draws from its own generator, so the same seed gives the same output whatever else shares the batch
(each of n choices from a stream of its own: `SamplingParams.generator_seed`).

What crosses between host and device per step: the parameters, bias/penalty indices and grammar
bitmasks go up (non-blocking copies from pinned memory on a GPU; nothing when no row needs them),
and one tensor comes back holding every row's token, its logprob, a flag (non-finite logits, or every
token barred) and the requested top logprobs; alternatives a mask barred (−inf) are dropped on the
host, so no non-finite logprob leaves the engine. The logits themselves never leave the device
(0.5 MB a row at V4's vocabulary). The draw is an exponential race, argmax(p / E) with E ~ Exp(1)
from the row's generator: a categorical draw from p that needs no host-side cumulative sum.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from v4serve.engine.penalties import PenaltyCounts
from v4serve.engine.request import Request, RequestError, Sample, SamplingParams
from v4serve.kernels.attention import upload

NEG_INF = float("-inf")


class NonFiniteLogits(ValueError):
    """A row of logits (after bias and penalties) holds NaN or +inf."""


class AllTokensBarred(RequestError):
    """Every token of a row is barred (grammar, logit_bias, min_tokens, a spent thinking budget): the
    request's own masks leave nothing to draw, and no logprob of it would be finite."""


# The flag column of `Sampler.on_device`: why a row cannot be sampled (0: it can).
_FLAG_NON_FINITE, _FLAG_ALL_BARRED = 1.0, 2.0


def finite_top(pairs: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """Alternatives a mask gave probability zero (logprob −inf) are not alternatives: JSON cannot carry
    them, and their ids are arbitrary among the tied −inf (so fewer than asked may be listed)."""
    return [(t, v) for t, v in pairs if math.isfinite(v)]


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> None:
    """One row, in place (the batched path, `_penalise`, computes the same)."""
    rows = _Rows.build([_RowPrep.of(None, params, prompt, output, eos=None, bitmask=None)], logits.device,
                       PenaltyCounts(logits.shape[-1], logits.device))
    _penalise(logits[None], rows)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row: temperature-scaled logits with everything outside top-k / top-p / min-p set to −inf."""
    return _filter(logits[None], *_filter_params([params], logits.device))[0]


def _filter_params(params: Sequence[SamplingParams], device: torch.device) -> tuple[torch.Tensor, ...]:
    vals = [[p.temperature, float(p.top_k if p.top_k > 0 else 0), p.top_p, p.min_p] for p in params]
    return upload(vals, device, torch.float32).view(len(params), 4).unbind(1)


def _filter(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            min_p: torch.Tensor) -> torch.Tensor:
    """logits [R, V] and per-row parameters [R] (top_k 0 = off) → scaled logits with everything
    outside each row's top-k / top-p / min-p set to −inf. Shapes never depend on the values."""
    logits = logits / temperature[:, None]
    sorted_logits, order = logits.sort(-1, descending=True)
    vocab = torch.arange(logits.shape[1], device=logits.device)
    k = torch.where((top_k > 0) & (top_k < logits.shape[1]), top_k, float(logits.shape[1])).long()
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # the k-th largest (ties with it stay)
    # top-p over what top-k kept, in sorted order: keep the smallest set reaching top_p; the most
    # likely token always stays, however small top_p is in this dtype.
    probs = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF).softmax(-1)
    drop_sorted = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (vocab > 0) & (top_p < 1.0)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    logits = logits.masked_fill((logits < kth) | drop, NEG_INF)
    kept = logits.softmax(-1)
    return logits.masked_fill(kept < min_p[:, None] * kept.amax(-1, keepdim=True), NEG_INF)


@dataclass
class _RowPrep:
    """What the host knows about one row before the device works on it."""

    params: SamplingParams
    generator_key: str | None
    bias: list[tuple[int, float]]
    ends: list[int]  # tokens barred before min_tokens
    bitmask: np.ndarray | None  # the grammar's allowed tokens, 32 a word
    # Penalised rows: the request's counts (`PenaltyCounts`, by this key) hold its prompt and committed
    # output; tokens drafted before this row (speculative decoding) count for this row alone.
    penalty_key: str | None = None
    prompt: Sequence[int] = ()
    committed: Sequence[int] = ()
    drafted: Sequence[int] = ()

    @classmethod
    def of(cls, request: Request | None, params: SamplingParams, prompt: list[int], output: list[int],
           eos: int | None, bitmask: np.ndarray | None, drafted: Sequence[int] = ()) -> _RowPrep:
        """`output`: the committed output tokens (all of them: under async scheduling a row is prepared
        once the step before it has been read); `drafted`: the drafts this row follows."""
        ends = []
        if bitmask is None and len(output) + len(drafted) < params.min_tokens:  # too early to stop
            ends = [*params.stop_token_ids, *([eos] if eos is not None else [])]
        key = None if request is None or params.seed is None else request.request_id
        if _thinking_spent(params, output, drafted):
            bitmask = _only(params.thinking_end_token)
        prep = cls(params, key, list(params.logit_bias.items()), ends, bitmask)
        if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
            prep.penalty_key = request.request_id if request is not None else ""
            prep.prompt, prep.committed, prep.drafted = prompt, output, drafted
        return prep

    @property
    def steady(self) -> bool:
        """The same for every later step of its request: nothing here depends on the output so far."""
        return (not self.ends and self.bitmask is None and self.penalty_key is None
                and self.params.thinking_budget is None)


def _thinking_spent(params: SamplingParams, output: list[int], drafted: Sequence[int] = ()) -> bool:
    """The thinking budget is used up and the thinking has not ended: the next token must end it."""
    end = params.thinking_end_token
    return (params.thinking_budget is not None and end is not None
            and len(output) + len(drafted) == params.thinking_budget and end not in output and end not in drafted)


def _only(token: int) -> np.ndarray:
    """A bitmask allowing `token` alone (tokens past its words are barred, as in a grammar's)."""
    words = np.zeros(token // 32 + 1, dtype=np.int32)
    words[-1] = np.int32(np.uint32(1 << (token % 32)).view(np.int32))
    return words


@dataclass
class _Rows:
    """The step's per-row inputs, on the device, built from host lists in a few uploads."""

    n: int
    params: list[SamplingParams]
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, tokens, values
    ends: tuple[torch.Tensor, torch.Tensor] | None
    # rows [P]; seen [P, V]; counts [P, V]; repetition, frequency, presence [P]
    penalised: tuple[torch.Tensor, ...] | None
    grammar: tuple[torch.Tensor, torch.Tensor] | None  # rows, bitmask words [G, W]

    @classmethod
    def build(cls, preps: list[_RowPrep], device: torch.device, penalties: PenaltyCounts) -> _Rows:
        def pairs(name: str) -> tuple[list[int], list[int]]:
            rows: list[int] = []
            toks: list[int] = []
            if not any(getattr(p, name) for p in preps):  # plain rows: the common case
                return rows, toks
            for i, p in enumerate(preps):
                items = getattr(p, name)
                rows += [i] * len(items)
                toks += [t if isinstance(t, int) else t[0] for t in items]
            return rows, toks

        def ints(*lists: list[int]) -> list[torch.Tensor]:
            return list(upload([x for lst in lists for x in lst], device).split([len(lst) for lst in lists]))

        bias = ends = grammar = None
        rows, toks = pairs("bias")
        if rows:
            vals = [v for p in preps for _, v in p.bias]
            bias = (*ints(rows, toks), upload(vals, device, torch.float32))
        rows, toks = pairs("ends")
        if rows:
            ends = tuple(ints(rows, toks))
        penalised = _penalty_rows(preps, device, penalties)
        masked = [i for i, p in enumerate(preps) if p.bitmask is not None]
        if masked:
            width = max(len(preps[i].bitmask) for i in masked)  # a short mask bars the tokens past it
            words = np.stack([np.pad(preps[i].bitmask, (0, width - len(preps[i].bitmask))) for i in masked])
            host = torch.from_numpy(words).pin_memory() if device.type == "cuda" else torch.from_numpy(words)
            grammar = (upload(masked, device), host.to(device, non_blocking=device.type != "cpu"))
        return cls(len(preps), [p.params for p in preps], bias, ends, penalised, grammar)


def _penalty_rows(preps: list[_RowPrep], device: torch.device, penalties: PenaltyCounts
                  ) -> tuple[torch.Tensor, ...] | None:
    """The penalised rows' counts, brought up to date (one upload of the tokens new since their last
    step) and gathered, with the drafts each row follows added to its own copy."""
    rows = [i for i, p in enumerate(preps) if p.penalty_key is not None]
    if not rows:
        return None
    keyed = [(preps[i].penalty_key or f"row {i}", preps[i].prompt, preps[i].committed) for i in rows]
    index = upload(penalties.rows(keyed), device)
    seen, counts = penalties.seen[index], penalties.counts[index]  # copies: drafts below stay in them
    drafted = [(j, t) for j, i in enumerate(rows) for t in preps[i].drafted]
    if drafted:
        r, t = upload([j for j, _ in drafted] + [t for _, t in drafted], device).split(len(drafted))
        seen.index_put_((r, t), torch.ones((), dtype=torch.bool, device=device))
        counts.index_put_((r, t), torch.ones((), device=device), accumulate=True)
    params = [preps[i].params for i in rows]
    values = upload([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params], device,
                    torch.float32).view(len(rows), 3)
    return (upload(rows, device), seen, counts, *values.unbind(1))


def _mask_grammar(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> None:
    """Bar every token whose bit is clear in its row's bitmask (token t: bit t % 32 of word t // 32;
    tokens past the mask are barred, as llguidance does)."""
    vocab = torch.arange(logits.shape[1], device=logits.device)
    index = (vocab >> 5).clamp_max(words.shape[1] - 1)
    allowed = ((words[:, index] >> (vocab & 31)) & 1).bool() & (vocab < 32 * words.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, NEG_INF)


def _penalise(logits: torch.Tensor, rows: _Rows) -> None:
    """Repetition (seen tokens' logits divided by it when positive, multiplied when not), then frequency
    and presence (minus count × frequency, minus presence once seen in the output). A penalty of 1.0 or
    0.0 changes no value, so the rows are penalised together whatever each one asked for."""
    if rows.penalised is None:
        return
    r, seen, counts, repetition, frequency, presence = rows.penalised
    vals = logits[r]
    rep = repetition[:, None]
    vals = torch.where(seen, torch.where(vals > 0, vals / rep, vals * rep), vals)
    logits[r] = vals - (frequency[:, None] * counts + presence[:, None] * (counts > 0).to(vals.dtype))


class HostCopy:
    """A device tensor on its way to the host: the copy is queued behind the work that makes it, and
    `wait` waits for that copy alone (not for work queued after it, such as the next step)."""

    def __init__(self, source: torch.Tensor, host: torch.Tensor, done: torch.cuda.Event | None) -> None:
        self.source = source  # held until the copy is done: the allocator must not reuse its memory earlier
        self.host, self.done = host, done

    @classmethod
    def start(cls, result: torch.Tensor) -> HostCopy:
        if result.device.type != "cuda":
            return cls(result, result.cpu(), None)
        host = torch.empty(result.shape, dtype=result.dtype, pin_memory=True)
        host.copy_(result, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls(result, host, done)

    def wait(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host


@dataclass
class SampledRows:
    """A step's samples, launched and not yet read (async scheduling)."""

    tokens: torch.Tensor  # [R] long, on the device: the next step's inputs
    copy: HostCopy  # the sampler's rows [R, 3 + 2w], on their way to the host
    logprobs: list[int]  # top logprobs asked for, per row

    def samples(self) -> list[Sample | Exception]:
        """Wait for the rows' copy (only), and read them."""
        host = self.copy.wait()
        width = (host.shape[1] - 3) // 2
        return [Sampler.unpack(row, k, width) for row, k in zip(host.tolist(), self.logprobs, strict=True)]


class Sampler:
    def __init__(self, seed: int = 0, eos_token_id: int | None = None, barred_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_id = eos_token_id
        # Ids the model reads but never writes (BOS, the role markers, an image placeholder): never drawn.
        self.barred_token_ids = tuple(barred_token_ids)
        self._barred: dict[torch.device, torch.Tensor] = {}
        self._seed = seed
        self._default: dict[torch.device, torch.Generator] = {}
        self._per_request: dict[str, torch.Generator] = {}
        # Each request's row preparation while it cannot change from step to step (no grammar, penalties,
        # thinking budget or min_tokens still to reach): most rows, made once instead of every step.
        self._steady: dict[str, _RowPrep] = {}
        self._penalties: PenaltyCounts | None = None  # made when a penalised row is first sampled

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)
        self._steady.pop(request_id, None)
        if self._penalties is not None:
            self._penalties.forget(request_id)

    def _generator(self, key: str | None, params: SamplingParams | None, device: torch.device) -> torch.Generator:
        if key is None:
            gen = self._default.get(device)
            if gen is None:
                gen = self._default[device] = torch.Generator(device).manual_seed(self._seed)
            return gen
        gen = self._per_request.get(key)
        if gen is None:  # the seed is hashed once, when the request's generator is made, not every step
            assert params is not None and params.generator_seed is not None
            gen = self._per_request[key] = torch.Generator(device).manual_seed(params.generator_seed)
        return gen

    def sample(self, request: Request, logits: torch.Tensor) -> Sample:
        """One request's next token from its row of logits [V]."""
        result = self.sample_rows([request], logits[None])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def sample_rows(self, requests: Sequence[Request], logits: torch.Tensor,
                    drafted: Sequence[Sequence[int]] | None = None) -> list[Sample | Exception]:
        """Row i of logits [R, V] → request i's next token, or the error that only it fails with.
        `drafted[i]`: draft tokens that row i follows (speculative decoding), taken as the request's
        output so far; a request's rows are drawn in order from its generator."""
        out: list[Sample | Exception | None] = [None] * len(requests)
        preps, live = [], []
        for i, request in enumerate(requests):
            try:
                preps.append(self.prepare(request, drafted[i] if drafted is not None else ()))
                live.append(i)
            except Exception as exc:  # its grammar failed: only it ends
                out[i] = exc
        if live:
            picked = logits if len(live) == len(requests) else logits[upload(live, logits.device)]
            for i, sample in zip(live, self._sample(preps, picked), strict=True):
                out[i] = sample
        return out  # type: ignore[return-value]

    def prepare(self, request: Request, drafted: Sequence[int] = ()) -> _RowPrep:
        """The host's part of one row: its bias, penalty indices and grammar bitmask, after `drafted`
        (drafts the grammar allows: the scheduler cut them to those)."""
        steady = self._steady.get(request.request_id)
        if steady is not None and steady.params is request.sampling and not drafted:
            return steady
        grammar = request.grammar
        bitmask = grammar.allowed_after(list(drafted)) if grammar is not None and grammar.active else None
        prep = _RowPrep.of(request, request.sampling, request.prompt_token_ids, request.output_token_ids,
                           self.eos_token_id, bitmask, drafted)
        if grammar is None and not drafted and prep.steady:
            self._steady[request.request_id] = prep
        return prep

    def sample_ahead(self, preps: list[_RowPrep], logits: torch.Tensor) -> SampledRows:
        """Every row's sampling launched on the device, its copy to the host started, nothing waited
        for: the next step can take the tokens as input before the host reads them."""
        result = self.on_device(preps, logits)
        return SampledRows(result[:, 0].long(), HostCopy.start(result), [p.params.logprobs or 0 for p in preps])

    def _sample(self, preps: list[_RowPrep], logits: torch.Tensor) -> list[Sample | Exception]:
        result = self.on_device(preps, logits)
        width = (result.shape[1] - 3) // 2
        return [self.unpack(row, p.params.logprobs or 0, width)
                for row, p in zip(HostCopy.start(result).wait().tolist(), preps, strict=True)]

    def on_device(self, preps: list[_RowPrep], logits: torch.Tensor) -> torch.Tensor:
        """Every row's sampling, on the logits' device, without reading anything back → [R, 3 + 2w]
        float64: token, flag (`_flags`), its logprob, then w top ids and w top logprobs (w: the most
        any row asked for). Token ids are exact in float64 (< 2^53), fp32 values widen exactly."""
        device = logits.device
        rows = _Rows.build(preps, device, self._penalty_counts(logits))
        logits = logits.float().clone()  # [R, V]
        if rows.bias is not None:
            r, t, v = rows.bias
            logits.index_put_((r, t), v, accumulate=True)  # ids were checked against the vocabulary
        if rows.grammar is not None:
            _mask_grammar(logits, *rows.grammar)  # the grammar decides when the output may end
        if rows.ends is not None:
            logits[rows.ends] = NEG_INF
        _penalise(logits, rows)
        flag = _flags(logits)
        logprobs = logits.log_softmax(-1)
        if self.barred_token_ids:  # after the logprobs, which stay the model's: barring only changes the draw
            logits[:, self._barred_on(device, logits.shape[1])] = NEG_INF
        tokens = self._draw(logits, preps, device)
        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        parts = [tokens.double()[:, None], flag[:, None], chosen.double()[:, None]]
        width = min(max((p.params.logprobs or 0) for p in preps), logprobs.shape[1])
        if width:
            vals, ids = logprobs.topk(width, -1)
            parts += [ids.double(), vals.double()]
        return torch.cat(parts, 1)

    def _barred_on(self, device: torch.device, width: int) -> torch.Tensor:
        barred = self._barred.get(device)
        if barred is None:
            ids = [i for i in self.barred_token_ids if i < width]
            barred = self._barred[device] = torch.tensor(ids, dtype=torch.long, device=device)
        return barred

    def _draw(self, logits: torch.Tensor, preps: list[_RowPrep], device: torch.device) -> torch.Tensor:
        tokens = logits.argmax(-1)
        sampled = [i for i, p in enumerate(preps) if not p.params.greedy]
        if not sampled:
            return tokens
        index = upload(sampled, device)
        probs = _filter(logits[index], *_filter_params([preps[i].params for i in sampled], device)).softmax(-1)
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(sampled) if preps[i].generator_key is None]
        if unseeded:  # one draw for every row on the shared generator
            shared = torch.empty(len(unseeded), probs.shape[1], device=device)
            shared.exponential_(generator=self._generator(None, None, device))
            noise[upload(unseeded, device)] = shared
        for j, i in enumerate(sampled):
            if preps[i].generator_key is not None:
                gen = self._generator(preps[i].generator_key, preps[i].params, device)
                noise[j].exponential_(generator=gen)
        # clamp: an Exp(1) draw of exactly 0 would turn a barred token's 0 into 0/0
        picked = (probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(-1)
        return tokens.index_put((index,), picked)

    def _penalty_counts(self, logits: torch.Tensor) -> PenaltyCounts:
        if self._penalties is None or self._penalties.device != logits.device:
            self._penalties = PenaltyCounts(logits.shape[1], logits.device)
        return self._penalties

    @staticmethod
    def unpack(row: list[float], k: int, width: int) -> Sample | Exception:
        if row[1] == _FLAG_ALL_BARRED:
            return AllTokensBarred("every token is barred (by the grammar, logit_bias, min_tokens or the thinking "
                                   "budget together): nothing can be sampled")
        if row[1] or not math.isfinite(row[2]):  # a drawn token always has a finite logprob unless the row is bad
            return NonFiniteLogits("the logits are not finite (NaN or +inf); nothing can be sampled from them")
        if not k or not width:  # no top logprobs asked for (the common case)
            return Sample(token=int(row[0]), logprob=row[2], top=[])
        k = min(k, width)
        top = finite_top([(int(t), v) for t, v in zip(row[3:3 + k], row[3 + width:3 + width + k], strict=True)])
        return Sample(token=int(row[0]), logprob=row[2], top=top)


def _flags(logits: torch.Tensor) -> torch.Tensor:
    """Per row [R] float64: `_FLAG_NON_FINITE` for NaN or +inf, `_FLAG_ALL_BARRED` when every token is
    −inf (its log_softmax would be NaN throughout), else 0; on the device, no read back."""
    bad = (torch.isnan(logits) | torch.isposinf(logits)).any(-1)
    barred = torch.isneginf(logits).all(-1)
    return torch.where(bad, _FLAG_NON_FINITE, barred.double() * _FLAG_ALL_BARRED)
