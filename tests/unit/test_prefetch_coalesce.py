"""Coalesced store fills, single process: the tiers' store fills read in
large spans sorted by file offset deliver exactly the bytes and labels of
the one-read-per-sample path, in fewer, larger reads, within the tiers'
capacities and the read size; a bad sample or a failed span fails only the
batches that hold its samples, with the reader's error."""

import os

import numpy as np
import pytest

from hpcdl import _core, prefetch, simulator, store, timeline
from hpcdl.errors import CorruptDataError
from hpcdl.prefetch import Prefetcher
from hpcdl.store import probe

from helpers.prefetch import corrupt_sample, make_store

BATCH, EPOCHS, SEED = 8, 3, 7


@pytest.fixture(scope="module")
def st(tmp_path_factory):
    return make_store(str(tmp_path_factory.mktemp("coalesce")), files=300, seed=3)


def run(st, tmp_path=None, epochs=EPOCHS, **kw):
    """[(epoch, step, ids, [bytes], labels)] of the whole run, and the final stats."""
    with Prefetcher(st, BATCH, epochs, SEED, disk_dir=str(tmp_path) if tmp_path else None, **kw) as pf:
        got = [(b.epoch, b.step, b.indices.tolist(), [bytes(s) for s in b.samples()], b.labels.tolist()) for b in pf]
        return got, pf.stats()


def distinct_read(st, epochs):
    ids = np.unique(prefetch.rank_stream(len(st), BATCH, 1, 0, epochs, SEED).astype(np.int64))
    return ids[st.sizes[ids] > 0]


@pytest.mark.parametrize(
    "ram,disk",
    [
        (10**9, 0),  # everything in RAM
        (100000, 150000),  # RAM, disk and the store
        (40000, 0),  # RAM and the store
    ],
)
@pytest.mark.parametrize(
    "read_bytes,read_gap,lookahead",
    [
        (8 << 20, 128 << 10, 32 << 20),  # the defaults: one span per window
        (6000, 0, 20000),  # small spans, no gap read, short look-ahead
        (1, 0, 1),  # every sample its own span
    ],
)
def test_coalesced_batches_equal_the_per_sample_path(st, tmp_path, ram, disk, read_bytes, read_gap, lookahead):
    per_sample, base = run(st, tmp_path, ram_bytes=ram, disk_bytes=disk, read_bytes=0)
    coalesced, stats = run(
        st,
        tmp_path,
        ram_bytes=ram,
        disk_bytes=disk,
        read_bytes=read_bytes,
        read_gap=read_gap,
        lookahead_bytes=lookahead,
    )
    assert coalesced == per_sample  # every batch: positions, ids, bytes, labels
    for _, _, ids, data, labels in coalesced[:: max(len(coalesced) // 20, 1)]:
        assert data == [st.read(i) for i in ids] and labels == st.labels[ids].tolist()
    assert stats["hits"] == base["hits"]
    assert stats["ram_used"] <= ram and stats["disk_used"] <= disk
    assert os.listdir(tmp_path) == []


def test_first_epoch_reads_fewer_larger_spans_each_byte_once(st):
    needed = distinct_read(st, 1)
    _, one = run(st, epochs=1, ram_bytes=10**9, read_bytes=0)
    assert one["store_requests"] == one["store_reads"] == len(needed)
    # No gap read through: the spans cover exactly the samples needed, each byte once.
    _, tight = run(st, epochs=1, ram_bytes=10**9, read_gap=0)
    assert tight["store_reads"] == len(needed)
    assert tight["store_bytes"] == one["store_bytes"] == int(st.sizes[needed].sum())
    assert tight["store_requests"] < len(needed) / 2
    # Gaps read through: one span per shard (the look-ahead holds everything), never beyond the shard's data.
    shards = len({i["path"] for i in st.shard_infos})
    _, wide = run(st, epochs=1, ram_bytes=10**9, read_gap=1 << 20, lookahead_bytes=1 << 30)
    assert wide["store_requests"] == shards
    assert tight["store_bytes"] <= wide["store_bytes"] <= int(st.sizes.sum())
    assert wide["hits"]["ram"] == len(prefetch.rank_stream(len(st), BATCH, 1, 0, 1, SEED))


def test_spans_respect_the_read_size(st):
    limit = int(st.sizes.max()) * 2
    _, stats = run(st, epochs=1, ram_bytes=10**9, read_bytes=limit, read_gap=1 << 20)
    # Each span is at most `limit` bytes, so there are at least bytes/limit of them.
    assert stats["store_requests"] >= -(-stats["store_bytes"] // limit)
    assert stats["store_requests"] < stats["store_reads"]


def test_later_epochs_read_nothing_more_when_everything_is_cached(st):
    _, stats = run(st, ram_bytes=10**9)
    assert stats["store_reads"] == len(distinct_read(st, EPOCHS))
    assert stats["hits"]["store"] == 0


def batches_or_errors(st, **kw):
    """{global batch: ids or the error message} of a whole run, iterating on after failed batches."""
    out = {}
    with Prefetcher(st, 4, 2, SEED, **kw) as pf:
        steps = pf.steps_per_epoch
        for _ in range(2 * steps + 1):
            try:
                for b in pf:
                    out[b.epoch * steps + b.step] = (b.indices.tolist(), [bytes(s) for s in b.samples()])
                break
            except CorruptDataError as exc:
                epoch, step = pf.position
                out[epoch * steps + step - 1] = str(exc)
    return out


def test_a_bad_sample_in_a_span_fails_only_its_batches(tmp_path):
    st = make_store(str(tmp_path), files=60, seed=5)
    victim = int(np.argmax(st.sizes))
    shard = corrupt_sample(st, victim)
    stream = prefetch.rank_stream(len(st), 4, 1, 0, 2, SEED).reshape(-1, 4)
    got = batches_or_errors(store.Store(st.root), ram_bytes=10**6, read_gap=1 << 20)
    for b, row in enumerate(stream):
        if victim in row.tolist():
            assert isinstance(got[b], str) and f"sample {victim} " in got[b] and shard in got[b]
            assert "checksum mismatch" in got[b]
        else:
            assert got[b] == (row.tolist(), [st.read(int(i)) for i in row])


def test_a_failed_span_read_falls_back_to_each_sample(tmp_path):
    st = make_store(str(tmp_path), files=60, seed=6)
    info = next(i for i in st.shard_infos if "offsets" in i)
    expected = {i: st.read(i) for i in range(len(st))}
    last = int(np.argmax(np.asarray(info["offsets"]) + st.sizes))  # the sample whose bytes end last
    cut = info["data_offset"] + int(info["offsets"][last]) + int(st.sizes[last]) // 2
    # Truncated after the store was opened (HDF5 would not open it again): the
    # span over the whole shard now fails; read alone, only `last` is lost.
    os.truncate(info["path"], cut)
    stream = prefetch.rank_stream(len(st), 4, 1, 0, 2, SEED).reshape(-1, 4)
    got = batches_or_errors(st, ram_bytes=10**6, read_gap=1 << 20, lookahead_bytes=1 << 30)
    for b, row in enumerate(stream):
        if last in row.tolist():
            assert isinstance(got[b], str) and f"sample {last} " in got[b] and "truncated" in got[b]
        else:
            assert got[b] == (row.tolist(), [expected[int(i)] for i in row])


def test_the_simulators_span_count_matches_the_prefetcher(tmp_path):
    # Equal sizes, as the model assumes: 400 samples of 1000 B, one rank reads them all in epoch 1.
    src = tmp_path / "src" / "c0"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(400):
        (src / f"{i:04d}.bin").write_bytes(rng.bytes(1000))
    store.pack(str(tmp_path / "src"), str(tmp_path / "store"), progress=False)
    st = store.Store(str(tmp_path / "store"))
    kw = dict(read_bytes=1 << 20, read_gap=3000, lookahead_bytes=100 * 1000)
    _, stats = run(st, epochs=1, ram_bytes=10**9, **kw)
    system = simulator.System(
        samples=400, sample_bytes=1000, ranks=1, epochs=1, batch=BATCH, compute=0.0, ram_bytes=10**9, **kw
    )
    reads, nbytes = simulator.coalesced_reads(stats["store_reads"], system)
    assert stats["store_reads"] == 400
    assert 0.7 * reads <= stats["store_requests"] <= 1.3 * reads  # model: 400 * 0.75^4 = 127 spans
    assert 0.8 * nbytes <= stats["store_bytes"] <= 1.2 * nbytes
    # Without coalescing the model is one read per sample.
    slow = simulator.predict(
        simulator.System(
            samples=400, sample_bytes=1000, ranks=1, epochs=1, batch=BATCH, compute=0.0, ram_bytes=10**9, store_iops=100
        )
    )
    fast = simulator.predict(
        simulator.System(
            samples=400,
            sample_bytes=1000,
            ranks=1,
            epochs=1,
            batch=BATCH,
            compute=0.0,
            ram_bytes=10**9,
            store_iops=100,
            **kw,
        )
    )
    assert fast["prefetch"][0] < slow["prefetch"][0]


# ---------------------------------------------------------------- read settings from the store's speed


@pytest.mark.parametrize("ram,disk", [(10**9, 0), (100000, 150000)])
def test_auto_read_settings_deliver_the_per_sample_path(st, tmp_path, ram, disk):
    per_sample, base = run(st, tmp_path, ram_bytes=ram, disk_bytes=disk, read_bytes=0)
    auto, stats = run(st, tmp_path, ram_bytes=ram, disk_bytes=disk)  # read_* default to "auto"
    assert auto == per_sample
    chosen = stats["read_settings"]
    assert chosen["auto"] == ["lookahead_bytes", "read_bytes", "read_concurrency", "read_gap"]
    assert chosen["measured_by"] == "probe"
    assert chosen["store_iops"] > 0 and chosen["store_bandwidth"] > 0 and chosen["store_parallel_gain"] is None
    derived = probe.read_settings(
        chosen["store_iops"],
        chosen["store_bandwidth"],
        prefetch.DEFAULT_STAGING_BYTES,
        ram + disk,
        chosen["store_parallel_gain"],
    )
    assert {k: chosen[k] for k in derived} == derived
    assert stats["hits"] == base["hits"] and 0 < stats["store_requests"] < base["store_requests"]


def test_explicit_read_settings_override_auto(st):
    with Prefetcher(st, BATCH, 1, SEED, ram_bytes=10**9, read_gap="12K") as pf:
        mixed = pf.read_settings
    assert mixed["read_gap"] == 12 << 10 and mixed["auto"] == ["lookahead_bytes", "read_bytes", "read_concurrency"]
    derived = probe.read_settings(mixed["store_iops"], mixed["store_bandwidth"], prefetch.DEFAULT_STAGING_BYTES, 10**9)
    assert (mixed["read_bytes"], mixed["lookahead_bytes"]) == (derived["read_bytes"], derived["lookahead_bytes"])
    with Prefetcher(
        st, BATCH, 1, SEED, ram_bytes=10**9, read_bytes=6000, read_gap=0, lookahead_bytes=20000, read_concurrency="2"
    ) as pf:
        explicit = pf.read_settings
    assert explicit == {
        "read_bytes": 6000,
        "read_gap": 0,
        "lookahead_bytes": 20000,
        "read_concurrency": 2,
        "auto": [],
    }  # nothing measured


@pytest.mark.parametrize(
    "name,value",
    [
        ("read_bytes", -1),
        ("read_gap", "garbage"),
        ("lookahead_bytes", "-3M"),
        ("read_gap", True),
        ("read_bytes", 1.5),
        ("read_bytes", None),
    ],
)
def test_bad_read_settings_are_clear_errors(st, name, value):
    with pytest.raises(ValueError, match=f"{name} must be a non-negative size or 'auto'"):
        Prefetcher(st, BATCH, 1, SEED, **{name: value})


@pytest.mark.parametrize("ram,disk", [(10**9, 0), (100000, 150000)])
def test_one_span_at_a_time_delivers_the_same_bytes_and_never_overlaps(st, tmp_path, ram, disk):
    per_sample, _ = run(st, tmp_path, ram_bytes=ram, disk_bytes=disk, read_bytes=0)

    def overlapping_spans(concurrency):
        timeline.record()
        try:
            _core.timeline_take()
            got, stats = run(
                st,
                tmp_path,
                epochs=1,
                ram_bytes=ram,
                disk_bytes=disk,
                read_bytes=6000,
                read_gap=0,
                lookahead_bytes=20000,
                read_concurrency=concurrency,
                ram_threads=3,
                disk_threads=3,
                _span_delay=0.002,
            )  # a store whose reads take 2 ms
            spans = sorted(
                (start, start + dur) for name, _, start, dur, _ in _core.timeline_take()[0] if name == "load span"
            )
        finally:
            timeline.record(False)
        assert got == per_sample[: len(got)] and stats["read_settings"]["read_concurrency"] == concurrency
        assert len(spans) > 1
        return sum(b[0] < a[1] for a, b in zip(spans, spans[1:]))

    assert overlapping_spans(0) > 0  # every filler reads at once...
    assert overlapping_spans(1) == 0  # ...or one span at a time, though 3-6 fillers hold windows


@pytest.mark.parametrize("value", [-1, True, 1.5, "two", None])
def test_a_bad_read_concurrency_is_a_clear_error(st, value):
    with pytest.raises(ValueError, match="read_concurrency must be a non-negative integer or 'auto'"):
        Prefetcher(st, BATCH, 1, SEED, read_concurrency=value)


def test_read_concurrency_rule():
    MiB = 1 << 20
    assert probe.read_settings(300, 50 * MiB, parallel_gain=1.0)["read_concurrency"] == 1  # one throttled device
    assert probe.read_settings(300, 50 * MiB, parallel_gain=probe.PARALLEL_GAIN)["read_concurrency"] == 0
    assert probe.read_settings(300, 50 * MiB, parallel_gain=3.7)["read_concurrency"] == 0  # striped: all at once
    assert probe.read_settings(300, 50 * MiB)["read_concurrency"] == 0  # unknown: as before


def test_read_settings_rule():
    MiB = 1 << 20
    slow = probe.read_settings(300, 50 * MiB)
    assert slow["read_gap"] == 50 * MiB // 300  # the gap that costs as much as one more request
    assert slow["read_bytes"] == probe.SPAN_GAPS * slow["read_gap"]
    assert slow["lookahead_bytes"] == probe.WINDOW_SPANS * slow["read_bytes"]
    previous = None
    for ratio_ in np.geomspace(1, 1e9, 40):  # bandwidth / IOPS from 1 byte to 1 GB
        got = probe.read_settings(1000.0, 1000.0 * ratio_)
        assert probe.MIN_GAP <= got["read_gap"] <= probe.MAX_GAP
        assert probe.MIN_READ <= got["read_bytes"] <= probe.MAX_READ
        assert got["read_bytes"] <= got["lookahead_bytes"] <= probe.MAX_LOOKAHEAD
        if previous:  # monotone: a store whose requests cost more bytes gets larger reads
            assert all(got[k] >= previous[k] for k in got)
        previous = got
    assert probe.read_settings(1e7, 1e10)["read_gap"] == probe.MIN_GAP  # a page-cache hit: clamped
    # Bounded by memory: spans by the staging buffer, the window by the tiers.
    small = probe.read_settings(300, 50 * MiB, staging_bytes=2 * MiB, tier_bytes=5 * MiB)
    assert small["read_bytes"] == 2 * MiB and small["lookahead_bytes"] == 5 * MiB
    with pytest.raises(ValueError):
        probe.read_settings(0, 50 * MiB)


def test_the_probes_concurrent_readers_never_reread_cached_bytes():
    import random

    length, first = 4 << 20, (100 << 20, 116 << 20)
    offsets = probe._disjoint_offsets(random.Random(5), 1 << 30, length, 5, [first])
    reads = sorted([first] + [(at, at + length) for at in offsets])
    assert len(offsets) == 5 and all(a[1] <= b[0] for a, b in zip(reads, reads[1:]))
    assert probe._disjoint_offsets(random.Random(5), 40 << 20, length, 5, [first]) is None  # no room


def test_probe_measures_a_parallel_gain_where_reads_fit_apart(tmp_path):
    big = tmp_path / "shard"
    with open(big, "wb") as f:
        f.truncate(256 << 20)  # sparse: room for every reader's range, nothing written
    iops, bandwidth, parallel_gain = probe.measure([str(big)], parallel_seconds=0.1)
    assert iops > 0 and bandwidth > 0 and parallel_gain > 0


def test_probe_measures_the_store_files(st):
    iops, bandwidth, parallel_gain = probe.measure(st.shard_paths)
    assert 0 < iops <= probe.MAX_IOPS and 0 < bandwidth <= probe.MAX_BANDWIDTH
    assert parallel_gain is None  # a small store: no room to read apart from the cache
    with pytest.raises(OSError):
        probe.measure([])
