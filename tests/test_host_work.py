"""The host's part of a step: what the engine and front-end processes do once started so that the cycle
collector's full passes stop scanning start-up objects (a 100 ms pause every few hundred decode steps at
batch 256 before; bench/bench_host.py measures it), and the host bench itself at a small size."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.daemon import PATIENCE, ROOT

FREEZE_CHECK = """
import gc, json, weakref
import torch  # what an engine process holds once started: torch, the model, the engine
from v4serve.engine.engine import EngineConfig, LLMEngine
from v4serve.engine.model.v4.tiny import build_tiny
from v4serve.engine.process.lifecycle import freeze_startup_objects

engine = LLMEngine(build_tiny(), EngineConfig(max_model_len=512, max_num_seqs=2))
before = len(gc.get_objects())
freeze_startup_objects()
after = len(gc.get_objects())

class Node:
    pass

made = Node()
made.self = made  # a cycle made while serving: only a collection frees it
gone = weakref.ref(made)
del made
gc.collect()
print(json.dumps({"before": before, "after": after, "frozen": gc.get_freeze_count(), "freed": gone() is None}))
"""


def test_start_up_objects_are_frozen_and_what_serving_makes_is_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", FREEZE_CHECK], capture_output=True, text=True, timeout=PATIENCE,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["before"] > 50_000 and seen["after"] < 100 and seen["frozen"] >= seen["before"] // 2
    assert seen["freed"]


def test_the_host_bench_runs_at_a_small_size() -> None:
    done = subprocess.run([sys.executable, "bench/bench_host.py", "--batches", "1", "4", "--steps", "20",
                           "--context", "200", "--gc", "--results", "host_smoke"], capture_output=True, text=True,
                          timeout=PATIENCE, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((ROOT / "bench" / "results" / "host_smoke.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["per_seq_us"] > 0 and r["worst_over_median"] >= 1 and r["unfrozen_worst_over_median"] >= 1
               for r in rows)
