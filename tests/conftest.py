import logging
import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests.daemon import daemon

# Two cores here: more threads than cores only adds contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))
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
