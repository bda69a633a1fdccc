"""Preprocessing in worker processes (`server/preprocess.py`): a job that never ends is cut at its CPU
bound and its worker replaced, the other worker serves meanwhile, the event loop never waits for a
worker, and errors come back as the front end raises them (a 400's text, never a traceback)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import PATIENCE
from v4serve.server import jobs
from v4serve.server.errors import ApiError
from v4serve.server.preprocess import PreprocessConfig, Preprocessor, PreprocessTooCostly
from v4serve.server.text.tokenizer import ByteTokenizer


def spin(_tokenizer: Any) -> None:
    """A job that never ends by itself (pure Python: the CPU bound's signal interrupts it)."""
    while True:
        pass


def refuse(_tokenizer: Any) -> None:
    raise ApiError(400, "this job refuses", param="messages", code="refused")


def crash(_tokenizer: Any) -> None:
    raise RuntimeError("a secret the client must not read")


def released(_tokenizer: Any, path: str) -> str:
    """A job that waits (polling, so it uses hardly any CPU) until a file exists."""
    deadline = time.monotonic() + PATIENCE
    while not Path(path).exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return "released"


@pytest.fixture(scope="module")
def prep() -> Iterator[Preprocessor]:
    # 1 s of CPU: `spin` passes it; nothing else here comes near it.
    pool = Preprocessor(ByteTokenizer(), PreprocessConfig(workers=2, cpu_seconds=1.0))
    pool.start()
    yield pool
    pool.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_job_past_its_cpu_bound_is_a_400_and_its_worker_is_replaced(prep: Preprocessor) -> None:
    replaced = prep.replaced
    with pytest.raises(PreprocessTooCostly) as refused:
        run(prep.run(spin))
    assert refused.value.status == 400 and refused.value.code == "request_too_costly"
    assert "--max-preprocess-seconds" in refused.value.message
    assert prep.replaced == replaced + 1
    # Both workers serve again afterwards.
    async def four() -> list[Any]:
        return await asyncio.gather(*(prep.run(jobs.encode_texts, ["hi"], True, 100) for _ in range(4)))

    prompts = run(asyncio.wait_for(four(), PATIENCE))
    assert [p.tolist() for (p,) in prompts] == [[0, 64 + ord("h"), 64 + ord("i")]] * 4


def test_while_one_worker_is_busy_the_other_serves_and_the_loop_runs(prep: Preprocessor, tmp_path) -> None:
    """A job holding one worker until released: a second job completes meanwhile (on the other worker)
    and the event loop keeps turning; only then is the first released."""
    gate = tmp_path / "release"

    async def scenario() -> tuple[str, list[Any], int]:
        held = asyncio.ensure_future(prep.run(released, str(gate)))
        other = await asyncio.wait_for(prep.run(jobs.encode_texts, ["ok"], False, 100), PATIENCE)
        ticks = 0
        for _ in range(100):  # the loop is free: a hundred turns of it while the job is held
            await asyncio.sleep(0)
            ticks += 1
        assert not held.done()
        gate.touch()
        return await asyncio.wait_for(held, PATIENCE), other, ticks

    answer, other, ticks = run(scenario())
    assert answer == "released" and [p.tolist() for p in other] == [[64 + ord("o"), 64 + ord("k")]] and ticks == 100


def test_a_jobs_400_comes_back_as_it_was_raised(prep: Preprocessor) -> None:
    with pytest.raises(ApiError) as refused:
        run(prep.run(refuse))
    assert (refused.value.status, refused.value.message, refused.value.param, refused.value.code) == \
        (400, "this job refuses", "messages", "refused")


def test_a_jobs_crash_is_an_internal_error_without_its_text(prep: Preprocessor, caplog) -> None:
    with caplog.at_level("ERROR"), pytest.raises(ApiError) as failed:
        run(prep.run(crash))
    assert failed.value.status == 500 and "secret" not in failed.value.message
    assert failed.value.message.startswith("internal error (err_")
    error_id = failed.value.message.split("(", 1)[1].split(";", 1)[0]
    assert any(error_id in r.getMessage() for r in caplog.records)  # the log has it, by its id
    assert any("a secret the client must not read" in (r.exc_text or "") + str(r.exc_info) for r in caplog.records)


def test_a_prompt_past_the_context_is_refused_in_the_worker(prep: Preprocessor) -> None:
    with pytest.raises(ApiError) as refused:
        run(prep.run(jobs.encode_texts, ["x" * 50], True, 40))
    assert refused.value.code == "context_length_exceeded" and "51 tokens" in refused.value.message


def test_without_workers_jobs_run_on_a_thread_alike() -> None:
    inline = Preprocessor(ByteTokenizer(), PreprocessConfig(workers=0))
    (prompt,) = run(inline.run(jobs.encode_texts, ["hi"], True, 100))
    assert prompt.tolist() == [0, 64 + ord("h"), 64 + ord("i")]
    with pytest.raises(ApiError):
        run(inline.run(refuse))


def test_json_containers_are_counted_outside_strings() -> None:
    body = json.dumps({"a": [{"b": '{["\\x'}] * 3, "c": "[[[{{{"}).encode()
    assert jobs.json_containers(None, body) == 5
