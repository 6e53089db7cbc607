"""`freeze_startup_objects`: after it, a full garbage collection no longer walks the objects that
start-up left (run in a child process, so that this test process's collector is untouched)."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = """
import gc, json, logging, time
from tgq.batcher.gc_freeze import freeze_startup_objects

logging.basicConfig(level=logging.INFO)
startup = [{"row": [i]} for i in range(300_000)]  # long-lived, like the api's models and pools

def full_pass_s():
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started

before = min(full_pass_s() for _ in range(3))
freeze_startup_objects()
garbage = [[]] * 10  # allocated after the freeze: still collected as usual
after = min(full_pass_s() for _ in range(3))
print(json.dumps({"before": before, "after": after, "frozen": gc.get_freeze_count()}))
"""


def test_a_full_collection_skips_what_start_up_left() -> None:
    child = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    timings = json.loads(child.stdout)
    assert timings["frozen"] > 600_000  # the 300k dicts and their lists at least
    assert timings["after"] < timings["before"] / 10
    assert "start-up objects out of the garbage collector's passes" in child.stderr
