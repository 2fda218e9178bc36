# The collective engine (include/hpcdl/engine/engine.hpp): Buffer, Handle, submit,
# counters, error-feedback residuals and the whole-array codec kernels.
# The Pythonic layer is hpcdl/collectives.py.

from cpython.buffer cimport (PyBUF_FORMAT, PyBUF_RECORDS_RO, PyBUF_STRIDES, PyBuffer_IsContiguous,
                             PyBuffer_Release, PyObject_GetBuffer)
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string
from libcpp.utility cimport move
from libcpp.vector cimport vector
from mpi4py cimport MPI

from libhpcdl.codecs cimport (CCodecKind, CCodecSpec, CTopkThreshold, codec_decode, codec_encode, codec_encoded_bytes,
                              codec_name, kDefaultInt8Block, parse_codec, topk_algorithm_name,
                              topk_contribution_array, topk_count as c_topk_count, topk_reuse_cap, topk_use_split)
from libhpcdl.engine cimport (CAgreementStats, CDType, CEngine, CEngineNotice, CEngineStats, CEnvSetting, CFloatSegment,
                              CGroupMember,
                              CNoticeKind, COpKind, COpRequest, COpResult, COperation, COpTimes, CReduceOp,
                              dtype_is_float,
                              dtype_name, dtype_size, dtype_valid, in_mpi_process as c_in_mpi_process,
                              reduce_op_name, reduce_op_valid,
                              kDefaultChunkBytes, kDefaultStallErrorSeconds, kDefaultStallWarningSeconds,
                              kEnvSettingCount, kEnvSettings, kMaxChunkBytes, kMaxNotices, kMinChunkBytes,
                              kHalvingDoublingMaxSegmentBytes, kHalvingDoublingMinRanks, kRecursiveDoublingMaxBytes, kUnbounded,
                              use_halving_doubling, use_recursive_doubling, remember_mpi_process, require_mpi_process as c_require_mpi_process)
from libhpcdl.status cimport CStatus, check_status

import math

from hpcdl._warn import warn as _warn

# The ring's chunk size: default and bounds (include/hpcdl/algorithms/ring.hpp; the engine checks them).
DEFAULT_CHUNK_BYTES = kDefaultChunkBytes
MIN_CHUNK_BYTES = kMinChunkBytes
MAX_CHUNK_BYTES = kMaxChunkBytes
# A dense allreduce of at most this many bytes runs by recursive doubling, not the ring
# (include/hpcdl/algorithms/recursive_doubling.hpp).
RECURSIVE_DOUBLING_MAX_BYTES = kRecursiveDoublingMaxBytes
# Above that, over a power-of-two number of ranks (at least HALVING_DOUBLING_MIN_RANKS), one of
# at most this many bytes per rank (bytes / size) runs by recursive halving and doubling
# (include/hpcdl/algorithms/halving_doubling.hpp).
HALVING_DOUBLING_MAX_SEGMENT_BYTES = kHalvingDoublingMaxSegmentBytes
HALVING_DOUBLING_MIN_RANKS = kHalvingDoublingMinRanks


def dense_allreduce_algorithm(int size, size_t nbytes):
    """The algorithm of an uncompressed allreduce of nbytes over size ranks (the engine's choice):
    "recursive doubling", "halving-doubling" or "ring" ("none" on one rank)."""
    if size == 1:
        return "none"
    if use_recursive_doubling(nbytes):
        return "recursive doubling"
    return "halving-doubling" if use_halving_doubling(size, nbytes) else "ring"
# hpcdl.configure()'s stall limits unless set (include/hpcdl/engine/stall_inspector.hpp).
DEFAULT_STALL_WARNING_SECONDS = kDefaultStallWarningSeconds
DEFAULT_STALL_ERROR_SECONDS = kDefaultStallErrorSeconds
# Int8's values per scale unless set (include/hpcdl/codecs/codec_spec.hpp).
DEFAULT_INT8_BLOCK = kDefaultInt8Block


cdef dict _env_settings():
    table = {}
    cdef size_t i
    cdef const CEnvSetting* s
    for i in range(kEnvSettingCount):
        s = &kEnvSettings[i]
        table[s.key.decode()] = (int if s.integer else float, s.low, None if s.high == kUnbounded else s.high,
                                 s.variable.decode())
    return table


# Every HPCDL_* setting: key -> (type, low, high or None, variable), from the
# one table (include/hpcdl/engine/settings.hpp); hpcdl._env checks them.
ENV_SETTINGS = _env_settings()


cdef dict _dtype_table():
    table = {}
    cdef int code = 0
    while dtype_valid(code):
        table[dtype_name(<CDType>code).decode()] = (code, dtype_size(<CDType>code), dtype_is_float(<CDType>code))
        code += 1
    return table


cdef dict _op_table():
    table = {}
    cdef int code = 0
    while reduce_op_valid(code):
        table[reduce_op_name(<CReduceOp>code).decode()] = code
        code += 1
    return table


# The element types the core takes (include/hpcdl/util/dtype.hpp): name -> (core code,
# item size, floating point); read through hpcdl.collectives.DTYPES.
DTYPES = _dtype_table()
# Buffer-protocol format codes -> dtype names, for exporters without a dtype attribute.
_FORMATS = {"f": "float32", "d": "float64", "e": "float16", "i": "int32", "l": "int64", "q": "int64", "?": "bool",
            "B": "uint8", "b": "int8", "h": "int16", "H": "uint16", "I": "uint32", "L": "uint64", "Q": "uint64"}
# The reduction ops (include/hpcdl/util/dtype.hpp): name -> core code.
OPS = _op_table()


class EngineWarning(UserWarning):
    """What hpcdl's engine thread tells this rank: another rank left a communicator
    with operations waiting here, or an engine error failed them."""


class StallWarning(EngineWarning):
    """An operation waits for ranks that have not submitted it (or, deferred, for
    mark_ready() here)."""


_NOTICE_WARNINGS = {<int>CNoticeKind.kStall: StallWarning, <int>CNoticeKind.kRankLeft: EngineWarning,
                    <int>CNoticeKind.kError: EngineWarning}


cdef _emit_engine_notices():
    """Issue what the engine thread kept for this rank (Engine::notice) as
    warnings through hpcdl's one channel. The thread never takes the GIL: its
    messages wait for the next call into the engine (submit, wait, done,
    mark_ready, stats, shutdown). A compiled frame: stacklevel 1 names the
    Python caller of that call."""
    cdef uint64_t dropped = 0
    cdef vector[CEngineNotice] notices = CEngine.instance().take_notices(&dropped)
    cdef CEngineNotice n
    for n in notices:
        _warn(n.message.decode("utf-8", "replace").removeprefix("hpcdl: "), _NOTICE_WARNINGS[<int>n.kind])
    if dropped:
        _warn(f"{dropped} more engine messages were dropped (at most {kMaxNotices} are kept between calls "
              f"into hpcdl)", EngineWarning)


cdef class Buffer:
    """A C-contiguous buffer taken through the buffer protocol, zero-copy.

    The one intake path for every array handed to the core: it checks layout,
    writability and dtype before any communication starts. Buffer.at takes
    memory whose layout the caller has checked (a torch tensor's, by address).
    """
    cdef Py_buffer view
    cdef bint held
    cdef readonly str dtype
    cdef readonly Py_ssize_t count
    cdef readonly tuple shape  # the exporter's dimensions: part of what ranks agree on
    cdef readonly object owner

    def __init__(self, obj, dtype=None, bint writable=True, bint raw=False):
        self.release()  # __init__ called again: the first view is let go
        try:
            PyObject_GetBuffer(obj, &self.view, PyBUF_RECORDS_RO)
        except (TypeError, BufferError, ValueError) as exc:
            # Arrays of extension dtypes (ml_dtypes' bfloat16) export no format
            # string: their dtype attribute names the type instead.
            if not hasattr(obj, "dtype"):
                raise TypeError(f"hpcdl needs an array exposing the buffer protocol, "
                                f"got {type(obj).__name__}: {exc}") from None
            PyObject_GetBuffer(obj, &self.view, PyBUF_STRIDES)
        self.held = True
        self.owner = obj
        if writable and self.view.readonly:
            raise ValueError(f"buffer is read-only; hpcdl reduces in place and needs a writable {type(obj).__name__}")
        if not PyBuffer_IsContiguous(&self.view, b"C"):
            raise ValueError("buffer is not C-contiguous; pass a contiguous copy (numpy.ascontiguousarray)")
        if raw:  # point-to-point moves bytes: any element type, counted in bytes
            self.dtype, self.count, self.shape = "bytes", self.view.len, (self.view.len,)
            return
        fmt = self.view.format.decode() if self.view.format != NULL else "B"
        self.dtype = _resolve_dtype(obj, dtype, fmt, self.view.itemsize)
        self.count = self.view.len // self.view.itemsize if self.view.itemsize else 0
        self.shape = tuple(self.view.shape[i] for i in range(self.view.ndim)) if self.view.shape != NULL \
            else (self.count,)
        _check_itemsize(self.dtype, self.view.itemsize)

    @staticmethod
    def at(owner, size_t address, Py_ssize_t itemsize, shape, dtype):
        """The writable, C-contiguous memory at ``address``: ``shape`` items of
        ``itemsize`` bytes, read as ``dtype`` (a name, or a numpy dtype), alive as long as ``owner`` is. The
        caller has checked the layout (hpcdl._tensors: a CPU tensor's data_ptr());
        nothing is held through the buffer protocol, so no view object is made."""
        cdef Buffer b = Buffer.__new__(Buffer)
        cdef Py_ssize_t count = 1
        b.shape = tuple(shape)
        for dim in b.shape:
            count *= <Py_ssize_t>dim
        b.dtype = _known_dtype(_dtype_name(dtype))
        _check_itemsize(b.dtype, itemsize)
        b.view.buf = <void*>address
        b.view.len = count * itemsize
        b.view.itemsize = itemsize
        b.view.readonly = 0
        b.count = count
        b.owner = owner
        return b

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)

    cdef void* ptr(self):
        return self.view.buf

    cdef void release(self):
        """The engine is done with the memory: let the exporter free or resize it."""
        if self.held:
            self.held = False
            PyBuffer_Release(&self.view)

    @property
    def nbytes(self):
        return self.view.len


def _resolve_dtype(obj, dtype, str fmt, Py_ssize_t itemsize):
    if dtype is not None:
        name = _dtype_name(dtype)
    elif hasattr(obj, "dtype"):
        name = _array_dtype_name(obj.dtype)
    else:
        code = fmt.lstrip("@=<>!")
        name = _FORMATS.get(code, f"format '{code}'")
        if name in ("int64", "uint64") and itemsize != 8:
            name = f"format '{code}' of {itemsize} bytes"
    return _known_dtype(name)


# An array's dtype object -> (that object, its name): str(numpy dtype) runs as
# Python code in numpy 2 and was the largest cost of a small array's intake.
# Keyed by equality but used only for the very object stored (dtypes differing
# in ways equality ignores keep their own name); it holds only supported dtypes.
cdef dict _array_dtype_names = {}


cdef str _array_dtype_name(dtype):
    if getattr(type(dtype), "__hash__", None) is None:
        return str(dtype)  # not a dtype object at all: _known_dtype names it
    cdef tuple entry = _array_dtype_names.get(dtype)
    if entry is not None and entry[0] is dtype:
        return entry[1]
    name = str(dtype)
    if name in DTYPES:
        _array_dtype_names[dtype] = (dtype, name)
    return name


cdef str _dtype_name(dtype):
    if type(dtype) is str:  # a name already (Buffer.at's per-call case): no attribute lookup
        return <str>dtype
    return str(getattr(dtype, "name", dtype))


cdef str _known_dtype(str name):
    if name not in DTYPES:
        raise TypeError(f"unsupported dtype {name}; hpcdl takes {', '.join(DTYPES)} "
                        "(bfloat16 through ml_dtypes, or a uint16 view with dtype='bfloat16')")
    return name


cdef _check_itemsize(str dtype, Py_ssize_t itemsize):
    if DTYPES[dtype][1] != itemsize:
        raise TypeError(f"dtype {dtype} has {DTYPES[dtype][1]}-byte elements, "
                        f"the buffer has {itemsize}-byte items")


cdef class Handle:
    """An operation submitted to the engine: wait() for it, or poll done()."""
    cdef shared_ptr[COperation] op
    cdef readonly Buffer buffer  # keeps the memory alive while the engine uses it
    cdef readonly list members  # a grouped operation's Buffers, instead
    cdef list segments  # Buffers holding the data in pieces (mark_ready(segments)), kept alive likewise
    cdef readonly str name
    cdef bint raised  # its error has reached the caller

    cdef void _retire(self):
        """The engine is done with the operation: drop it from the in-flight set, free its buffer."""
        _inflight.discard(self)
        if self.buffer is not None:
            self.buffer.release()
        for member in self.members or ():
            (<Buffer>member).release()
        for segment in self.segments or ():
            (<Buffer>segment).release()

    cdef _finish(self):
        """Retire a finished operation and raise its error, the first time one is seen."""
        self._retire()
        cdef CStatus st = self.op.get().status()
        if not st.ok() and not self.raised:
            self.raised = True
            check_status(st)

    def done(self):
        """True once the operation has finished; raises its error if it failed
        (once: whichever of done() and wait() sees it first)."""
        _emit_engine_notices()
        if not self.op.get().done():
            return False
        self._finish()
        return True

    def wait_for(self, seconds):
        """Block at most ``seconds`` for the operation to finish, woken as soon as it
        does; then done(): True once finished (raising its error if it failed)."""
        cdef COperation* op = self.op.get()
        cdef double limit = seconds
        with nogil:
            op.wait_for(limit)
        return self.done()

    def wait(self, timeout=None):
        """Block until the operation finishes; raise its error if it failed.

        Stall warnings from the engine are issued here (StallWarning), naming
        the ranks that have not submitted the operation.
        """
        cdef COperation* op = self.op.get()
        cdef bint finished = False
        cdef double slice_s = 0.1
        cdef double waited = 0.0
        if not op.done():
            _refuse_wait_behind_unready(self)
        while not finished:
            with nogil:
                finished = op.wait_for(slice_s)
            for notice in op.take_notices():  # through hpcdl's one warning channel (the rank in front)
                _warn(notice.decode("utf-8", "replace").removeprefix("hpcdl: "), StallWarning)  # a compiled frame: 1 names wait()'s caller
            _emit_engine_notices()  # a rank that left is named before the error it causes
            if not finished:
                PyErr_CheckSignals()
                waited += slice_s
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(f"hpcdl operation '{self.name}' not finished after {timeout} s")
        self._finish()
        if self.members is not None:
            return [member.owner for member in self.members]
        return None if self.buffer is None else self.buffer.owner

    def mark_ready(self, segments=None):
        """The buffer of an operation submitted with deferred=True now holds its
        data: the engine may run it. Idempotent; nothing to do for others.

        segments: a float32 allreduce with TopK may instead take its data in
        pieces, Buffers whose concatenation in order is the array (as many
        values as the buffer): the result is written into them and the buffer
        is left alone. The engine holds them until the operation finishes."""
        cdef vector[CFloatSegment] pieces
        cdef CFloatSegment piece
        cdef Buffer seg
        if segments is None:
            self.op.get().mark_ready()
        else:
            for seg in segments:
                if seg.dtype != "float32":
                    raise TypeError(f"'{self.name}': segments must be float32, got {seg.dtype}")
                piece.data = <float*>seg.ptr()
                piece.count = seg.count
                pieces.push_back(piece)
            self.segments = list(segments)
            check_status(self.op.get().mark_ready(move(pieces)))
        _emit_engine_notices()

    def ready(self):
        """False while a deferred operation waits for mark_ready()."""
        return self.op.get().ready()

    def result(self, member=None):
        """An allgather's, alltoall's or reducescatter's result, once finished: (a
        writable buffer of its bytes, the rows received from (reducescatter: of the
        segment of) each rank). A grouped allgather's or reducescatter's: that of
        ``member`` (its index in the group). The buffer keeps the engine's memory
        alive; no copy is made."""
        if not self.op.get().done():
            raise RuntimeError(f"hpcdl operation '{self.name}' has not finished: wait() first")
        cdef ResultBytes out = ResultBytes.__new__(ResultBytes)
        out.op = self.op
        out.member = -1
        if member is not None:
            if self.members is None or not 0 <= member < len(self.members):
                raise IndexError(f"hpcdl operation '{self.name}' has no member {member}")
            out.member = member
        return out, [int(n) for n in out.of().rows]

    def timings(self):
        """Wall-clock microseconds: submitted, ready (= submitted unless deferred),
        agreed (the engine took its plan), started, reduce-scatter end, finished."""
        cdef COpTimes t = self.op.get().times()
        return {"submitted_us": t.submitted_us, "ready_us": t.ready_us, "agreed_us": t.agreed_us,
                "started_us": t.started_us, "reduce_scatter_end_us": t.reduce_scatter_end_us,
                "finished_us": t.finished_us}


cdef char* _BYTE_FORMAT = b"B"


cdef class ResultBytes:
    """The bytes of an operation's result (OpResult), exported zero-copy through the
    buffer protocol; they live as long as this object and its views."""
    cdef shared_ptr[COperation] op
    cdef Py_ssize_t member  # a grouped operation's member; -1: the operation's own result
    cdef Py_ssize_t shape[1]

    cdef COpResult* of(self):
        if self.member < 0:
            return &self.op.get().result()
        return &self.op.get().member_result(self.member)

    def __getbuffer__(self, Py_buffer* view, int flags):
        cdef COpResult* r = self.of()
        self.shape[0] = <Py_ssize_t>r.bytes
        view.buf = r.ptr()
        view.obj = self
        view.len = self.shape[0]
        view.readonly = 0
        view.itemsize = 1
        view.format = NULL  # unsigned bytes
        if flags & PyBUF_FORMAT:
            view.format = _BYTE_FORMAT
        view.ndim = 1
        view.shape = self.shape
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer* view):
        pass


# Handles of operations the engine may still use: their buffers must outlive
# that use. A finished one leaves when done()/wait() sees it, or when a scan
# (wait(), or a submit once the set doubled) finds it finished.
_inflight = set()
_prune_at = [64]


cdef _prune():
    """Retire every finished operation in _inflight (their errors wait for their own done()/wait())."""
    cdef Handle h
    for h in [h for h in _inflight if h.op.get().done()]:
        h._retire()
    _prune_at[0] = max(64, 2 * len(_inflight))


cdef bint _blocks(Handle h):
    """A deferred operation not marked ready that has not failed already (a mismatch, shutdown)."""
    return not h.op.get().ready() and not h.op.get().done()


def _refuse_wait_behind_unready(Handle waiting):
    """The engine runs operations in the agreed order and waits for a deferred
    one's data when the order reaches it: waiting here for anything unfinished
    while a deferred operation is not marked ready could wait forever."""
    cdef Handle h
    if _blocks(waiting):
        raise RuntimeError(f"hpcdl operation '{waiting.name}' was submitted with deferred=True: "
                           "call mark_ready() once its buffer holds the data, then wait()")
    _prune()  # the scan below then covers unfinished operations only
    for h in _inflight:
        if _blocks(h):
            raise RuntimeError(f"waiting for hpcdl operation '{waiting.name}' while deferred operation "
                               f"'{h.name}' is not marked ready: the engine runs operations in the agreed "
                               f"order and may have to run '{h.name}' first; mark_ready() it before waiting")


def submit(int kind, Buffer buf, MPI.Comm comm not None, name, int reduce_op=0, int root=0,
           uint64_t chunk_bytes=0, codec="", bint deferred=False, rows=None, splits=()):
    """Submit one operation to the engine; returns a Handle (deferred: runs
    after Handle.mark_ready()). rows: the first dimension of an allgather,
    reducescatter or alltoall (allgather, alltoall: then ranks agree on one
    row's element count, not the whole); splits: alltoall's rows per rank."""
    cdef COpRequest req
    cdef shared_ptr[COperation] op
    cdef CStatus st
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__} {name!r}")
    req.name = (name or "").encode()
    req.desc.kind = <COpKind>kind
    req.desc.dtype = <CDType>DTYPES[buf.dtype][0] if buf is not None else CDType.kInt32
    req.desc.count = buf.count if buf is not None else 0
    if rows is not None:
        req.rows = rows
    gathers = kind == KIND_ALLGATHER or kind == KIND_ALLTOALL
    if gathers:  # each rank its own first dimension: the ranks agree on one row
        req.desc.count = math.prod(buf.shape[1:])
    if buf is not None:
        for dim in (buf.shape[1:] if gathers else buf.shape):
            req.desc.shape.push_back(dim)
    for n in splits:
        req.splits.push_back(n)
    req.desc.reduce_op = <CReduceOp>reduce_op
    req.desc.root = root
    req.desc.chunk_bytes = chunk_bytes if chunk_bytes else kDefaultChunkBytes
    req.desc.codec = codec.encode()
    req.data = buf.ptr() if buf is not None else NULL
    req.deferred = deferred
    with nogil:
        st = CEngine.instance().submit(comm.ob_mpi, move(req), &op)
    _emit_engine_notices()
    check_status(st)
    cdef Handle h = Handle.__new__(Handle)
    h.op = op
    h.buffer = buf
    h.name = op.get().name().decode()
    if len(_inflight) >= _prune_at[0]:
        _prune()
    _inflight.add(h)
    return h


def submit_group(int kind, list buffers, MPI.Comm comm not None, name, int reduce_op=0, uint64_t chunk_bytes=0):
    """Submit a grouped allreduce, allgather or reducescatter (``kind``) of ``buffers``
    (Buffers): one operation to agree on, each array run as its own call would be.
    Returns a Handle whose wait() gives the owners (allgather, reducescatter: then
    result(i) each member's result). An allgather's members agree on one row each
    (their first dimensions may differ per rank), as submit's."""
    cdef COpRequest req
    cdef CGroupMember member
    cdef shared_ptr[COperation] op
    cdef CStatus st
    cdef Buffer buf
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str or None, got {type(name).__name__} {name!r}")
    req.name = (name or "").encode()
    req.desc.kind = <COpKind>kind
    req.desc.reduce_op = <CReduceOp>reduce_op
    req.desc.chunk_bytes = chunk_bytes if chunk_bytes else kDefaultChunkBytes
    gathers = kind == KIND_GROUPED_ALLGATHER
    for buf in buffers:
        member.dtype = <CDType>DTYPES[buf.dtype][0]
        member.count = math.prod(buf.shape[1:]) if gathers else buf.count
        member.shape.clear()
        for dim in (buf.shape[1:] if gathers else buf.shape):
            member.shape.push_back(dim)
        if gathers:
            req.member_rows.push_back(buf.shape[0])
        req.desc.members.push_back(member)
        req.member_data.push_back(buf.ptr())
    with nogil:
        st = CEngine.instance().submit(comm.ob_mpi, move(req), &op)
    _emit_engine_notices()
    check_status(st)
    cdef Handle h = Handle.__new__(Handle)
    h.op = op
    h.members = list(buffers)
    h.name = op.get().name().decode()
    if len(_inflight) >= _prune_at[0]:
        _prune()
    _inflight.add(h)
    return h


def transfer(bint send, Buffer buf not None, MPI.Comm comm not None, int peer, int tag):
    """Send (or receive exactly buf.nbytes) raw bytes to (from) ``peer`` with
    ``tag`` on ``comm``; the engine thread moves them. Returns a Handle."""
    cdef shared_ptr[COperation] op
    cdef CStatus st
    cdef void* data = buf.ptr()
    cdef uint64_t nbytes = buf.view.len
    with nogil:
        st = CEngine.instance().submit_transfer(comm.ob_mpi, send, data, nbytes, peer, tag, &op)
    _emit_engine_notices()
    check_status(st)
    cdef Handle h = Handle.__new__(Handle)
    h.op = op
    h.buffer = buf
    h.name = op.get().name().decode()
    if len(_inflight) >= _prune_at[0]:
        _prune()
    _inflight.add(h)
    return h


def parse_op(op):
    try:
        return OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"op must be one of {', '.join(map(repr, OPS))}, got {op!r}") from None


KIND_ALLREDUCE = <int>COpKind.kAllreduce
KIND_BROADCAST = <int>COpKind.kBroadcast
KIND_BARRIER = <int>COpKind.kBarrier
KIND_ALLGATHER = <int>COpKind.kAllgather
KIND_REDUCESCATTER = <int>COpKind.kReduceScatter
KIND_ALLTOALL = <int>COpKind.kAlltoall
KIND_GROUPED_ALLREDUCE = <int>COpKind.kGroupedAllreduce
KIND_GROUPED_ALLGATHER = <int>COpKind.kGroupedAllgather
KIND_GROUPED_REDUCESCATTER = <int>COpKind.kGroupedReduceScatter
KIND_JOIN = <int>COpKind.kJoin



def set_stall_limits(double warn_seconds, double error_seconds):
    CEngine.instance().set_stall_limits(warn_seconds, error_seconds)


def stats():
    """Engine counters: a list of dicts, one per (kind, codec)."""
    _emit_engine_notices()
    cdef vector[CEngineStats] rows = CEngine.instance().stats()
    return [{"kind": r.kind.decode(), "codec": r.codec.decode(), "ops": r.ops,
             "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received,
             "dense_bytes": r.dense_bytes, "seconds": r.seconds} for r in rows]


def agreement_stats():
    """The agreement's control traffic on this rank (a dict of counters)."""
    _emit_engine_notices()
    cdef CAgreementStats a = CEngine.instance().agreement_stats()
    return {"messages_sent": a.messages_sent, "messages_received": a.messages_received,
            "entries_received": a.entries_received, "descriptions_received": a.descriptions_received,
            "one_hop_runs": a.one_hop_runs}


def reset_stats():
    CEngine.instance().reset_stats()


def reset_compression_state():
    """Forget every error-feedback residual."""
    CEngine.instance().reset_compression_state()


def free_residual(MPI.Comm comm, name):
    """Free tensor `name`'s error-feedback residual; True when there was one."""
    cdef cbool found = False
    cdef string text = name.encode()
    cdef CStatus st
    with nogil:
        st = CEngine.instance().free_residual(comm.ob_mpi, text, &found)
    check_status(st)
    return found


def set_residual(MPI.Comm comm, name, values):
    """Make `values` (1-D float32) tensor `name`'s error-feedback residual on this rank."""
    import numpy
    cdef const float[::1] src = numpy.ascontiguousarray(values, dtype=numpy.float32).reshape(-1)
    cdef vector[float] out
    cdef size_t i
    out.resize(src.shape[0])
    for i in range(<size_t>src.shape[0]):
        out[i] = src[i]
    cdef string text = name.encode()
    cdef CStatus st
    with nogil:
        st = CEngine.instance().set_residual(comm.ob_mpi, text, move(out))
    check_status(st)


def residual_bytes():
    """Bytes every error-feedback residual of this process takes."""
    return CEngine.instance().residual_bytes()


def residual(MPI.Comm comm, name):
    """A float32 copy of tensor `name`'s error-feedback residual, or None."""
    cdef vector[float] out
    cdef cbool found = False
    cdef string text = name.encode()
    cdef CStatus st
    with nogil:
        st = CEngine.instance().copy_residual(comm.ob_mpi, text, &out, &found)
    check_status(st)
    if not found:
        return None
    import numpy
    arr = numpy.empty(out.size(), dtype=numpy.float32)
    cdef float[::1] view = arr
    cdef size_t i
    for i in range(out.size()):
        view[i] = out[i]
    return arr


# ---- the codec registry (include/hpcdl/codecs/codec_spec.hpp, codec_registry.hpp) ----

def codec_config(text):
    """The settings of a codec text as hpcdl.compression's get_config() spells them;
    ValueError naming the setting when the core's rules reject it."""
    cdef CCodecSpec spec
    check_status(parse_codec(text.encode(), &spec))
    config = {"name": codec_name(spec.kind).decode()}
    if spec.kind == CCodecKind.kInt8:
        config.update(block=spec.block, rounding="stochastic" if spec.stochastic else "nearest", seed=spec.seed)
    elif spec.kind == CCodecKind.kTopK:
        config.update(ratio=spec.ratio, algorithm=topk_algorithm_name(spec.topk_algorithm).decode(),
                      reuse_steps=spec.topk_reuse_steps)
    return config


def topk_count(size_t count, double ratio):
    """How many values top-k keeps of `count`: max(1, ceil(ratio * count)), at most count (0 of 0)."""
    return c_topk_count(count, ratio)


def topk_algorithm_run(text, int ranks, size_t count):
    """"split" or "allgather": what a top-k allreduce (codec text) of `count` float32 values over
    `ranks` ranks runs; for algorithm=auto, the choice of docs/compression.md's model."""
    cdef CCodecSpec spec
    check_status(parse_codec(text.encode(), &spec))
    if spec.kind != CCodecKind.kTopK:
        raise ValueError(f"not a top-k codec: {text!r}")
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    split = topk_use_split(spec.topk_algorithm, ranks, count, c_topk_count(count, spec.ratio))
    return "split" if split else "allgather"


# ---- codec kernels on one whole array (hpcdl.compression's Codec.encode_into/decode_into) ----

cdef Buffer _float32(obj, bint writable):
    cdef Buffer b = Buffer(obj, None, writable)
    if b.dtype != "float32":
        raise TypeError(f"codec kernels take float32 arrays, got {b.dtype}")
    return b


def codec_encoded_size(codec, size_t count):
    """Bytes that `count` float32 values take on the wire under `codec` (canonical text)."""
    cdef size_t out = 0
    cdef string text = codec.encode()
    check_status(codec_encoded_bytes(text, count, &out))
    return out


def codec_encode_into(codec, values, out, err=None, uint64_t stream=0):
    """Encode float32 `values` into the uint8 array `out` (codec_encoded_size bytes);
    `err`, if given (float32, same length), receives values - decode(encoded)."""
    cdef Buffer src = _float32(values, False)
    cdef string text = codec.encode()
    cdef size_t need = codec_encoded_size(codec, src.count)
    cdef Buffer e = None
    cdef float* err_ptr = NULL
    cdef uint8_t[::1] out_view = out
    cdef CStatus st
    if <size_t>out_view.shape[0] != need:
        raise ValueError(f"out has {out_view.shape[0]} bytes, the encoding needs {need}")
    if err is not None:
        e = _float32(err, True)
        if e.count != src.count:
            raise ValueError("err must have as many values as values")
        err_ptr = <float*>e.ptr()
    cdef const float* src_ptr = <const float*>src.ptr()
    cdef size_t count = src.count
    cdef uint8_t* out_ptr = &out_view[0] if need else NULL
    with nogil:
        st = codec_encode(text, src_ptr, count, out_ptr, err_ptr, stream)
    check_status(st)


def codec_decode_into(codec, encoded, out):
    """Decode the uint8 array `encoded` into the float32 array `out` (the original length)."""
    cdef Buffer dst = _float32(out, True)
    cdef string text = codec.encode()
    cdef size_t need = codec_encoded_size(codec, dst.count)
    cdef const uint8_t[::1] in_view = encoded
    cdef CStatus st
    if <size_t>in_view.shape[0] != need:
        raise ValueError(f"encoded has {in_view.shape[0]} bytes, {dst.count} values need {need}")
    cdef const uint8_t* in_ptr = &in_view[0] if need else NULL
    cdef float* dst_ptr = <float*>dst.ptr()
    cdef size_t count = dst.count
    with nogil:
        st = codec_decode(text, in_ptr, count, dst_ptr)
    check_status(st)


def topk_contribution(codec, values, residual, threshold=None):
    """One rank's top-k pairs of x = values + residual for a named tensor, as the
    engine selects them under `codec` (canonical text; threshold reuse if it says
    so), unscaled: (indices uint32, values float32, threshold). The float32
    `residual` is updated in place to x without the pairs (NaN and Inf as 0);
    `threshold` is the tensor's state from the last call, (magnitude bits, k,
    uses left) or None for a new tensor."""
    cdef Buffer src = _float32(values, False)
    cdef Buffer res = _float32(residual, True)
    if res.count != src.count:
        raise ValueError("residual must have as many values as values")
    cdef string text = codec.encode()
    cdef CTopkThreshold state
    if threshold is not None:
        state.magnitude, state.k, state.uses_left = threshold
    import numpy
    cdef size_t room = topk_reuse_cap(c_topk_count(src.count, codec_config(codec).get("ratio", 1.0)))
    idx = numpy.empty(room, numpy.uint32)
    val = numpy.empty(room, numpy.float32)
    cdef uint32_t[::1] idx_view = idx
    cdef float[::1] val_view = val
    cdef size_t count = 0
    cdef CStatus st
    cdef const float* src_ptr = <const float*>src.ptr()
    cdef float* res_ptr = <float*>res.ptr()
    cdef uint32_t* idx_ptr = &idx_view[0] if room else NULL
    cdef float* val_ptr = &val_view[0] if room else NULL
    cdef size_t n = src.count
    with nogil:
        st = topk_contribution_array(text, src_ptr, n, res_ptr, &state, idx_ptr, val_ptr, &count)
    check_status(st)
    return idx[:count], val[:count], (state.magnitude, state.k, state.uses_left)


def shutdown():
    with nogil:
        CEngine.instance().shutdown()
    _emit_engine_notices()  # the last ones, while Python can still issue them



# ---- the process MPI belongs to (include/hpcdl/util/mpi_process.hpp) ----

remember_mpi_process()  # at load: mpi4py has initialized MPI in this process


def require_mpi_process(who):
    """MPIError naming the cause when this process was forked from the one that
    initialized MPI (`who`: the part about to make MPI calls)."""
    check_status(c_require_mpi_process(who.encode()))


def in_mpi_process():
    """False in a process forked from the one that initialized MPI."""
    return c_in_mpi_process()
