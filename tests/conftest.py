import json
import logging
import os
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.daemon import daemon

# `make test` runs one pytest worker per core (pytest-xdist): each worker's torch gets its share of
# the cores (at most 2), since more threads than cores only adds contention.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))
logging.getLogger("transformers").setLevel(logging.ERROR)

# Hypothesis's defaults time each example (a 200 ms deadline) and its data generation (too_slow):
# failures a busy machine alone can cause. Tests assert behaviour, not speed.
settings.register_profile("v4serve", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("v4serve")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """A real `v4serve serve` (tiny model, no SSD store) for one test module."""
    with daemon() as url:
        yield url


# V4SERVE_TEST_TIMELINE=FILE: each test's worker, start and end (seconds since the epoch) appended to FILE
# as JSON lines, to see how the workers' time is spent (which tests run last, how long a worker idles).
_timeline = os.environ.get("V4SERVE_TEST_TIMELINE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start = time.time()
    yield
    if _timeline:
        line = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "start": start,
                "end": time.time()}
        with open(_timeline, "a") as out:
            out.write(json.dumps(line) + "\n")
