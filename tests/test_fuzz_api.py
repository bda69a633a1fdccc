"""schemathesis against the daemon's own OpenAPI description (`/openapi.json`): requests generated
from every operation's schema, valid and invalid, are all answered without a 5xx, and the daemon is
healthy afterwards. Bounded: a short context (so no request can generate for long) and a fixed
number of examples per operation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.daemon import PATIENCE, daemon

EXAMPLES_PER_OPERATION = 60


@pytest.fixture(scope="module")
def fuzz_url() -> Iterator[str]:
    with daemon("--max-model-len", "48", "--max-num-seqs", "4") as url:
        yield url


def operations(url: str) -> list[schemathesis.APIOperation]:
    loaded = schemathesis.openapi.from_url(url + "/openapi.json")
    return [result.ok() for result in loaded.get_all_operations()]


def test_no_generated_request_gets_a_server_error(fuzz_url: str) -> None:
    """Valid and invalid requests for every operation (driven through hypothesis directly: the
    schemathesis pytest plugin does not run under this pytest)."""
    ops = operations(fuzz_url)
    assert {op.label for op in ops} >= {"POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize",
                                        "POST /detokenize", "POST /reset_prefix_cache", "GET /health",
                                        "POST /v1/messages", "POST /v1/messages/count_tokens"}
    seen: Counter[tuple[str, int]] = Counter()
    for op in ops:
        cases = op.as_strategy(GenerationMode.POSITIVE) | op.as_strategy(GenerationMode.NEGATIVE)

        examples = EXAMPLES_PER_OPERATION // (2 if "/messages" in op.label else 1)

        @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases)
        def call(case: schemathesis.Case) -> None:
            if "/messages" in case.operation.label and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = "v4serve-tiny"  # required there: any other name is only ever a 404
            response = case.call(base_url=fuzz_url, timeout=PATIENCE)
            seen[(case.operation.label, response.status_code)] += 1
            assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
            if response.status_code >= 400 and "/messages" in case.operation.label:  # Anthropic's shape
                body = response.json()
                assert body["type"] == "error" and set(body["error"]) == {"message", "type"}, response.text[:500]
            elif response.status_code >= 400:  # OpenAI's error shape, whatever was wrong
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text[:500]

        call()
    # Both valid requests that generate and invalid ones that are refused were sent.
    assert seen[("POST /v1/completions", 200)] and seen[("POST /v1/chat/completions", 200)]
    assert seen[("POST /v1/completions", 400)] and seen[("POST /v1/chat/completions", 400)]
    assert seen[("POST /v1/messages", 200)] and seen[("POST /v1/messages", 400)], sorted(seen.items())


def test_the_daemon_is_healthy_after_the_fuzzing(fuzz_url: str) -> None:
    assert httpx.get(fuzz_url + "/health", timeout=PATIENCE).status_code == 200
    reply = httpx.post(fuzz_url + "/v1/completions", json={"prompt": "still here", "max_tokens": 2}, timeout=PATIENCE)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    text = httpx.get(fuzz_url + "/metrics", timeout=PATIENCE).text
    assert "v4serve_requests_running{model_name=\"v4serve-tiny\"} 0.0" in text
