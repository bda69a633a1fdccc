import logging
import os
from collections.abc import Iterator

import pytest
import torch

from tests.daemon import daemon

# Two cores here: more threads than cores only adds contention.
torch.set_num_threads(min(2, os.cpu_count() or 1))
logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """A real `v4serve serve` (tiny model, no SSD store) for one test module."""
    with daemon() as url:
        yield url
