"""A streamed token's path through the front end costs no asyncio task of its own: a stream of 64
tokens creates as many tasks on the server's loop as a stream of 8 (a task and a timed wait per
token, as the keep-alive pacing once made, were a large share of a streamed token's CPU)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import pytest

from tests.daemon import PATIENCE, in_process_server
from v4serve.server.serve import ServeConfig


def counting(loop: asyncio.AbstractEventLoop, counts: list[int]) -> Callable[..., asyncio.Task]:
    def factory(loop: asyncio.AbstractEventLoop, coro, **kwargs):  # type: ignore[no-untyped-def]
        counts[0] += 1
        return asyncio.Task(coro, loop=loop, **kwargs)
    return factory


def streamed(url: str, path: str, tokens: int) -> int:
    """The completion tokens a stream made, from its usage chunk."""
    body = {"model": "v4serve-tiny", "max_tokens": tokens, "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    body |= {"prompt": "tasks"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "tasks"}]}
    made = 0
    with httpx.stream("POST", url + path, json=body, timeout=PATIENCE) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                made = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", made)
    return made


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_streams_tasks_do_not_grow_with_its_tokens(path: str) -> None:
    with in_process_server(ServeConfig(no_kv_store=True)) as (url, engine):
        loop = engine._loop  # type: ignore[attr-defined]
        counts = [0]
        done = asyncio.run_coroutine_threadsafe(_set_factory(loop, counting(loop, counts)), loop)
        done.result(PATIENCE)
        created = []
        for tokens in (8, 64, 8, 64):
            before = counts[0]
            assert streamed(url, path, tokens) == tokens
            created.append(counts[0] - before)
    # 56 more tokens, at most a task or two more (the loop's own timers may start one meanwhile): a
    # task per token would be 56.
    assert max(created[1], created[3]) - min(created[0], created[2]) <= 2, created
    assert 0 < min(created) and max(created) < 20, created


async def _set_factory(loop: asyncio.AbstractEventLoop, factory: Callable[..., asyncio.Task]) -> None:
    loop.set_task_factory(factory)


def test_a_pipe_hands_over_in_order_and_a_cancelled_get_loses_nothing() -> None:
    from v4serve.server.generation import Pipe

    async def scenario() -> list[object]:
        pipe: Pipe[int] = Pipe()
        pipe.put(1)
        got: list[object] = [await pipe.get()]  # waiting nowhere: it was there
        waiting = asyncio.ensure_future(pipe.get())
        await asyncio.sleep(0)  # parked on its waiter
        pipe.put(2)
        got.append(await waiting)
        cancelled = asyncio.ensure_future(pipe.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        pipe.put(3)  # put after a reader gave up: kept for the next one
        pipe.put(4)
        got += [pipe.empty(), await pipe.get(), await pipe.get(), pipe.empty()]
        return got

    assert asyncio.run(asyncio.wait_for(scenario(), PATIENCE)) == [1, 2, False, 3, 4, True]  # a lost wake-up: a hang


def test_a_stream_that_fails_once_begun_ends_with_an_error_event_and_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in the front end after the first event (injected where a completion's echo is made):
    the client still gets an error event and [DONE], the work is aborted, and the server serves on."""
    from v4serve.server import completions

    def broken(*_args: object, **_kwargs: object) -> str:
        raise RuntimeError("injected: the echo cannot be made")

    monkeypatch.setattr(completions, "_echo_chunk", broken)
    with in_process_server(ServeConfig(no_kv_store=True)) as (url, engine):
        body = {"model": "v4serve-tiny", "prompt": "fail", "max_tokens": 500, "ignore_eos": True, "stream": True,
                "echo": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=PATIENCE) as reply:
            assert reply.status_code == 200
            events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "generation_failed" and "the stream failed" in error["message"]
        assert engine.stats.running == 0 or asyncio.run(_settled(engine))  # its request was aborted
        assert streamed(url, "/v1/completions", 4) == 4


async def _settled(engine: object) -> bool:
    for _ in range(int(PATIENCE / 0.05)):
        if engine.stats.running == 0:  # type: ignore[attr-defined]
            return True
        await asyncio.sleep(0.05)
    return False
