"""Async scheduling: the host schedules and launches step N+1 while the device runs step N.

Each step: schedule; launch the forward, its inputs for requests with a token in flight taken from
step N's sampled tokens on the device (`InFlight.input_fill`); read step N's samples (waiting for
step N alone) for stop checks and outputs; launch this step's sampling, its rows prepared with every
token before them known; account this step's chunks. What this changes, and why each case stays
correct:

- A request whose token in flight ends it by length is not scheduled again (`Scheduler._ends_on_pending`);
  one that ends by a stop token was already in the next step's forward, which computed that token:
  it is not sampled there and ends once that step is accounted, its state exact one token further (a
  response end then includes its stop token; the next turn's prompt carries it too).
- A request with a token in flight is never preempted (that token is valid and unknown); a request
  that cannot grow without preempting one waits a step.
- A grammar's mask, penalties and a thinking budget need the last token's value: the sampling is
  prepared after it is read (the forward runs meanwhile). Speculative decoding runs in series.
- Under tensor parallelism the other ranks get the tokens in flight from rank 0's device (a broadcast
  over the model's own group, after the step's message says where they go).
- Seeded sampling draws the same numbers: each request's rows are drawn from its own generator in
  the same order, and never for a step past its stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the front end checks the flag's value with this module
    import torch

    from v4serve.engine.sampler import SampledRows
    from v4serve.engine.scheduler import ScheduledChunk

# --async-scheduling values.
ASYNC_SCHEDULING_CHOICES = ("auto", "on", "off")


def async_scheduling(choice: str, device: torch.device, speculative: bool) -> str:
    """"on", or "off (why)". `auto` is on for CUDA only: a CPU runs the forward synchronously, so the
    host has nothing to overlap there and the extra step of bookkeeping is pure cost."""
    if choice not in ASYNC_SCHEDULING_CHOICES:
        raise ValueError(f"--async-scheduling must be one of {', '.join(ASYNC_SCHEDULING_CHOICES)}, not {choice!r}")
    if choice == "off":
        return "off (--async-scheduling off)"
    if speculative:
        return "off (speculative decoding judges drafts against the tokens before the next step)"
    if choice == "auto" and device.type != "cuda":
        return f"off (auto: the forward is synchronous on {device.type}, nothing to overlap)"
    return "on"


@dataclass
class InFlight:
    """A launched step whose samples the host has not read: `sampled[i]`'s token is row i."""

    sampled: list[ScheduledChunk]
    rows: SampledRows

    def input_fill(self, chunks: list[ScheduledChunk]) -> tuple[list[int], list[int]]:
        """For the next step's chunks: (places in its token ids, rows of this step's tokens) of the
        tokens still in flight."""
        row_of = {id(c.request): i for i, c in enumerate(self.sampled)}
        places, rows, at = [], [], 0
        for c in chunks:
            r = c.request
            at += c.num_new
            if r.pending_tokens and r.num_computed_tokens + c.num_new == r.num_tokens + r.pending_tokens:
                places.append(at - 1)
                rows.append(row_of[id(r)])
        return places, rows
