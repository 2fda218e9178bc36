# The shuffle, streams, placement and the prefetcher (include/hpcdl/prefetch/shuffle.hpp,
# stream.hpp, placement.hpp, prefetcher.hpp). The Pythonic layer is hpcdl/prefetch.py.
# A stream spec is checked by the core (StreamSpec::validate) once per call: here
# where a function computes with it, else by make_plan (plan(), Prefetcher::create).

import os

import numpy as np

from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy
from libcpp.memory cimport shared_ptr, unique_ptr
from libcpp.string cimport string
from libcpp.utility cimport move, pair
from libcpp.vector cimport vector
from mpi4py cimport MPI
from mpi4py.libmpi cimport MPI_Comm, MPI_COMM_NULL

from libhpcdl.prefetch cimport (CBatchView, CConfigField, CPeerService, CPeerSources, CPlacement, CPlan,
                                CPrefetchConfig, CPrefetcher, CPrefetchStats, CStatField, CStreamSpec, config_fields,
                                epoch_order as c_epoch_order, kDefaultStagingBytes, make_plan, place as c_place,
                                shuffle_draw as c_shuffle_draw, stat_fields)
from libhpcdl.status cimport CStatus, check_status
from libhpcdl.store cimport CShardInfo, CStoreReader, shard_infos

# The staging ring's size unless told otherwise (include/hpcdl/prefetch/prefetcher.hpp).
DEFAULT_STAGING_BYTES = kDefaultStagingBytes

SOURCES = ("ram", "disk", "peer", "store")


cdef CStreamSpec _spec(uint64_t samples, uint64_t global_batch, uint64_t ranks, uint64_t epochs, uint64_t seed,
                       bint drop_last):
    """The spec as given: validated by the core function it is passed to."""
    cdef CStreamSpec spec
    spec.samples, spec.global_batch, spec.ranks = samples, global_batch, ranks
    spec.epochs, spec.seed, spec.drop_last = epochs, seed, drop_last
    return spec


def shuffle_draw(uint64_t seed, uint64_t epoch, uint64_t k):
    """Draw k of epoch `epoch` (a 64-bit word of Philox4x32-10)."""
    return c_shuffle_draw(seed, epoch, k)


def epoch_order(uint64_t n, uint64_t seed, uint64_t epoch):
    """Epoch `epoch`'s order of samples 0..n-1 (uint64 array)."""
    out = np.empty(n, dtype=np.uint64)
    cdef uint64_t[::1] view = out
    if n:
        with nogil:
            c_epoch_order[uint64_t](n, seed, epoch, &view[0])
    return out


def stream_layout(uint64_t samples, uint64_t global_batch, uint64_t ranks, uint64_t epochs, uint64_t seed,
                  bint drop_last, uint64_t rank=0):
    """(local batch, batches per epoch, reads per epoch per rank) after validating the spec and rank."""
    cdef CStreamSpec spec = _spec(samples, global_batch, ranks, epochs, seed, drop_last)
    check_status(spec.validate())
    check_status(spec.check_rank(rank))
    return spec.local_batch(), spec.batches_per_epoch(), spec.per_epoch()


cdef object _u64_array(const vector[uint64_t]& v):
    out = np.empty(v.size(), dtype=np.uint64)
    cdef uint64_t[::1] view = out
    if v.size():
        memcpy(&view[0], v.data(), v.size() * sizeof(uint64_t))
    return out


def rank_stream(uint64_t samples, uint64_t global_batch, uint64_t ranks, uint64_t rank, uint64_t epochs,
                uint64_t seed, bint drop_last, uint64_t start=0):
    """Rank `rank`'s reads from stream position `start` to the end of the run (uint64 array)."""
    cdef CStreamSpec spec = _spec(samples, global_batch, ranks, epochs, seed, drop_last)
    check_status(spec.validate())
    check_status(spec.check_rank(rank))
    cdef vector[uint64_t] v
    with nogil:
        v = spec.rank_stream(rank, start)
    return _u64_array(v)


def placement(stream, sizes, uint64_t ram_bytes, uint64_t disk_bytes):
    """Tier placement of one rank's stream: dict of numpy arrays (see placement.hpp)."""
    cdef vector[uint64_t] s
    cdef const uint64_t[::1] st = np.ascontiguousarray(stream, dtype=np.uint64)
    cdef const uint64_t[::1] sz = np.ascontiguousarray(sizes, dtype=np.uint64)
    cdef uint64_t n = sz.shape[0]
    cdef uint64_t caps[2]
    caps[0], caps[1] = ram_bytes, disk_bytes
    for i in range(st.shape[0]):
        if st[i] >= n:
            raise ValueError(f"stream entry {st[i]} out of range [0, {n})")
        s.push_back(st[i])
    cdef CPlacement p
    with nogil:
        p = c_place(s, &sz[0] if n else NULL, n, caps)
    return _placement_dict(p)


cdef object _placement_dict(const CPlacement& p):
    n = p.tier.size()
    freq = np.empty(n, dtype=np.uint32)
    tier = np.empty(n, dtype=np.uint8)
    cdef uint32_t[::1] fv = freq
    cdef uint8_t[::1] tv = tier
    if n:
        memcpy(&fv[0], p.freq.data(), n * sizeof(uint32_t))
        memcpy(&tv[0], p.tier.data(), n * sizeof(uint8_t))
    first = _u64_array(p.first)
    return {"freq": freq, "first": first, "tier": tier, "offset": _u64_array(p.offset),
            "ram": _u64_array(p.lists[0]), "disk": _u64_array(p.lists[1]),
            "ram_used": p.used[0], "disk_used": p.used[1]}


def plan(uint64_t samples, uint64_t global_batch, uint64_t ranks, uint64_t rank, uint64_t epochs, uint64_t seed,
         bint drop_last, uint64_t start, sizes, uint64_t ram_bytes, uint64_t disk_bytes, peer_ram, peer_disk):
    """A rank's start-up plan (placement.hpp make_plan, what the prefetcher runs):
    its stream from position `start`, its placement (placement()'s dict) and, when
    peer_ram lists every rank's RAM bytes (peer_disk: disk bytes, or empty), per
    sample the source peer ("source_rank", int32, -1 none) and its global key
    ("source_key", uint64, 2**64-1 none); empty arrays without a peer tier."""
    cdef CStreamSpec spec = _spec(samples, global_batch, ranks, epochs, seed, drop_last)
    cdef const uint64_t[::1] sz = np.ascontiguousarray(sizes, dtype=np.uint64)
    if <uint64_t>sz.shape[0] != samples:
        raise ValueError(f"sizes has {sz.shape[0]} entries for {samples} samples")
    cdef vector[uint64_t] ram = [int(c) for c in peer_ram]
    cdef vector[uint64_t] disk = [int(c) for c in peer_disk]
    cdef uint64_t caps[2]
    caps[0], caps[1] = ram_bytes, disk_bytes
    cdef CPlan p
    cdef CStatus st
    with nogil:
        st = make_plan(spec, start, rank, &sz[0], caps, ram, disk, &p)
    check_status(st)
    out = _placement_dict(p.placement)
    out["stream"] = _u64_array(p.stream)
    out["source_rank"], out["source_key"] = _sources(p.sources)
    return out


cdef object _sources(const CPeerSources& s):
    rank = np.empty(s.rank.size(), dtype=np.int32)
    cdef int32_t[::1] view = rank
    if s.rank.size():
        memcpy(&view[0], s.rank.data(), s.rank.size() * sizeof(int32_t))
    return rank, _u64_array(s.key)


def peer_sources(uint64_t samples, uint64_t global_batch, uint64_t ranks, uint64_t epochs, uint64_t seed,
                 bint drop_last, uint64_t start, sizes, ram_capacity, disk_capacity, uint64_t rank):
    """plan()'s (source_rank, source_key) for rank `rank`."""
    p = plan(samples, global_batch, ranks, rank, epochs, seed, drop_last, start, sizes, 0, 0, ram_capacity,
             disk_capacity)
    return p["source_rank"], p["source_key"]


def peer_message_pieces(uint64_t total, uint64_t max_message):
    """The byte ranges [(begin, end)] in which the peer tier sends a reply of `total` bytes."""
    cdef vector[pair[uint64_t, uint64_t]] ranges = CPeerService.pieces(total, max_message)
    return ranges


cdef class _Staging:
    """The core's staging ring as a writable byte buffer; it shares the
    memory, so numpy views of it stay valid after the prefetcher is closed."""
    cdef shared_ptr[char] memory
    cdef Py_ssize_t size, one

    def __getbuffer__(self, Py_buffer* view, int flags):
        view.buf = self.memory.get()
        view.obj = self
        view.len = self.size
        view.readonly = 0
        view.itemsize = 1
        view.format = b"B"
        view.ndim = 1
        view.shape = &self.size
        view.strides = &self.one
        view.suboffsets = NULL
        view.internal = NULL


cdef class PrefetchOptions:
    """The prefetcher's settings, hpcdl::PrefetchConfig (prefetcher.hpp): one
    attribute per field, by the field's name, its default the struct's. A
    new field there is one here too (config_fields lists them)."""
    cdef CPrefetchConfig c

    def __init__(self, **settings):
        for name, value in settings.items():
            setattr(self, name, value)

    cdef CConfigField _field(self, str name) except *:
        cdef bytes key = name.encode()
        cdef CConfigField f
        for f in config_fields(self.c):
            if <bytes>f.name == key:
                return f
        raise AttributeError(f"the prefetcher has no setting {name!r}")

    def __getattr__(self, str name):
        cdef CConfigField f = self._field(name)
        if f.u64:
            return f.u64[0]
        if f.count:
            return f.count[0]
        if f.seconds:
            return f.seconds[0]
        if f.flag:
            return f.flag[0]
        if f.text:
            return f.text[0].decode()
        return list(f.list[0])

    def __setattr__(self, str name, value):
        cdef CConfigField f = self._field(name)
        if f.u64:
            f.u64[0] = value
        elif f.count:
            f.count[0] = value
        elif f.seconds:
            f.seconds[0] = value
        elif f.flag:
            f.flag[0] = value
        elif f.text:
            f.text[0] = os.fsencode(value)
        else:
            f.list[0] = [int(v) for v in value]

    def names(self):
        """Every setting's name, in the struct's order."""
        cdef CConfigField f
        names = []
        for f in config_fields(self.c):
            names.append((<bytes>f.name).decode())
        return names

    def to_dict(self):
        return {name: getattr(self, name) for name in self.names()}

    def __repr__(self):
        return f"PrefetchOptions({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


cdef class PrefetchCore:
    """One rank's running prefetcher. staging: the uint8 numpy array of the
    core's staging ring (its size: the options' staging_bytes, raised to three of the
    largest local batches); batches are (ring offset, bytes, sample ids, offsets) into it."""
    cdef unique_ptr[CPrefetcher] core
    cdef readonly object staging

    def __cinit__(self, shards, PrefetchOptions options not None):
        cdef vector[CShardInfo] infos = shard_infos(shards)
        cdef unique_ptr[CStoreReader] reader
        cdef CPrefetchConfig c = options.c
        cdef CStatus st
        cdef _Staging ring = _Staging()
        with nogil:
            st = CStoreReader.open(move(infos), &reader)
        check_status(st)
        with nogil:
            st = CPrefetcher.create(move(reader), move(c), &self.core)
        check_status(st)
        ring.memory, ring.size, ring.one = self.core.get().staging(), self.core.get().staging_bytes(), 1
        self.staging = np.frombuffer(ring, dtype=np.uint8)

    def start(self, MPI.Comm comm=None):
        """Starts the peer tier (collective over comm when there is one) and the threads."""
        cdef CStatus st
        cdef MPI_Comm mpi_comm = comm.ob_mpi if comm is not None else MPI_COMM_NULL
        with nogil:
            st = self.core.get().start(mpi_comm)
        check_status(st)

    def next_batch(self):
        """(batch, ring offset, bytes, sample ids, offsets) of the next local batch; blocks until staged."""
        cdef CBatchView v
        cdef CStatus st
        if not self.core:
            raise ValueError("the prefetcher is closed")
        with nogil:
            st = self.core.get().next_batch(&v)
        check_status(st)
        ids = np.empty(v.count, dtype=np.uint64)
        offs = np.empty(v.count + 1, dtype=np.uint64)
        cdef uint64_t[::1] iv = ids
        cdef uint64_t[::1] ov = offs
        for i in range(v.count):
            iv[i] = v.samples[i]
        for i in range(v.count + 1):
            ov[i] = v.offsets[i]
        return v.batch, v.ring_offset, v.bytes, ids, offs

    def stats(self):
        if not self.core:
            return None
        cdef CPrefetchStats s = self.core.get().stats()
        cdef CStatField f
        out = {"hits": {SOURCES[i]: s.hits[i] for i in range(4)}, "bytes": {SOURCES[i]: s.bytes[i] for i in range(4)}}
        for f in stat_fields(s):
            if f.count:
                out[(<bytes>f.name).decode()] = f.count[0]
            else:
                out[(<bytes>f.name).decode()] = f.seconds[0]
        return out

    def placement(self):
        return _placement_dict(self.core.get().placement())

    def peer_sources(self):
        """(source_rank, source_key) per sample, as plan() gives them; empty arrays without a peer tier."""
        return _sources(self.core.get().sources())

    def take_warnings(self):
        if not self.core:
            return []
        return [w.decode("utf-8", "replace") for w in self.core.get().take_warnings()]

    def close(self, double timeout_s=120.0):
        """Joins every thread; collective when the peer tier is on. Returns the final stats."""
        cdef CStatus st
        if not self.core:
            return None
        with nogil:
            st = self.core.get().close(timeout_s)
        final = self.stats()
        self.core.reset()
        check_status(st)
        return final
