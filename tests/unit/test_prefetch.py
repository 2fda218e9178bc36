"""The clairvoyant prefetcher, single process: the shuffle (against a pure
Python reimplementation of its specification), access streams, placement
invariants, bytes delivered, resume, faults and shutdown."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hpcdl import _core, prefetch, store
from hpcdl.errors import CorruptDataError
from hpcdl.prefetch import Prefetcher, PrefetchWarning

from conftest import ROOT
from helpers.prefetch import corrupt_sample, make_store

MASK32 = 0xFFFFFFFF


# --------------------------------------------------------------------------- the specification in Python


def philox4x32_10(ctr, key):
    ctr, key = list(ctr), list(key)
    for r in range(10):
        if r:
            key = [(key[0] + 0x9E3779B9) & MASK32, (key[1] + 0xBB67AE85) & MASK32]
        p0, p1 = 0xD2511F53 * ctr[0], 0xCD9E8D57 * ctr[2]
        ctr = [(p1 >> 32) ^ ctr[1] ^ key[0], p1 & MASK32, (p0 >> 32) ^ ctr[3] ^ key[1], p0 & MASK32]
    return ctr


def draw(seed, epoch, k):
    out = philox4x32_10([k & MASK32, k >> 32, epoch & MASK32, epoch >> 32], [seed & MASK32, seed >> 32])
    return out[0] | (out[1] << 32)


def reference_order(n, seed, epoch):
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = (draw(seed, epoch, n - 1 - i) * (i + 1)) >> 64
        order[i], order[j] = order[j], order[i]
    return order


def corrupt_largest_sample(st):
    """Flip one byte of the store's largest sample on disk; returns its index and shard path."""
    victim = int(np.argmax(st.sizes))
    return victim, corrupt_sample(st, victim)


@pytest.fixture(scope="module")
def st(tmp_path_factory):
    return make_store(str(tmp_path_factory.mktemp("prefetch")))


def run_all(pf):
    """[(epoch, step, indices, [bytes...], labels)] of every remaining batch."""
    return [(b.epoch, b.step, b.indices.copy(), [bytes(s) for s in b.samples()], b.labels.copy()) for b in pf]


def threads_now():
    return len(os.listdir("/proc/self/task"))


# --------------------------------------------------------------------------- shuffle


def test_philox_known_answers():
    # Random123's published known-answer vectors for philox4x32_10.
    assert philox4x32_10([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox4x32_10([MASK32] * 4, [MASK32] * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert philox4x32_10([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0]) == [
        0xD16CFE09,
        0x94FDCCEB,
        0x5001E420,
        0x24126EA1,
    ]
    from hpcdl import _core

    assert _core.shuffle_draw(0, 0, 0) == 0xE169C58D6627E8D5
    assert _core.shuffle_draw(2**64 - 1, 2**64 - 1, 2**64 - 1) == 0x41C83B0E408F276D
    assert _core.shuffle_draw(0x299F31D0A4093822, 0x0370734413198A2E, 0x85A308D3243F6A88) == 0x94FDCCEBD16CFE09


@pytest.mark.parametrize("n,seed,epoch", [(1, 0, 0), (2, 5, 1), (97, 123, 0), (1000, 2**40 + 7, 3), (257, 0, 2**33)])
def test_epoch_order_matches_the_specification(n, seed, epoch):
    got = prefetch.epoch_order(n, seed, epoch)
    assert got.tolist() == reference_order(n, seed, epoch)
    assert sorted(got.tolist()) == list(range(n))


def test_epoch_orders_differ_by_epoch_and_seed():
    a, b, c = (prefetch.epoch_order(500, s, e) for s, e in ((1, 0), (1, 1), (2, 0)))
    assert (a != b).any() and (a != c).any()
    assert (prefetch.epoch_order(500, 1, 0) == a).all()


# --------------------------------------------------------------------------- streams


@pytest.mark.parametrize(
    "n,batch,ranks,drop_last", [(103, 12, 4, True), (103, 12, 4, False), (5, 8, 2, False), (64, 16, 1, True)]
)
def test_rank_streams_cover_each_epoch(n, batch, ranks, drop_last):
    epochs, seed = 3, 9
    streams = [prefetch.rank_stream(n, batch, ranks, r, epochs, seed, drop_last) for r in range(ranks)]
    local = batch // ranks
    steps = n // batch if drop_last else -(-n // batch)
    assert all(len(s) == epochs * steps * local for s in streams)
    for e in range(epochs):
        order = prefetch.epoch_order(n, seed, e)
        part = [s[e * steps * local : (e + 1) * steps * local].reshape(steps, local) for s in streams]
        # Global batch b is ranks' local batches side by side, in rank order.
        together = np.concatenate(part, axis=1).ravel()
        assert together.tolist() == [int(order[p % n]) for p in range(steps * batch)]
        counts = np.bincount(together.astype(np.int64), minlength=n)
        if drop_last:
            assert counts.max() == 1 and counts.sum() == (n // batch) * batch
        else:
            assert counts.min() >= 1 and counts.sum() == steps * batch


def test_rank_stream_is_a_pure_function_and_resumes():
    full = prefetch.rank_stream(200, 20, 4, 2, 4, 77)
    assert (prefetch.rank_stream(200, 20, 4, 2, 4, 77) == full).all()
    assert (prefetch.rank_stream(200, 20, 4, 2, 4, 77, start=55) == full[55:]).all()
    assert (prefetch.rank_stream(200, 20, 4, 2, 4, 78) != full).any()


def test_stream_bad_input():
    with pytest.raises(ValueError, match="multiple of the number of ranks"):
        prefetch.rank_stream(100, 10, 4, 0, 1, 0)
    with pytest.raises(ValueError, match="smaller than one global batch"):
        prefetch.rank_stream(5, 8, 1, 0, 1, 0, drop_last=True)
    with pytest.raises(ValueError, match="out of range"):
        prefetch.rank_stream(100, 8, 4, 4, 1, 0)
    assert len(prefetch.rank_stream(100, 8, 4, 1, 0, 0)) == 0


# --------------------------------------------------------------------------- placement


@pytest.mark.parametrize("ram,disk", [(0, 0), (5000, 0), (20000, 30000), (10**9, 10**9), (0, 40000)])
def test_placement_invariants(ram, disk):
    n = 300
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 900, n).astype(np.uint64)
    stream = prefetch.rank_stream(n, 16, 4, 1, 7, 11)
    p = prefetch.placement(stream, sizes, ram, disk)
    freq = np.bincount(stream.astype(np.int64), minlength=n)
    assert (p["freq"] == freq).all()
    for k in np.flatnonzero(freq)[:50]:
        assert p["first"][k] == np.flatnonzero(stream == k)[0]
    assert p["ram_used"] <= ram and p["disk_used"] <= disk
    assert p["ram_used"] == sizes[p["ram"]].sum() and p["disk_used"] == sizes[p["disk"]].sum()
    assert set(p["ram"].tolist()) == set(np.flatnonzero(p["tier"] == 0).tolist())
    assert set(p["disk"].tolist()) == set(np.flatnonzero(p["tier"] == 1).tolist())
    assert not (p["tier"][freq == 0] < 2).any()  # unread samples are never cached
    # Frequency order: every sample in a faster tier ranks before every one in a slower tier.
    key = {k: (-int(freq[k]), int(p["first"][k])) for k in np.flatnonzero(freq)}
    by_tier = [[key[k] for k in key if p["tier"][k] == t] for t in range(3)]
    for fast, slow in ((0, 1), (1, 2), (0, 2)):
        if by_tier[fast] and by_tier[slow]:
            assert max(by_tier[fast]) < min(by_tier[slow])
    for name in ("ram", "disk"):
        lst = p[name]
        assert (np.diff(p["first"][lst].astype(np.int64)) > 0).all()  # filled in first-use order
        assert (
            (p["offset"][lst] == np.concatenate([[0], np.cumsum(sizes[lst])[:-1]]).astype(np.uint64)).all()
            if len(lst)
            else True
        )
    if ram >= sizes.sum():
        assert (p["tier"][freq > 0] == 0).all()


@pytest.mark.parametrize("ram,disk", [(10**9, 0), (3000, 6000), (0, 0)])
def test_peer_sources_are_the_earliest_other_cacher(ram, disk):
    # Against a direct reading of the rule: for each sample, among the other
    # ranks whose placement caches it, the one with the smallest first-use key
    # (global step * ranks + rank). Rank 2 has no tiers at all.
    n, batch, ranks, epochs, seed = 120, 8, 4, 3, 9
    sizes = np.random.default_rng(5).integers(0, 400, n).astype(np.uint64)
    rams, disks = [ram, ram, 0, ram], [disk, disk, 0, disk]
    local = batch // ranks
    keys = np.full((ranks, n), 2**64 - 1, dtype=np.uint64)
    for q in range(ranks):
        p = prefetch.placement(prefetch.rank_stream(n, batch, ranks, q, epochs, seed), sizes, rams[q], disks[q])
        cached = np.flatnonzero(p["tier"] < 2)
        keys[q, cached] = p["first"][cached] // local * ranks + q
    for me in range(ranks):
        rank, key = _core.peer_sources(n, batch, ranks, epochs, seed, True, 0, sizes, rams, disks, me)
        others = keys.copy()
        others[me] = 2**64 - 1
        best = others.min(axis=0)
        assert (key == best).all()
        has = best != 2**64 - 1
        assert (rank[~has] == -1).all() and (rank[has] == others.argmin(axis=0)[has]).all()
        assert not (rank == 2).any() and not (rank == me).any()
    if ram == 0 and disk == 0:
        assert (rank == -1).all()


# --------------------------------------------------------------------------- delivery


@pytest.mark.parametrize(
    "ram,disk,staging,threads",
    [
        (10**9, 0, 64 << 20, 4),  # everything in RAM
        (60000, 80000, 0, 3),  # RAM + disk + store, smallest staging ring
        (0, 0, 0, 1),  # pure staging
    ],
)
def test_bytes_delivered_equal_the_store(st, tmp_path, ram, disk, staging, threads):
    expected = prefetch.rank_stream(len(st), 8, 1, 0, 3, 5)
    with Prefetcher(
        st,
        8,
        3,
        5,
        ram_bytes=ram,
        disk_dir=str(tmp_path),
        disk_bytes=disk,
        staging_bytes=staging,
        staging_threads=threads,
    ) as pf:
        batches = run_all(pf)
        stats = pf.stats()
    got = np.concatenate([b[2] for b in batches])
    assert (got == expected).all()
    for _, _, ids, samples, labels in batches:
        assert samples == [st.read(int(i)) for i in ids]
        assert (labels == st.labels[ids.astype(np.int64)]).all()
    assert [(b[0], b[1]) for b in batches] == [(e, s) for e in range(3) for s in range(len(st) // 8)]
    assert sum(stats["hits"].values()) == len(expected)
    assert sum(stats["bytes"].values()) == int(st.sizes[expected.astype(np.int64)].sum())
    if ram == 0 and disk == 0:
        assert stats["hits"]["store"] == len(expected)
    if disk:
        assert stats["hits"]["disk"] > 0 and stats["disk_used"] <= disk
    if ram >= st.sizes.sum():
        assert stats["hits"]["ram"] == len(expected)
    assert os.listdir(tmp_path) == []  # the disk tier's file has no name


def test_batches_are_views_and_epochs_iterate(st):
    with Prefetcher(st, 10, 2, 1, ram_bytes=0) as pf:
        epochs = pf.epochs()
        assert [e.epoch for e in epochs] == [0, 1] and len(epochs[1]) == len(st) // 10
        first = next(iter(epochs[0]))
        assert first.data.base is not None and len(first) == 10
        assert bytes(first[3]) == st.read(int(first.indices[3]))
        assert [(bytes(x), y) for x, y in first] == [(st.read(int(i)), int(st.labels[i])) for i in first.indices]
        assert pf.position == (0, 1) and len(epochs[0]) == len(st) // 10 - 1
        # Starting epoch 1 skips the rest of epoch 0.
        assert sum(1 for _ in epochs[1]) == len(st) // 10 and pf.position == (2, 0)
        assert list(pf) == []


def test_resume_equals_an_uninterrupted_run(st, tmp_path):
    kwargs = dict(ram_bytes=30000, disk_dir=str(tmp_path), disk_bytes=50000)
    with Prefetcher(st, 12, 4, 42, **kwargs) as pf:
        whole = run_all(pf)
    with Prefetcher(st, 12, 4, 42, **kwargs) as pf:
        steps = 0
        for batch in pf:
            steps += 1
            if steps == 17:
                break
        checkpoint = pf.position
    assert checkpoint == divmod(17, len(st) // 12)
    with Prefetcher(st, 12, 4, 42, start=checkpoint, **kwargs) as pf:
        rest = run_all(pf)
    assert len(rest) == len(whole) - 17
    for a, b in zip(whole[17:], rest):
        assert a[0:2] == b[0:2] and (a[2] == b[2]).all() and a[3] == b[3]
    with pytest.raises(ValueError, match="outside the run"):
        Prefetcher(st, 12, 4, 42, start=(4, 1))
    with Prefetcher(st, 12, 4, 42, start=(4, 0)) as pf:
        assert run_all(pf) == []


# --------------------------------------------------------------------------- bad input and faults


def test_small_data_set_epochs_zero_and_bad_arguments(st):
    n = len(st)
    with pytest.raises(ValueError, match="smaller than one global batch"):
        Prefetcher(st, n + 5, 1, 0)
    with Prefetcher(st, n + 5, 2, 0, drop_last=False, ram_bytes=0) as pf:
        batches = run_all(pf)
    assert len(batches) == 2 and all(len(b[2]) == n + 5 for b in batches)
    for b in batches:
        assert sorted(set(b[2].tolist())) == list(range(n))  # padded with the epoch's first samples
        assert b[3] == [st.read(int(i)) for i in b[2]]
    before = threads_now()
    with Prefetcher(st, 8, 0, 0) as pf:
        assert threads_now() == before  # nothing to do: no thread started
        assert run_all(pf) == [] and list(pf.epochs()) == []
    for bad in (dict(batch_size=0), dict(epochs=-1), dict(ram_bytes=-5), dict(batch_size=2.5)):
        args = dict(batch_size=8, epochs=1, seed=0) | bad
        with pytest.raises(ValueError):
            Prefetcher(st, **args)


def test_missing_and_unusable_disk_directory_fall_back(st, tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    for disk_dir, reason in ((tmp_path / "missing", "does not exist"), (not_a_dir, "does not exist")):
        with pytest.warns(PrefetchWarning, match=reason):
            with Prefetcher(st, 8, 2, 3, ram_bytes=0, disk_dir=str(disk_dir), disk_bytes=10**9) as pf:
                batches = run_all(pf)
                assert pf.stats()["hits"]["disk"] == 0
        for _, _, ids, samples, _ in batches:
            assert samples == [st.read(int(i)) for i in ids]


def mount_tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_read_only_and_full_disk_tiers_fall_back(st, tmp_path):
    ro, full = str(tmp_path / "ro"), str(tmp_path / "full")
    mount_tmpfs(ro, "ro,size=1m")
    mount_tmpfs(full, "size=64k")
    try:
        with pytest.warns(PrefetchWarning, match="cannot create a file"):
            with Prefetcher(st, 8, 2, 3, ram_bytes=0, disk_dir=ro, disk_bytes=10**9) as pf:
                batches = run_all(pf)
        for _, _, ids, samples, _ in batches:
            assert samples == [st.read(int(i)) for i in ids]
        assert int(st.sizes.sum()) > 3 * 65536  # the store does not fit in the 64 KiB tmpfs
        with pytest.warns(PrefetchWarning, match="No space left on device"):
            with Prefetcher(st, 8, 3, 3, ram_bytes=0, disk_dir=full, disk_bytes=10**9, disk_threads=1) as pf:
                batches = run_all(pf)
                stats = pf.stats()
        assert stats["hits"]["disk"] > 0 and stats["hits"]["store"] > 0
        for _, _, ids, samples, _ in batches:
            assert samples == [st.read(int(i)) for i in ids]
        assert os.listdir(full) == []
    finally:
        subprocess.run(["umount", ro], check=False)
        subprocess.run(["umount", full], check=False)


def link(path):
    """Where a /proc/self/fd entry points ("" for one closed meanwhile, as listdir's own)."""
    try:
        return os.readlink(path)
    except OSError:
        return ""


def test_a_damaged_disk_tier_is_never_served(st, tmp_path):
    """The disk tier's file (unnamed: reached through /proc/self/fd) is
    overwritten once the fillers have written every sample: each read-back
    fails the sample's CRC32C in the store's index, warns once, and the sample
    comes from the store instead."""
    import time

    with Prefetcher(
        st, 8, 3, 3, ram_bytes=0, disk_dir=str(tmp_path), disk_bytes=10**9, staging_bytes=0, staging_threads=1
    ) as pf:
        deadline = time.monotonic() + 60
        while pf.stats()["disk_written"] < pf.stats()["disk_samples"] and time.monotonic() < deadline:
            time.sleep(0.01)
        tier = [fd for fd in os.listdir("/proc/self/fd") if link(f"/proc/self/fd/{fd}").startswith(str(tmp_path))]
        assert len(tier) == 1 and pf.stats()["disk_written"] == pf.stats()["disk_samples"] > 0
        with open(f"/proc/self/fd/{tier[0]}", "r+b") as fh:
            fh.write(b"\xff" * pf.stats()["disk_used"])
        with pytest.warns(PrefetchWarning, match="fail their CRC32C"):
            batches = run_all(pf)
        stats = pf.stats()
    for _, _, ids, samples, _ in batches:
        assert samples == [st.read(int(i)) for i in ids]
    assert stats["hits"]["store"] > 0


def test_corrupt_sample_raises_never_wrong_bytes(tmp_path):
    st = make_store(str(tmp_path), files=40, seed=4)
    victim, shard = corrupt_largest_sample(st)
    with Prefetcher(store.Store(st.root), 4, 2, 0, ram_bytes=10**6) as pf:
        with pytest.raises(CorruptDataError, match="checksum mismatch"):
            for batch in pf:
                assert victim not in batch.indices.tolist()


def test_peer_replies_go_in_pieces_below_the_message_limit():
    assert _core.peer_message_pieces(0, 7) == []
    assert _core.peer_message_pieces(7, 7) == [(0, 7)]
    assert _core.peer_message_pieces(16, 7) == [(0, 7), (7, 14), (14, 16)]
    total = (5 << 30) + 3  # a 5 GiB sample and its status byte, with the default limit
    pieces = _core.peer_message_pieces(total, 1 << 30)
    assert pieces[0][0] == 0 and pieces[-1][1] == total and len(pieces) == 6
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert all(0 < end - begin < 2**31 for begin, end in pieces)  # MPI counts are int


@pytest.mark.parametrize("ram", [0, 10**6])
def test_corrupt_sample_fails_only_its_batch(tmp_path, ram):
    st = make_store(str(tmp_path), files=40, seed=4)
    victim, shard = corrupt_largest_sample(st)
    stream = prefetch.rank_stream(len(st), 4, 1, 0, 3, 0).reshape(-1, 4)
    holding = [b for b, row in enumerate(stream) if victim in row.tolist()]
    assert holding  # the victim is in the run
    steps = len(stream) // 3
    delivered, failed = {}, {}  # by global batch number
    with Prefetcher(store.Store(st.root), 4, 3, 0, ram_bytes=ram) as pf:
        for _ in range(len(stream) + 1):  # bounded even if an error stuck to every later batch
            try:
                for batch in pf:  # iterating again goes on after a failed batch
                    delivered[batch.epoch * steps + batch.step] = (
                        batch.indices.tolist(),
                        [bytes(s) for s in batch.samples()],
                    )
                break
            except CorruptDataError as exc:
                epoch, step = pf.position  # the failed batch is consumed
                failed[epoch * steps + step - 1] = str(exc)
    assert sorted(failed) == holding
    for message in failed.values():
        assert f"sample {victim} " in message and shard in message and "checksum mismatch" in message
    assert sorted(delivered) == sorted(set(range(len(stream))) - set(holding))
    for b, (ids, data) in delivered.items():
        assert ids == stream[b].tolist() and data == [st.read(i) for i in ids]


def test_staging_ring_is_three_of_the_largest_batches_and_outlives_close(st):
    stream = prefetch.rank_stream(len(st), 8, 1, 0, 2, 7).astype(np.int64)
    largest = int(st.sizes[stream].reshape(-1, 8).sum(axis=1).max())
    with Prefetcher(st, 8, 2, 7, ram_bytes=0, staging_bytes=0) as pf:
        assert pf.stats()["staging_bytes"] == 3 * largest  # raised to three of the largest local batches
    with Prefetcher(st, 8, 2, 7, ram_bytes=0, staging_bytes=10 * largest) as pf:
        assert pf.stats()["staging_bytes"] == 10 * largest
    pf = Prefetcher(st, 8, 2, 7, ram_bytes=0)  # 64 MiB: a mapping of its own, unmapped when freed
    batch = next(iter(pf))
    pf.close()
    del pf  # the batch's view keeps the core's ring alive
    assert batch.samples() and [bytes(s) for s in batch.samples()] == [st.read(int(i)) for i in batch.indices]


def test_break_mid_epoch_joins_threads_and_removes_files(st, tmp_path):
    before = threads_now()
    pf = Prefetcher(
        st, 8, 5, 1, ram_bytes=20000, disk_dir=str(tmp_path), disk_bytes=40000, staging_threads=3, staging_bytes=0
    )  # the smallest ring: staging threads wait for the consumer
    assert threads_now() > before
    for step, batch in enumerate(pf):
        if step == 3:
            break
    pf.close()
    assert threads_now() == before and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="closed"):
        pf._next()
    try:  # an exception in the training loop, the context manager closes
        with Prefetcher(st, 8, 5, 1, ram_bytes=20000, disk_dir=str(tmp_path), disk_bytes=40000) as pf:
            for batch in pf:
                raise KeyError("training failed")
    except KeyError:
        pass
    assert threads_now() == before and os.listdir(tmp_path) == []


def test_exit_with_an_open_prefetcher_does_not_hang(st, tmp_path):
    code = (
        "import sys; from hpcdl.store import Store; from hpcdl.prefetch import Prefetcher\n"
        f"pf = Prefetcher(Store({st.root!r}), 8, 50, 1, ram_bytes=20000, disk_dir={str(tmp_path)!r}, "
        "disk_bytes=40000)\n"
        "next(iter(pf)); print('started', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "started" in out.stdout and os.listdir(tmp_path) == []


def test_stats_and_trace(st, tmp_path, monkeypatch):
    trace = tmp_path / "trace.json"
    monkeypatch.setenv("HPCDL_TRACE", str(trace))
    with Prefetcher(st, 8, 3, 2, ram_bytes=10**9) as pf:
        steps = sum(1 for _ in pf)
        stats = pf.stats()
    assert stats["batches"] == steps and stats["stall_seconds"] >= 0
    assert stats["ram_samples"] == len(set(prefetch.rank_stream(len(st), 8, 1, 0, 3, 2).tolist()))
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events}
    assert "fetch ram" in names and all(e["tid"] == 1 and e["ph"] == "X" for e in events)
    assert sum(e["name"].startswith("fetch") for e in events) == steps * 8


# --------------------------------------------------------------------------- adapters


def test_torch_dataset_in_stream_order(st):
    import torch
    from torch.utils.data import DataLoader

    from hpcdl.torch import TorchDataset

    expected = prefetch.rank_stream(len(st), 8, 1, 0, 2, 4)
    with Prefetcher(st, 8, 2, 4, ram_bytes=10**6) as pf:
        ds = TorchDataset(pf, transform=lambda v: torch.tensor(len(v)), epochs=1)
        assert len(ds) == len(expected) // 2
        first = [(int(x), int(y)) for x, y in DataLoader(ds, batch_size=None, num_workers=0)]
        loader = DataLoader(
            TorchDataset(pf, transform=lambda v: torch.tensor(v[:4].sum(), dtype=torch.int64)),
            batch_size=pf.local_batch,
        )
        second = torch.cat([x for x, _ in loader]).tolist()
    assert first == [(len(st.read(int(i))), int(st.labels[i])) for i in expected[: len(first)]]
    assert second == [sum(st.read(int(i))[:4]) for i in expected[len(first) :]]


def test_tf_dataset_in_stream_order(st):
    import tensorflow as tf

    from hpcdl.tensorflow import tf_dataset

    expected = prefetch.rank_stream(len(st), 8, 1, 0, 1, 6)
    with Prefetcher(st, 8, 1, 6, ram_bytes=0) as pf:
        ds = tf_dataset(pf)
        got = [(bytes(x.numpy()), int(y)) for x, y in ds]
    assert got == [(st.read(int(i)), int(st.labels[i])) for i in expected]
    assert isinstance(ds, tf.data.Dataset)


def test_settings_have_one_name_from_python_to_cpp(st):
    """PrefetchOptions is hpcdl::PrefetchConfig by field name; Prefetcher's
    keywords for the core's settings are those names, their defaults the struct's."""
    import inspect

    options = _core.PrefetchOptions(read_gap=12345, disk_dir="/x", peer_ram_bytes=[1, 2], drop_last=False)
    got = options.to_dict()
    assert (got["read_gap"], got["disk_dir"], got["peer_ram_bytes"], got["drop_last"]) == (12345, "/x", [1, 2], False)
    assert got["staging_bytes"] == _core.DEFAULT_STAGING_BYTES  # untouched fields keep the struct's default
    with pytest.raises(AttributeError, match="no setting 'threads'"):
        _core.PrefetchOptions(threads=4)
    keywords = inspect.signature(Prefetcher).parameters
    defaults = _core.PrefetchOptions()
    for name in ("staging_threads", "ram_threads", "disk_threads", "peer_timeout", "staging_bytes"):
        assert keywords[name].default == getattr(defaults, name), name
    for name in ("read_bytes", "read_gap", "lookahead_bytes", "read_concurrency"):
        assert name in options.names() and name in keywords
    with Prefetcher(st, 8, 1, 1, ram_bytes=1 << 20, staging_threads=1) as pf:
        for _ in pf:
            pass
        stats = pf.stats()
    assert stats["batches"] == pf.steps_per_epoch and stats["stall_seconds"] >= 0
    assert stats["ram_used"] > 0 and stats["ram_samples"] > 0 and set(stats["hits"]) == {"ram", "disk", "peer", "store"}
