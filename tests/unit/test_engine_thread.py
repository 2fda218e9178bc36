"""Single-process checks of how the engine thread presents itself to Linux:
its name, and the short scheduler slice it asks for (HPCDL_ENGINE_SLICE_US)."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names and slices are Linux's")

PROBE = r"""
import json, os, threading
import numpy as np
import hpcdl

hpcdl.allreduce(np.ones(8, np.float32))  # starts the engine thread


def sched_slice(tid):
    with open(f"/proc/self/task/{tid}/sched") as f:
        for line in f:
            if line.startswith("se.slice"):
                return int(line.split(":")[1])
    return None


threads = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/comm") as f:
        threads.setdefault(f.read().strip(), []).append(tid)
engine = threads.get("hpcdl-engine", [])
print(json.dumps({"engines": len(engine), "engine_slice": sched_slice(engine[0]) if engine else None,
                  "main_slice": sched_slice(threading.get_native_id())}))
"""


def probe(slice_us):
    env = dict(os.environ)
    env.pop("HPCDL_ENGINE_SLICE_US", None)
    if slice_us is not None:
        env["HPCDL_ENGINE_SLICE_US"] = str(slice_us)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def kernel_has_custom_slices():
    """sched_setattr's sched_runtime sets a normal task's slice from Linux 6.12 on."""
    major, minor = (int(v) for v in platform.release().split(".")[:2])
    return (major, minor) >= (6, 12)


def test_engine_thread_is_named_and_asks_for_a_short_slice():
    default, custom, off = probe(None), probe(250), probe(0)
    assert default["engines"] == custom["engines"] == off["engines"] == 1
    if default["engine_slice"] is None or not kernel_has_custom_slices():
        pytest.skip(f"Linux {platform.release()} has no per-task slice to check (the name was checked)")
    assert default["engine_slice"] == 100_000
    assert custom["engine_slice"] == 250_000
    assert off["engine_slice"] == off["main_slice"] != 100_000
