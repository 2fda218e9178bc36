"""The agreement's report tree has the shape its radix gives it: a 6-rank job
per setting counts the reports each rank takes from others (hpcdl.stats()) and
compares them with the tree derived from the documented parent rule."""

import json

import pytest

from helpers import report_tree
from helpers.fault_jobs import run_job

RANKS = 6  # radix 2, 4 and flat differ here: rank 0 has 3, 4 and 5 children
BODY = """
import json
names = [f"tree.{i}" for i in range(5)]
arrays = {n: np.zeros(7, np.float32) for n in names}
rng = np.random.default_rng(RANK)

def step(value):
    order = rng.permutation(len(names))
    for i in order:
        arrays[names[i]][:] = value
    for h in [hpcdl.allreduce_async(arrays[names[i]], name=names[i]) for i in order]:
        h.wait()
    return all(bool((a == value * WORLD.Get_size()).all()) for a in arrays.values())

# Each rank resets its counts before any rank starts the next step, whose reports it could take first.
hpcdl.stats(reset=True)
WORLD.Barrier()
right = step(1)  # new names: every rank's description goes up
new = hpcdl.stats(reset=True)["agreement"]
WORLD.Barrier()
right = all([step(v) for v in range(2, 6)]) and right  # seen before: merged by subtree
seen = hpcdl.stats()["agreement"]
found = WORLD.gather((right, new["descriptions_received"], seen["descriptions_received"], seen["entries_received"]))
if RANK == 0:
    print("FOUND " + json.dumps(found), flush=True)
"""


@pytest.mark.parametrize(
    "env",
    [{"HPCDL_AGREEMENT_RADIX": "2"}, {"HPCDL_AGREEMENT_RADIX": "4"}, {}, {"HPCDL_AGREEMENT_FLAT": "1"}],
    ids=["radix2", "radix4", "default", "flat"],
)
def test_each_rank_takes_one_merged_report_per_op_from_each_child(tmp_path, monkeypatch, env):
    for variable in ("HPCDL_AGREEMENT_RADIX", "HPCDL_AGREEMENT_FLAT"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    rc, out = run_job(tmp_path, RANKS, BODY)
    assert rc == 0, out
    found = json.loads(next(line[6:] for line in out.splitlines() if line.startswith("FOUND ")))
    children = report_tree.children_counts(RANKS, report_tree.radix_in_effect(RANKS))
    ops, seen_steps = 5, 4
    for rank, (right, new_descriptions, seen_descriptions, seen_entries) in enumerate(found):
        assert right, (rank, found)
        # a new name's description goes up rank by rank: a rank takes its whole subtree's but its own
        subtree = 1 + sum(1 for r in range(1, RANKS) if rank in ancestors(r, report_tree.radix_in_effect(RANKS)))
        assert new_descriptions == ops * (subtree - 1), (rank, found)
        assert seen_descriptions == 0, (rank, found)
        assert seen_entries == seen_steps * ops * children[rank], (rank, children, found)


def ancestors(rank, radix):
    up = []
    while rank:
        rank = report_tree.parent(rank, radix)
        up.append(rank)
    return up
