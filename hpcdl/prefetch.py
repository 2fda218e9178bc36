"""Clairvoyant multi-tier prefetching (NoPFS-style): every rank's whole access
sequence is a pure function of (N, B, P, rank, E, seed), so each rank knows
before the first step what it will read, how often and when, and stages data
ahead of use from the fastest tier that has it.

    from hpcdl.store import Store
    from hpcdl.prefetch import Prefetcher

    with Prefetcher(Store(path), batch_size=256, epochs=90, seed=1, comm=MPI.COMM_WORLD,
                    ram_bytes=8 << 30, disk_dir="/local/scratch", disk_bytes=200 << 30) as pf:
        for epoch in pf.epochs():
            for batch in epoch:          # a Batch: views into the staging buffer
                train_step(batch)

Tiers (docs/prefetch.md): RAM (ram_bytes), node-local disk (disk_dir,
disk_bytes), a peer rank's RAM (over MPI, when comm has several ranks), and
the backing store. The C++ core (include/hpcdl/prefetch/prefetcher.hpp) runs every
thread with the GIL released.
"""

import logging
import time
import weakref

import numpy as np
from mpi4py import MPI

from hpcdl import _core, _env, timeline
from hpcdl._agree import (
    call_on_every_rank,
    check_same_identity,
    check_same_on_all_ranks,
    waited_allgather,
    waited_bcast,
)
from hpcdl._warn import warn
from hpcdl.errors import HpcdlError
from hpcdl.store import Store, probe
from hpcdl.units import AUTO, count_or_auto, size_or_auto

# Defaults of the core's settings are its own (hpcdl::PrefetchConfig), read here once.
_CORE_DEFAULTS = _core.PrefetchOptions()
DEFAULT_RAM_BYTES = 1 << 30
DEFAULT_STAGING_BYTES = _core.DEFAULT_STAGING_BYTES
# Coalesced store fills (docs/prefetch.md): the largest read, the largest gap
# read through to merge two samples, how far ahead the fill list is gathered.
# "auto": derived from the store's measured IOPS and bandwidth (hpcdl.store.probe);
# the FALLBACK_ figures (300 IOPS, 40 MB/s) when the probe cannot read the store.
DEFAULT_READ_BYTES = DEFAULT_READ_GAP = DEFAULT_LOOKAHEAD_BYTES = DEFAULT_READ_CONCURRENCY = AUTO
FALLBACK_IOPS, FALLBACK_BANDWIDTH = 300.0, 40e6
TRACE_ENV = "HPCDL_TRACE"

_log = logging.getLogger(__name__)

__all__ = ["Prefetcher", "Batch", "PrefetchWarning", "epoch_order", "rank_stream", "placement", "plan"]


def _read_settings(store, world, asked, staging_bytes, tier_bytes):
    """The coalesced fills' settings: those asked for as sizes, the "auto" ones
    derived from the store's IOPS and bandwidth, measured on rank 0 only (one
    probe per job, not P concurrent ones on a shared file system) and
    broadcast. Every rank joins the one bcast whatever it asked for, so ranks
    that differ in "auto" cannot hang; the settings change only how the store
    is read, never the bytes delivered, so ranks need not agree on them.
    A probe that cannot read the store falls back to FALLBACK_IOPS/BANDWIDTH."""

    def measured():
        try:
            return probe.measure(store.shard_paths) + ("probe",)
        except OSError as exc:
            warn(
                f"could not measure the store for read settings ({exc}); assuming {FALLBACK_IOPS:.0f} IOPS "
                f"and {FALLBACK_BANDWIDTH / 1e6:.0f} MB/s",
                PrefetchWarning,
                stacklevel=4,
            )
            return FALLBACK_IOPS, FALLBACK_BANDWIDTH, None, "fallback"

    auto = any(v is None for v in asked.values())
    speed = measured() if auto and world.Get_rank() == 0 else None
    if world.Get_size() > 1:
        speed = waited_bcast(world, speed, 0, "the prefetcher's broadcast of the store's measured speed")
    if auto and speed is None:  # rank 0 asked for sizes only: this rank measures for itself
        speed = measured()
    chosen = dict(asked)
    if auto:
        iops, bandwidth, gain, how = speed
        derived = probe.read_settings(iops, bandwidth, staging_bytes, tier_bytes, gain)
        chosen = {k: derived[k] if v is None else v for k, v in asked.items()}
        chosen.update(store_iops=iops, store_bandwidth=bandwidth, store_parallel_gain=gain, measured_by=how)
        if world.Get_rank() == 0:
            _log.info(
                "read settings from the store's %.0f IOPS, %.1f MB/s and %s x with %d readers (%s): "
                "read_gap %d, read_bytes %d, lookahead_bytes %d, read_concurrency %d",
                iops,
                bandwidth / 1e6,
                "unknown" if gain is None else f"{gain:.2f}",
                probe.PARALLEL_STREAMS,
                how,
                chosen["read_gap"],
                chosen["read_bytes"],
                chosen["lookahead_bytes"],
                chosen["read_concurrency"],
            )
    chosen["auto"] = sorted(k for k, v in asked.items() if v is None)
    return chosen


class PrefetchWarning(UserWarning):
    """A tier is unusable (missing or full cache directory...): its samples come from the next tier."""


def epoch_order(n, seed, epoch):
    """Epoch ``epoch``'s order of samples 0..n-1 (the C++ shuffle; uint64 array)."""
    return _core.epoch_order(n, seed, epoch)


def rank_stream(n, batch_size, ranks, rank, epochs, seed, drop_last=True, start=0):
    """Every sample rank ``rank`` reads over the run, in order (uint64 array).

    batch_size is the global batch B (a multiple of ranks); each rank reads
    B/ranks samples per step. ``start`` skips the first positions (resume).
    """
    return _core.rank_stream(n, batch_size, ranks, rank, epochs, seed, drop_last, start)


def placement(stream, sizes, ram_bytes, disk_bytes=0):
    """Where one rank keeps each sample: dict with per-sample ``freq``,
    ``first``, ``tier`` (0 RAM, 1 disk, 2 store), ``offset``; the ``ram`` and
    ``disk`` lists in first-use order; ``ram_used`` and ``disk_used`` bytes."""
    return _core.placement(stream, sizes, ram_bytes, disk_bytes)


def plan(samples, batch_size, ranks, rank, epochs, seed, sizes, ram_bytes, disk_bytes=0, drop_last=True, start=(0, 0)):
    """What rank ``rank`` of a ``ranks``-rank Prefetcher computes at start-up,
    in this process alone (the same C++ call): a dict with its ``stream`` from
    ``start`` (rank_stream()), its placement (placement()'s keys) and, with
    several ranks, each sample's source peer: ``source_rank`` (int32, -1 none)
    and ``source_key`` (uint64 global key step * ranks + rank, 2**64-1 none).

    ram_bytes, disk_bytes: every rank's tier bytes, one int for all or one per
    rank (the Prefetcher's ram_bytes, and disk_bytes when disk_dir is set).
    start: (epoch, step) or a Prefetcher.state(). Cost independent of ranks
    (docs/prefetch.md, "Planning at scale").
    """
    layout = _core.stream_layout(samples, batch_size, ranks, epochs, seed, drop_last, rank)
    position = _start_position(start, samples, batch_size, epochs, seed, drop_last, layout)
    per_rank = [
        [int(v)] * ranks if isinstance(v, (int, np.integer)) else [int(x) for x in v] for v in (ram_bytes, disk_bytes)
    ]
    if any(len(v) != ranks for v in per_rank):
        raise ValueError(f"ram_bytes and disk_bytes need one value or one per rank ({ranks})")
    peer_ram, peer_disk = _peer_capacities(ranks, *per_rank)
    return _core.plan(
        samples,
        batch_size,
        ranks,
        rank,
        epochs,
        seed,
        drop_last,
        position,
        sizes,
        per_rank[0][rank],
        per_rank[1][rank],
        peer_ram,
        peer_disk,
    )


def _peer_capacities(ranks, ram, disk):
    """The peer tier's per-rank capacities as the core takes them: empty lists
    turn the peer tier (one rank, or no rank with a tier) or the disk tiers off."""
    if ranks == 1 or not (any(ram) or any(disk)):
        return [], []
    return list(ram), list(disk) if any(disk) else []


def _start_position(start, samples, batch_size, epochs, seed, drop_last, layout):
    """The first stream position (per rank) to deliver, from start=(epoch, step)
    or a Prefetcher.state() (any number of ranks, the same global batch and seed)."""
    local, steps, per_epoch = layout
    if isinstance(start, dict):
        run = {"samples": samples, "global_batch": batch_size, "seed": seed, "drop_last": drop_last}
        differ = {key: (start.get(key), value) for key, value in run.items() if start.get(key) != value}
        if differ:
            raise ValueError(
                "cannot resume from this state: it is of another run ("
                + ", ".join(f"{key} {theirs!r} there, {ours!r} here" for key, (theirs, ours) in differ.items())
                + "); resuming needs the same samples, global batch, seed and drop_last"
            )
        epoch, sample = int(start["epoch"]), int(start["sample_in_epoch"])
        if sample % batch_size:
            raise ValueError(f"state sample_in_epoch={sample} is not a multiple of the global batch {batch_size}")
        step = sample // batch_size
    else:
        epoch, step = (int(x) for x in start)
    if not (0 <= epoch <= epochs and 0 <= step <= steps and (epoch < epochs or step == 0)):
        raise ValueError(f"start={start!r} is outside the run ({epochs} epochs of {steps} steps)")
    return epoch * per_epoch + step * local


class Batch:
    """One local batch, zero-copy: ``data`` is a uint8 view of the staging
    buffer holding the samples back to back; sample j is
    ``data[offsets[j]:offsets[j + 1]]``. Valid until the next batch is taken
    (the prefetcher then reuses that memory): copy what you keep longer.
    """

    __slots__ = ("epoch", "step", "indices", "labels", "data", "offsets")

    def __init__(self, epoch, step, indices, labels, data, offsets):
        self.epoch, self.step = epoch, step
        self.indices, self.labels, self.data, self.offsets = indices, labels, data, offsets

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, j):
        return self.data[int(self.offsets[j]) : int(self.offsets[j + 1])]

    def samples(self):
        """The samples as uint8 views."""
        return [self[j] for j in range(len(self))]

    def __iter__(self):
        """(sample view, label) pairs."""
        for j in range(len(self)):
            yield self[j], int(self.labels[j])

    def __repr__(self):
        return f"<Batch epoch {self.epoch} step {self.step}: {len(self)} samples, {self.data.nbytes} bytes>"


class _Epoch:
    """The remaining batches of one epoch. Iterating it first skips whatever
    earlier epochs left unread, so epochs can be iterated in order or not at all."""

    def __init__(self, prefetcher, epoch):
        self.prefetcher, self.epoch = prefetcher, epoch

    def __len__(self):
        epoch, step = self.prefetcher.position
        return 0 if epoch > self.epoch else self.prefetcher.steps_per_epoch - (step if epoch == self.epoch else 0)

    def __iter__(self):
        pf = self.prefetcher
        while not pf._finished() and pf.position[0] < self.epoch:
            pf._next()
        while not pf._finished() and pf.position[0] == self.epoch:
            yield pf._next()


_open = weakref.WeakSet()


def close_all():
    """Interpreter exit (hpcdl's exit hook): join every prefetcher's threads before MPI is finalized."""
    for pf in list(_open):
        pf.close(timeout=30.0)


class Prefetcher:
    """A rank's prefetcher over an hpcdl store for a whole run.

    store: an hpcdl.store.Store (or its path). batch_size: the global batch B,
    a multiple of the number of ranks; each rank gets B/P samples per step.
    epochs, seed: the run; epoch e's order is epoch_order(N, seed, e).
    comm: an mpi4py communicator (None: this process alone); with several
    ranks the construction and close() are collective and ranks fetch from
    each other's RAM tier (needs MPI_THREAD_MULTIPLE).
    ram_bytes: RAM tier capacity; disk_dir, disk_bytes: node-local disk tier
    (an unnamed file in disk_dir, gone when closed); 0 turns a tier off.
    staging_threads: staging threads; ram_threads, disk_threads: tier fillers.
    staging_bytes: the staging buffer (raised to three of the largest local
    batches when smaller). drop_last: drop the last partial global batch of
    each epoch (else pad it with the epoch's first samples).
    start=(epoch, step): resume where a checkpoint left off (step = local
    batches already done in that epoch); delivers exactly the rest of the run.
    start=pf.state(): the same on any number of ranks that divides the global
    batch (the same global order; another global batch or seed: ValueError).
    peer_timeout: seconds to wait for a peer's answer before reading the store
    instead (a peer that has not loaded a sample yet answers "later" within half
    of it, and is asked again); a peer that does not answer in time is given up
    on for the rest of the run (a warning; stats peers_gone), so a gone peer
    costs about one timeout, not one per sample.
    read_bytes, read_gap, lookahead_bytes: the tiers' store fills are gathered
    lookahead_bytes at a time (in first-use order), sorted by file offset and
    read in spans of at most read_bytes, merging neighbours at most read_gap
    bytes apart; read_bytes=0 reads one sample at a time. Each is a size (an
    int or text such as "8M") or "auto" (the default): rank 0 measures the
    store (~0.8 s) and every rank derives the setting from its IOPS and
    bandwidth (hpcdl.store.probe.read_settings); pf.read_settings has what was
    chosen and measured.
    read_concurrency: at most this many spans read at once, the soonest-needed
    first (0: every filler at once); "auto" (the default): 1 when the probe's
    concurrent reads gave less than 1.5x one reader's bandwidth (one throttled
    device: the span needed next then gets all of it), else 0.

    A sample that cannot be read (checksum mismatch, I/O error) fails only the
    batch that holds it: that batch raises the reader's error (it names the
    sample and its shard) and is consumed, so iterating again goes on with the
    next batch; the batches before and after it are delivered.
    """

    def __init__(
        self,
        store,
        batch_size,
        epochs,
        seed,
        comm=None,
        ram_bytes=DEFAULT_RAM_BYTES,
        disk_dir=None,
        disk_bytes=0,
        staging_threads=_CORE_DEFAULTS.staging_threads,
        drop_last=True,
        start=(0, 0),
        staging_bytes=_CORE_DEFAULTS.staging_bytes,
        ram_threads=_CORE_DEFAULTS.ram_threads,
        disk_threads=_CORE_DEFAULTS.disk_threads,
        peer_timeout=_CORE_DEFAULTS.peer_timeout,
        read_bytes=DEFAULT_READ_BYTES,
        read_gap=DEFAULT_READ_GAP,
        lookahead_bytes=DEFAULT_LOOKAHEAD_BYTES,
        read_concurrency=DEFAULT_READ_CONCURRENCY,
        _serve_delay=_CORE_DEFAULTS.serve_delay,
        _span_delay=_CORE_DEFAULTS.span_delay,
        _peer_message_bytes=_CORE_DEFAULTS.peer_message_bytes,
    ):
        self._core = None
        self.comm = comm
        world = comm if comm is not None else MPI.COMM_SELF
        self.rank, self.ranks = world.Get_rank(), world.Get_size()

        def open_store():  # what one rank alone can get wrong raises on every rank, naming it
            for name, value in (
                ("batch_size", batch_size),
                ("epochs", epochs),
                ("ram_bytes", ram_bytes),
                ("disk_bytes", disk_bytes),
                ("staging_threads", staging_threads),
                ("staging_bytes", staging_bytes),
            ):
                if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                    raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
            asked = {
                name: size_or_auto(value, name)
                for name, value in (
                    ("read_bytes", read_bytes),
                    ("read_gap", read_gap),
                    ("lookahead_bytes", lookahead_bytes),
                )
            }
            asked["read_concurrency"] = count_or_auto(read_concurrency, "read_concurrency")
            opened = store if isinstance(store, Store) else Store(store)
            return opened, asked, opened.fingerprint()

        self.store, asked, fingerprint = call_on_every_rank(world, open_store)
        n = len(self.store)
        if self.ranks > 1:  # peers serve each other's samples: they must hold the same ones
            check_same_identity(
                world,
                f"fingerprint {fingerprint}",
                f"'{self.store.root}' ({n} samples, {int(self.store.sizes.sum())} bytes)",
                "the stores (their samples' count, sizes, CRC32Cs and labels)",
                "Every rank must read the same data set: a per-node copy may be stale (copied "
                "from another version) or incomplete; Store(path).fingerprint() on each shows which",
            )
        self.batch_size, self.num_epochs, self.seed, self.drop_last = (
            int(batch_size),
            int(epochs),
            int(seed),
            bool(drop_last),
        )

        def validate():
            layout = _core.stream_layout(n, self.batch_size, self.ranks, self.num_epochs, self.seed, self.drop_last)
            position = _start_position(start, n, self.batch_size, self.num_epochs, self.seed, self.drop_last, layout)
            return layout[0], layout[1], position

        self.local_batch, self.steps_per_epoch, position = call_on_every_rank(world, validate)
        disk_bytes = int(disk_bytes) if disk_dir else 0
        if self.ranks > 1:
            check_same_on_all_ranks(
                world,
                [],
                "the prefetcher's settings",
                {
                    "samples": n,
                    "batch_size": self.batch_size,
                    "epochs": self.num_epochs,
                    "seed": self.seed,
                    "drop_last": self.drop_last,
                    "start position": position,
                },
            )
            every = waited_allgather(
                world, (int(ram_bytes), disk_bytes), "the prefetcher's exchange of tier capacities"
            )
            peer_ram, peer_disk = _peer_capacities(self.ranks, [ram for ram, _ in every], [disk for _, disk in every])
        else:
            peer_ram = peer_disk = []
        self._position = position
        self.read_settings = _read_settings(self.store, world, asked, int(staging_bytes), int(ram_bytes) + disk_bytes)
        options = _core.PrefetchOptions(
            samples=n,
            global_batch=self.batch_size,
            ranks=self.ranks,
            epochs=self.num_epochs,
            seed=self.seed,
            drop_last=self.drop_last,
            rank=self.rank,
            start=position,
            ram_bytes=int(ram_bytes),
            disk_bytes=disk_bytes,
            disk_dir=disk_dir or "",
            staging_bytes=int(staging_bytes),
            staging_threads=max(int(staging_threads), 1),
            ram_threads=max(int(ram_threads), 1),
            disk_threads=max(int(disk_threads), 1),
            peer_ram_bytes=peer_ram,
            peer_disk_bytes=peer_disk,
            peer_timeout=float(peer_timeout),
            serve_delay=float(_serve_delay),
            span_delay=float(_span_delay),
            peer_message_bytes=int(_peer_message_bytes),
            **{k: int(self.read_settings[k]) for k in asked},
        )
        self._trace = _env.get(TRACE_ENV)
        if self._trace and timeline.enabled():  # taking the events here would take them from the timeline
            warn(
                f"{TRACE_ENV} is ignored while HPCDL_TIMELINE is set: the timeline has the prefetcher's events",
                PrefetchWarning,
                stacklevel=2,
            )
            self._trace = None
        if self._trace:
            timeline.record()
        # Local set-up (plan, staging allocation) agreed on before the peer
        # tier's collective MPI_Comm_dup, so that no rank waits there for one that failed.
        core = call_on_every_rank(world, _core.PrefetchCore, self.store.shard_infos, options)
        # Its threads may fail to start on one rank alone: then every rank
        # closes its peer tier together (collective) and raises.
        try:
            call_on_every_rank(world, core.start, comm if self.ranks > 1 else None)
        except Exception:
            try:
                core.close()
            except HpcdlError:
                pass  # the start's error is the one to report
            raise
        self._core = core
        self._staging = self._core.staging
        self._started = time.monotonic()
        self._final_stats = None
        self._emit_warnings()
        _open.add(self)

    # ------------------------------------------------------------------ iteration

    @property
    def position(self):
        """(epoch, step) of the next batch: pass it as start= to resume there."""
        return divmod(self._position // self.local_batch, self.steps_per_epoch) if self.steps_per_epoch else (0, 0)

    def state(self):
        """A checkpoint of the position that resumes on any number of ranks
        (start=state): samples of the global order consumed in the epoch, and
        the run they belong to."""
        epoch, step = self.position
        return {
            "epoch": int(epoch),
            "sample_in_epoch": int(step) * self.batch_size,
            "seed": self.seed,
            "global_batch": self.batch_size,
            "samples": len(self.store),
            "drop_last": self.drop_last,
        }

    def peer_sources(self):
        """(source_rank, source_key) per sample, as plan() gives them (empty without a peer tier)."""
        return self._core.peer_sources()

    def epochs(self):
        """The remaining epochs in order, each an iterable of its remaining batches."""
        first = self.position[0]
        return [_Epoch(self, e) for e in range(first, self.num_epochs)] if self._core is not None else []

    def _finished(self):
        return self._core is None or self._position >= self.num_epochs * self.steps_per_epoch * self.local_batch

    def __iter__(self):
        """Every remaining batch of the run, epoch after epoch."""
        while not self._finished():
            yield self._next()

    def _next(self):
        if self._core is None:
            raise ValueError("the prefetcher is closed")
        _core.require_mpi_process("hpcdl.prefetch.Prefetcher")
        epoch, step = self.position
        try:
            batch, ring, nbytes, ids, offsets = self._core.next_batch()
        except OSError:  # a sample of this batch could not be read: the batch is consumed
            self._position += self.local_batch
            raise
        self._position += self.local_batch
        self._emit_warnings()
        return Batch(
            epoch, step, ids, self.store.labels[ids.astype(np.int64)], self._staging[ring : ring + nbytes], offsets
        )

    # ------------------------------------------------------------------ reporting

    def _emit_warnings(self):
        if self._core is not None:
            for message in self._core.take_warnings():
                warn(message, PrefetchWarning, stacklevel=3)

    def stats(self):
        """Per-source hits and bytes (ram, disk, peer, store), peer misses,
        timeouts, waits ("later" answers) and MPI errors (peer_errors), peers
        given up on (peers_gone), samples served to peers, tier
        slots filled from peers (peer_fills), every backing-store read
        (store_reads), tier fill, the consumer's stall time, and the read
        settings (read_settings: chosen, and the store's measured speed)."""
        s = self._core.stats() if self._core is not None else dict(self._final_stats or {})
        if s:
            s["seconds"] = time.monotonic() - self._started
            s["read_settings"] = dict(self.read_settings)
        return s

    def placement(self):
        """This rank's placement of the rest of the run (see placement())."""
        return self._core.placement()

    def _write_trace(self):
        path = self._trace if self.ranks == 1 else f"{self._trace}.rank{self.rank}"
        timeline.write_trace(path, timeline.spans(self.rank, _core.timeline_take()[0]))

    # ------------------------------------------------------------------ shutdown

    def close(self, timeout=120.0):
        """Stop and join every thread, free the tiers (the disk file too).
        Collective when the prefetcher spans several ranks."""
        core, self._core = self._core, None
        if core is None:
            return
        _open.discard(self)
        for message in core.take_warnings():
            warn(message, PrefetchWarning, stacklevel=2)
        try:
            self._final_stats = core.close(timeout)
        finally:
            if self._trace:
                self._write_trace()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_core", None) is not None:
            self.close(timeout=30.0)

    def __repr__(self):
        state = "closed" if self._core is None else f"next {self.position}"
        return (
            f"<hpcdl.prefetch.Prefetcher rank {self.rank}/{self.ranks}: {len(self.store)} samples, "
            f"batch {self.batch_size}, {self.num_epochs} epochs, {state}>"
        )
