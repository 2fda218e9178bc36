"""The prefetcher's start-up plan (hpcdl.prefetch.plan: make_plan in
include/hpcdl/prefetch/placement.hpp) and resuming a checkpoint on another number of
ranks, single process: plan() against a direct reading of the rule (every
rank's own placement, computed one by one), and a state resuming in one
process. tests/mpi/test_prefetch_plan_mpi.py checks that a 4-rank Prefetcher
runs exactly plan()'s result, and that a state taken on 4 ranks resumes on 2
and on 3 with exactly the rest of the global order."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcdl import _core, prefetch
from hpcdl.prefetch import Prefetcher, plan

from helpers.prefetch import make_store

NONE = 2**64 - 1


def sources_by_rule(n, batch, ranks, epochs, seed, drop_last, position, sizes, rams, disks, me):
    """Per sample: among the other ranks with a tier whose own placement caches
    it, the smallest first-use key (global step * ranks + rank), and that rank."""
    local = batch // ranks
    keys = np.full((ranks, n), NONE, dtype=np.uint64)
    for q in range(ranks):
        if q == me or rams[q] + disks[q] == 0:
            continue
        p = prefetch.placement(
            prefetch.rank_stream(n, batch, ranks, q, epochs, seed, drop_last, position), sizes, rams[q], disks[q]
        )
        cached = np.flatnonzero(p["tier"] < 2)
        keys[q, cached] = p["first"][cached] // local * ranks + q
    best = keys.min(axis=0)
    return np.where(best != NONE, keys.argmin(axis=0), -1), best


def random_run(rng):
    """A small run: ranks, batch, padding or not, tiers that cut inside frequency classes, a resume point."""
    ranks = int(rng.choice([2, 3, 4, 6, 8]))
    batch = ranks * int(rng.integers(1, 5))
    drop_last = bool(rng.integers(0, 2))
    n = int(rng.integers(batch if drop_last else 1, 90))
    epochs, seed = int(rng.integers(1, 6)), int(rng.integers(0, 1000))
    sizes = rng.integers(0, 300, n).astype(np.uint64)
    total = int(sizes.sum())
    rams = [int(rng.integers(0, total // 2 + 2)) for _ in range(ranks)]
    disks = [int(rng.integers(0, total // 2 + 2)) if rng.integers(0, 2) else 0 for _ in range(ranks)]
    steps = _core.stream_layout(n, batch, ranks, epochs, seed, drop_last)[1]
    epoch = int(rng.integers(0, epochs))
    start = (epoch, int(rng.integers(0, steps)))
    return dict(
        n=n,
        batch=batch,
        ranks=ranks,
        epochs=epochs,
        seed=seed,
        drop_last=drop_last,
        sizes=sizes,
        rams=rams,
        disks=disks,
        start=start,
    )


@pytest.mark.parametrize("trial", range(12))
def test_plan_sources_follow_every_rank_s_placement(trial):
    rng = np.random.default_rng(100 + trial)
    for _ in range(10):
        r = random_run(rng)
        local = r["batch"] // r["ranks"]
        steps = _core.stream_layout(r["n"], r["batch"], r["ranks"], r["epochs"], r["seed"], r["drop_last"])[1]
        position = (r["start"][0] * steps + r["start"][1]) * local
        for me in range(r["ranks"]):
            got = plan(
                r["n"],
                r["batch"],
                r["ranks"],
                me,
                r["epochs"],
                r["seed"],
                r["sizes"],
                r["rams"],
                r["disks"],
                drop_last=r["drop_last"],
                start=r["start"],
            )
            rank, key = sources_by_rule(
                r["n"],
                r["batch"],
                r["ranks"],
                r["epochs"],
                r["seed"],
                r["drop_last"],
                position,
                r["sizes"],
                r["rams"],
                r["disks"],
                me,
            )
            assert (got["source_key"] == key).all(), r
            assert (got["source_rank"] == rank).all(), r
            assert not (got["source_rank"] == me).any()


def test_plan_is_the_rank_s_stream_and_placement():
    n, batch, ranks, epochs, seed = 200, 16, 4, 5, 3
    sizes = np.random.default_rng(1).integers(0, 900, n).astype(np.uint64)
    for me in range(ranks):
        got = plan(n, batch, ranks, me, epochs, seed, sizes, 20000, 15000, start=(1, 4))
        stream = prefetch.rank_stream(n, batch, ranks, me, epochs, seed, start=(1 * (n // batch) + 4) * 4)
        assert (got["stream"] == stream).all()
        want = prefetch.placement(stream, sizes, 20000, 15000)
        for name in ("freq", "first", "tier", "offset", "ram", "disk"):
            assert (got[name] == want[name]).all(), name
        assert (got["ram_used"], got["disk_used"]) == (want["ram_used"], want["disk_used"])
        assert (got["source_rank"] >= 0).any()  # the peers cache something this rank reads


def test_plan_on_one_rank_has_no_sources():
    sizes = np.full(50, 10, dtype=np.uint64)
    got = plan(50, 10, 1, 0, 3, 7, sizes, 100)
    assert len(got["source_rank"]) == 0 and len(got["source_key"]) == 0
    assert len(got["ram"]) == 10


def test_plan_without_tiers_anywhere_has_no_sources():
    sizes = np.full(64, 10, dtype=np.uint64)
    got = plan(64, 8, 4, 1, 2, 7, sizes, 0)
    assert len(got["source_rank"]) == 0 and len(got["ram"]) == 0


def test_plan_rejects_bad_input():
    sizes = np.full(64, 10, dtype=np.uint64)
    with pytest.raises(ValueError, match="out of range"):
        plan(64, 8, 4, 4, 2, 7, sizes, 100)
    with pytest.raises(ValueError, match="one per rank"):
        plan(64, 8, 4, 0, 2, 7, sizes, [100, 100])
    with pytest.raises(ValueError, match="sizes has 63 entries"):
        plan(64, 8, 4, 0, 2, 7, sizes[:63], 100)
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        plan(64, 6, 4, 0, 2, 7, sizes, 100)
    with pytest.raises(ValueError, match="outside the run"):
        plan(64, 8, 4, 0, 2, 7, sizes, 100, start=(2, 1))


# --------------------------------------------------------------------------- resume from state()


@pytest.fixture(scope="module")
def st(tmp_path_factory):
    return make_store(str(tmp_path_factory.mktemp("prefetch-plan")), files=96, seed=4, comm=MPI.COMM_SELF)


def indices(pf):
    return [b.indices.copy() for b in pf]


def test_state_resumes_exactly(st):
    with Prefetcher(st, 12, 2, 5) as pf:
        whole = indices(pf)
    with Prefetcher(st, 12, 2, 5) as pf:
        head = [next(iter(pf)).indices.copy() for _ in range(11)]
        state = pf.state()
    assert state == {
        "epoch": 1,
        "sample_in_epoch": 36,
        "seed": 5,
        "global_batch": 12,
        "samples": len(st),
        "drop_last": True,
    }
    with Prefetcher(st, 12, 2, 5, start=state) as pf:
        assert pf.position == (1, 3)
        tail = indices(pf)
    assert len(head) + len(tail) == len(whole)
    assert all((a == b).all() for a, b in zip(head + tail, whole))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"seed": 6}, "seed 6 there, 5 here"),
        ({"global_batch": 24}, "global_batch 24 there, 12 here"),
        ({"samples": 95}, "samples 95 there"),
        ({"sample_in_epoch": 30}, "not a multiple of the global batch"),
        ({"epoch": 3}, "outside the run"),
    ],
)
def test_state_of_another_run_is_an_error(st, change, message):
    state = {"epoch": 1, "sample_in_epoch": 36, "seed": 5, "global_batch": 12, "samples": len(st), "drop_last": True}
    state.update(change)
    with pytest.raises(ValueError, match=message):
        Prefetcher(st, 12, 2, 5, start=state)
