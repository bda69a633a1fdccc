"""Decode graphs under tensor parallelism, checked on the CPU: two gloo ranks run their decode steps
from the graphs' static buffers (uncaptured: what a CUDA replay reads), sent as one fixed-size
message of token ids, positions, slots and block-table changes, and give bitwise the eager steps'
logits and KV bytes — at batches that fill a bucket (a padded bucket changes the dense GEMMs' row
count, so their CPU blocking: same greedy tokens, fp32 noise), at block edges, after prefix hits
whose last prompt token runs as a decode step, with every rank holding the same KV."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.test_parallel_serve import WIDE
from v4serve.engine.engine import EngineConfig, LLMEngine
from v4serve.engine.model.parallel.sharding import ParallelConfig
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.weights.checkpoint import write_checkpoint
from v4serve.engine.mtp import MTPRows, MTPSeed
from v4serve.engine.process.rank_group import RankGroup
from v4serve.engine.request import Request, SamplingParams
from v4serve.engine.step_plan import DecodeStep, MTPPass, StepPlan, Wire
from v4serve.kernels.attention import SlotTables
from v4serve.server.config import ServeConfig
from v4serve.server.model_loading import load

BLOCK = 16
# Rounds of requests arriving together, each round's batch a bucket (1, 2, 4) but the last (3 rows
# padded to 4). Prompts around block edges; 20 decodes cross the next edge. A repeated prompt is a
# prefix hit whose last token alone runs: a decode step with a new table (3 blocks: in the fixed
# message; 6 blocks: past it, sent as a plan).
ROUNDS = [[15, 16, 17, 33], [33], [81, 40], [81], [15, 16, 17]]
EXACT = len(ROUNDS) - 1


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + n + 13 * salt) % 250 + 3 for i in range(n)]


class CountingGroup(RankGroup):
    """Counts how each step reached the other ranks."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sent = {"wire": 0, "static plan": 0, "eager plan": 0, "mtp wire": 0, "mtp object": 0}
        self.writes: set[str] = set()  # the KV writes mirrored, by name

    def run_decode(self, step: DecodeStep) -> bool:
        sent = super().run_decode(step)
        self.sent["wire"] += sent
        return sent

    def run_step(self, plan: StepPlan) -> None:
        self.sent["static plan" if plan.static else "eager plan"] += 1
        self.writes.update(name for name, _ in plan.kv_writes)
        super().run_step(plan)

    def run_mtp(self, work: MTPPass) -> None:
        self.writes.update(name for name, _ in work.kv_writes)
        super().run_mtp(work)
        self.sent["mtp wire" if self._wire.kind in (Wire.MTP_COMMIT, Wire.MTP_PROPOSE) else "mtp object"] += 1


class LogitsEngine(LLMEngine):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.logits: list[torch.Tensor] = []
        self.shapes: list[tuple[int, ...]] = []  # each step's rows per sequence

    def execute(self, chunks, ahead=None):  # type: ignore[no-untyped-def]
        out = super().execute(chunks, ahead)
        self.logits.append(out.clone())
        self.shapes.append(tuple(c.num_new for c in chunks))
        return out


def serve(folder: str, graphs: bool, async_scheduling: str = "off", speculative: str | None = None,
          truth: dict[str, list[int]] | None = None, rounds: list[list[int]] = ROUNDS) -> dict[str, object]:
    """Every round through a two-rank engine, then a request arriving while another decodes: each
    step's logits, rank 0's KV after each round (the scratch slot and block left out), every rank's
    KV digest, and how steps were sent. `truth`: each request's greedy output, which the scheduler
    drafts from (`rigged_drafts`)."""
    serve_config = ServeConfig(model=folder, speculative_config=speculative)
    group, model = CountingGroup.spawn(ParallelConfig(2), functools.partial(load, serve_config), torch.device("cpu"))
    config = EngineConfig(max_num_seqs=4, max_model_len=256, num_blocks=48, uncaptured_graphs=graphs,
                          swa_cache_mode="full", async_scheduling=async_scheduling,
                          speculative=serve_config.speculative, rowwise_drafts=True)
    engine = LogitsEngine(model, config, ranks=group)
    if truth is not None:
        engine.scheduler.drafter = rigged_drafts(truth)
    try:
        tokens, kv, steps = [], [], []
        for r, lengths in enumerate(rounds):
            for i, n in enumerate(lengths):
                salt = lengths[:i].count(n)  # prompts of one length in one round differ
                engine.add_request(Request(f"{r}-{i}", prompt(n, salt), SamplingParams(max_tokens=20, ignore_eos=True)))
            while engine.has_work():
                tokens += [(o.request_id, o.new_token_ids) for o in engine.step()]
            steps.append(len(engine.logits))
            kv.append([t[:-1].clone() if graphs else t.clone() for layer in engine.device_kv.layers
                       for t in (*layer.slot_tensors(), *layer.block_tensors())])
        # A step mixing a prefill chunk with a decode (whose token, under async scheduling, is in flight).
        engine.add_request(Request("late-0", prompt(20), SamplingParams(max_tokens=8, ignore_eos=True)))
        for _ in range(3):
            tokens += [(o.request_id, o.new_token_ids) for o in engine.step()]
        engine.add_request(Request("late-1", prompt(30), SamplingParams(max_tokens=8, ignore_eos=True)))
        while engine.has_work():
            tokens += [(o.request_id, o.new_token_ids) for o in engine.step()]
        return {"logits": engine.logits, "steps": steps, "tokens": tokens, "kv": kv, "digests": engine.kv_digests(),
                "sent": dict(group.sent), "writes": group.writes, "graphs": engine.graphs is not None,
                "shapes": engine.shapes,
                "drafts": (engine.spec.drafts, engine.spec.accepted_tokens),
                "mtp static": engine.mtp.graphs.runs if engine.mtp is not None and engine.mtp.graphs else 0}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    folder = str(write_checkpoint(build_tiny(tiny_config(**WIDE), seed=9), tmp_path_factory.mktemp("wide")))
    return {"eager": serve(folder, graphs=False), "static": serve(folder, graphs=True),
            "static async": serve(folder, graphs=True, async_scheduling="on")}


def test_static_steps_at_two_ranks_are_the_eager_steps(runs: dict[str, dict]) -> None:
    eager, static = runs["eager"], runs["static"]
    assert static["graphs"] and not eager["graphs"]
    assert static["tokens"] == eager["tokens"]
    assert static["steps"] == eager["steps"]
    exact = static["steps"][EXACT - 1]
    for i, (got, want) in enumerate(zip(static["logits"], eager["logits"], strict=True)):
        if i < exact or i >= static["steps"][-1]:  # the padded round is noise; the late arrivals fill buckets
            assert torch.equal(got, want), f"step {i}"
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(set(static["digests"])) == 1 and len(set(eager["digests"])) == 1  # every rank the same KV


def test_static_steps_write_the_eager_kv_bytes(runs: dict[str, dict]) -> None:
    """Rank 0's KV (every worker's is the same: the digests) after each round: bitwise while batches
    fill their buckets, fp32 noise after the padded round."""
    eager, static = runs["eager"], runs["static"]
    for r in range(len(ROUNDS)):
        for got, want in zip(static["kv"][r], eager["kv"][r], strict=True):
            if r < EXACT:
                assert torch.equal(got, want), f"round {r}"
            else:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


MTP = '{"method": "mtp", "num_speculative_tokens": 2}'
# The first round moves in step (one length, drafts always right): its drafted passes fill a bucket of
# four sequences of three rows, but where a pass would cross a block edge (a drafted pass ends on
# snapshot points), which cuts every sequence's alike.
MTP_ROUNDS = [[13, 13, 13, 13], [33], [81, 40], [15, 16, 17]]


def rigged_drafts(truth: dict[str, list[int]]) -> Callable[[Request, int], list[int]]:
    """The greedy output's next tokens as drafts (the MTP layer still runs beside them: a random
    layer's own drafts are never kept): right for the first round's requests, so their passes move in
    step and fill their bucket; after that wrong at the first or second of them on some passes: passes
    kept whole, kept in part and rejected at once, and the recomputes that follow."""

    def draft(request: Request, most: int) -> list[int]:
        made = len(request.output_token_ids)
        drafts = truth[request.request_id][made:made + min(most, 2)]  # as many as the MTP layer makes
        wrong = None if request.request_id.startswith("0-") else {0: 0, 2: 1}.get(made % 5)
        if wrong is not None and wrong < len(drafts):
            drafts[wrong] = drafts[wrong] % 250 + 3
        return drafts

    return draft


@pytest.fixture(scope="module")
def mtp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    model = build_tiny(tiny_config(**WIDE, num_nextn_predict_layers=1), seed=9)
    folder = str(write_checkpoint(model, tmp_path_factory.mktemp("wide-mtp")))
    truth: dict[str, list[int]] = {}
    for rid, tokens in serve(folder, graphs=False, rounds=MTP_ROUNDS)["tokens"]:  # type: ignore[attr-defined]
        truth.setdefault(rid, []).extend(tokens)
    return {"truth": truth, "eager": serve(folder, graphs=False, speculative=MTP, truth=truth, rounds=MTP_ROUNDS),
            "static": serve(folder, graphs=True, speculative=MTP, truth=truth, rounds=MTP_ROUNDS)}


def test_static_drafted_steps_at_two_ranks_are_the_eager_steps(mtp_runs: dict[str, dict]) -> None:
    """MTP drafts (two per sequence: passes of three rows, fewer where drafting paused or a rejected
    draft's tokens are computed again): each drafted pass runs from a row-wise bucket, its sequences
    padded to three rows and its batch to the bucket. Bitwise the eager pass where nothing was padded
    (the padding changes the dense GEMMs' row count, so their CPU blocking: fp32 noise there), the
    same tokens throughout, and every rank the same KV."""
    eager, static = mtp_runs["eager"], mtp_runs["static"]
    assert static["graphs"] and not eager["graphs"]
    assert static["tokens"] == eager["tokens"]
    outputs: dict[str, list[int]] = {}
    for rid, tokens in static["tokens"]:
        outputs.setdefault(rid, []).extend(tokens)
    assert outputs == mtp_runs["truth"]
    assert static["shapes"] == eager["shapes"]
    assert static["drafts"] == eager["drafts"]
    passes, kept = static["drafts"]
    assert passes > 20 and passes < kept < 2 * passes  # kept whole, in part and not at all
    exact = drafted = 0
    first_padded = len(static["shapes"])  # from there on its noise is in the KV every later step reads
    for i, (got, want, shape) in enumerate(zip(static["logits"], eager["logits"], static["shapes"], strict=True)):
        drafted += max(shape) > 1
        if max(shape) <= 3 and not (len(shape) in (1, 2, 4) and set(shape) in ({1}, {3})):  # a padded static step
            first_padded = min(first_padded, i)
        if i < first_padded:
            exact += max(shape) > 1
            assert torch.equal(got, want), f"step {i} {shape}"
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert drafted > 20 and exact >= 5
    # Drafted steps travel on the wire unless the MTP layer takes rows of the same pass (a sequence that
    # did not draft), which go with a plan.
    assert static["sent"]["wire"] > 10 and static["sent"]["static plan"] > 5
    assert static["mtp static"] > 40 and eager["mtp static"] == 0  # the layer's commits and drafting passes
    # Its work travels in the fixed-size message where its graphs run all of it and nothing is mirrored
    # first (a rejected draft's slot goes back first: that work goes pickled, with the write).
    assert static["sent"]["mtp wire"] > 20 and eager["sent"]["mtp wire"] == 0
    assert eager["sent"]["mtp object"] == static["sent"]["mtp wire"] + static["sent"]["mtp object"]
    assert len(set(static["digests"])) == 1 and len(set(eager["digests"])) == 1
    # A rejected draft's slot goes back from each rank's own copy: the write names the slot, no state.
    for run in (static, eager):
        assert "restore_kept" in run["writes"] and "write_slot" not in run["writes"]
    assert static["steps"][0] <= first_padded  # the first round: bitwise from end to end
    for r in range(len(MTP_ROUNDS)):
        for got, want in zip(static["kv"][r], eager["kv"][r], strict=True):
            if static["steps"][r] <= first_padded:
                assert torch.equal(got, want), f"round {r}"
            else:
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_decode_steps_travel_as_one_fixed_message(runs: dict[str, dict]) -> None:
    sent = runs["static"]["sent"]
    assert sent["wire"] > 60  # every pure decode step with nothing else to mirror
    assert sent["static plan"] >= 1  # the 81-token prompt's last token: its table (6 blocks) outgrows the wire
    assert runs["eager"]["sent"]["wire"] == runs["eager"]["sent"]["static plan"] == 0


def test_the_wire_round_trips_exactly() -> None:
    wire = Wire(max_seqs=4)
    step = DecodeStep([5, 128_000, 7], [0, 3, 1], [15, 1_000_000, 0], [0, 8, 0], [0, 16, 32], [-1, 2, 0],
                      ([17, 18], [40, 2]), 1)
    wire.encode(step)
    assert wire.kind == Wire.DECODE and wire.decode() == step
    assert step.fill == ([1, 2], [2, 0])
    assert wire.buffer.numel() == Wire.HEADER + 10 * 4
    assert not wire.fits(DecodeStep([1] * 5, [0] * 5, [0] * 5, [0] * 5, [0] * 5, [-1] * 5, ([], []), 1))
    assert not wire.fits(DecodeStep([1], [0], [0], [0], [0], [-1], (list(range(5)), [1] * 5), 1))
    wire.object_header()
    assert wire.kind == Wire.OBJECT
    # A drafted pass: 1 + k rows per sequence at most (here k = 2), fewer where padded.
    drafted = Wire(max_seqs=4, row_width=3)
    step = DecodeStep([5, 6, 7, 128_000, 9, 1, 2, 3], [0, 3, 1], [15, 1_000_000, 0], [0, 8, 0], [0, 16, 32],
                      [-1, -1, -1], ([17], [40]), 1, [3, 2, 3], [1, 0, 1])
    drafted.encode(step)
    assert drafted.decode() == step and drafted.buffer.numel() == Wire.HEADER + (3 + 9) * 4
    assert step.kept_slots == [0, 1]  # the drafted sequences' slots, which every rank copies first
    assert not drafted.fits(DecodeStep([1] * 4, [0], [0], [0], [0], [-1], ([], []), 1, [4]))
    assert not wire.fits(step)  # a wire without room for drafts


def test_mtp_work_round_trips_on_the_wire() -> None:
    """The MTP layer's commits and drafting seeds: every field but the block tables (the graphs read the
    slots' rows), which must fit the graphs' width for the work to travel here at all."""
    wire = Wire(max_seqs=4, row_width=3)
    rows = MTPPass([], rows=[MTPRows(2, 40, 0, 3, (7, 8), 0, 16), MTPRows(0, 1_000_000, 3, 1, (9,), 64, 0)])
    assert wire.fits_mtp(rows, table_width=2)
    wire.encode_mtp(rows)
    assert wire.kind == Wire.MTP_COMMIT
    sent = [MTPRows(2, 40, 0, 3, (), 0, 16), MTPRows(0, 1_000_000, 3, 1, (), 64, 0)]
    assert wire.decode_mtp() == MTPPass([], rows=sent)
    seeds = MTPPass([], seeds=[MTPSeed(1, 99, 128_000, (4, 5, 6), 32, 8)], k=2)
    wire.encode_mtp(seeds)
    assert wire.kind == Wire.MTP_PROPOSE
    assert wire.decode_mtp() == MTPPass([], seeds=[MTPSeed(1, 99, 128_000, (), 32, 8)], k=2)
    assert not wire.fits_mtp(seeds, table_width=2)  # a table past the graphs': they would not run it
    assert not wire.fits_mtp(MTPPass([("restore_kept", (1,))], seeds=seeds.seeds, k=2), table_width=8)  # a write
    assert not wire.fits_mtp(MTPPass([], rows=[MTPRows(0, 0, 0, 4, (), 0, 0)]), table_width=8)  # wider than 3 rows
    assert not wire.fits_mtp(MTPPass([], seeds=[seeds.seeds[0]] * 5, k=2), table_width=8)  # more than the buckets
    assert not Wire().fits_mtp(seeds, table_width=8)  # no graphs: no wire


def test_slot_tables_mirror_through_their_writes() -> None:
    """Another rank applying rank 0's writes holds its rows exactly: new tables, grown tables, a slot
    taken over by a shorter table (the rest zeroed), several updates between two sends."""
    rank0, other = SlotTables(3, 6, "cpu"), SlotTables(3, 6, "cpu")
    rank0.record()
    a, b = [4, 5, 6], [9]
    rank0.update([0, 1], [a, b])
    other.apply(*rank0.take_writes())
    assert torch.equal(rank0.rows, other.rows)
    a.append(7)
    rank0.update([0], [a])
    assert rank0.take_writes() == ([3], [7])
    other.apply([3], [7])
    b.append(10)
    rank0.update([1], [b])
    rank0.update([0], [[1]])  # a new request in slot 0: one block, the old three entries zeroed
    b.append(11)
    rank0.update([1], [b])
    writes = rank0.take_writes()
    assert sorted(writes[0]) == [0, 1, 2, 3, 7, 8]
    other.apply(*writes)
    assert torch.equal(rank0.rows, other.rows)
    assert rank0.rows[0].tolist() == [1, 0, 0, 0, 0, 0] and rank0.rows[1].tolist() == [9, 10, 11, 0, 0, 0]
    assert rank0.take_writes() == ([], [])


def test_an_unknown_kind_is_never_run_as_a_step(tmp_path: Path) -> None:
    """The header decides: an object message is not decoded as a step."""
    wire = Wire(max_seqs=2)
    wire.object_header()
    with pytest.raises(AssertionError):
        wire.decode()


def test_async_scheduling_at_two_ranks_changes_nothing(runs: dict[str, dict]) -> None:
    """The other ranks take the tokens in flight from rank 0's device: the same steps, bitwise, as
    in series (a decode step's message says where they go; the plan of a step mixing a late arrival's
    prefill with a decode, too)."""
    ahead, series = runs["static async"], runs["static"]
    assert ahead["tokens"] == series["tokens"]
    assert ahead["steps"] == series["steps"] and len(ahead["logits"]) == len(series["logits"])
    for i, (got, want) in enumerate(zip(ahead["logits"], series["logits"], strict=True)):
        assert torch.equal(got, want), f"step {i}"
    for r in range(len(ROUNDS)):
        assert all(torch.equal(a, b) for a, b in zip(ahead["kv"][r], series["kv"][r], strict=True))
    assert len(set(ahead["digests"])) == 1
    assert ahead["digests"] == series["digests"]
