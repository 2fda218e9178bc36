"""Ranks agree before they go on: the one place for both ways hpcdl's Python side does it.

call_on_every_rank: a step that may fail on some ranks (rank 0 plans, each rank
validates) raises on every rank, never leaving the others waiting in the next
collective. check_same_on_all_ranks: every rank describes the same model or
settings before any collective on them (the adapters at construction, the
prefetcher's settings); a difference (a parameter on some ranks only, another
shape, dtype or order) raises MismatchError on every rank with the first
differences named, instead of hanging or reducing unrelated bytes.
check_same_identity: every rank holds the same thing (a data set) under a name
that may differ (its path): a different identity raises MismatchError on every
rank naming the ranks of each identity and where each read it.

The waited_* collectives are mpi4py's object and in-place collectives waited on
under hpcdl.configure()'s stall limits (a StallWarning, then a
StallTimeoutError), so a rank that never comes is reported, not waited for ever.
Both checks use them, and so does every collective of hpcdl's Python side
outside the engine (tests/unit/test_architecture.py holds it), but
call_on_every_rank's own allgather, whose wait is one rank's step, long by design,
and the benchmarks' timing barrier (hpcdl.measure.slowest).
Creating and freeing communicators (Split, Create, Dup, Free) stays blocking: MPI
has no nonblocking form of them but Comm_idup.
"""

import hashlib
import io
import pickle

import numpy as np
from mpi4py import MPI

from hpcdl import _core
from hpcdl.collectives import PoliteWait
from hpcdl.errors import HpcdlError, MismatchError

_MAX_LISTED = 5
_MAX_POLL_SLEEP_S = 1e-3  # these agreements run at set-up: a millisecond late is nothing
_REFUSED = -1  # the size a rank sends for an object it could not pickle (or a scatter's wrong parts)
_LONG_BCAST_BYTES = 512 << 10  # MPICH's threshold for its long broadcast (scatter, then allgather)


def waited_allgather(comm, obj, what):
    """comm.allgather(obj), waited on politely under hpcdl.configure()'s stall limits:
    a rank that never comes (stopped, dead, elsewhere) gets a StallWarning and then a
    StallTimeoutError naming ``what``, where mpi4py's allgather would block for ever."""
    payload, refused = _pickled_or_refused(obj)
    sizes = np.zeros(comm.Get_size(), np.int64)
    _wait(comm.Iallgather(_size_of(payload), sizes), comm, what)
    _raise_if_refused(sizes, refused, what)
    blob, displs = _room_for(sizes)
    _wait(comm.Iallgatherv(payload, [blob, (sizes.tolist(), displs.tolist()), MPI.BYTE]), comm, what)
    return [_unpickled(blob, d, n) for d, n in zip(displs, sizes)]


def waited_bcast(comm, obj, root, what):
    """comm.bcast(obj, root) under the stall limits (as waited_allgather): root's obj
    on every rank, the root's own object on the root. From _LONG_BCAST_BYTES on, the
    bytes are scattered in P pieces and then allgathered, as MPI's own long broadcast
    does: MPICH's nonblocking broadcast takes a tree instead, 1.3x slower at 16 MiB
    on the emulated cluster (docs/performance.md, "Set-up collectives")."""
    rank, ranks = comm.Get_rank(), comm.Get_size()
    payload, refused = _pickled_or_refused(obj) if rank == root else (None, None)
    size = _size_of(payload)
    _wait(comm.Ibcast(size, root=root), comm, what)
    _raise_if_refused(np.array([size[0] if r == root else 0 for r in range(ranks)]), refused, what)
    blob = payload if payload is not None else np.empty(int(size[0]), np.uint8)
    if blob.size < _LONG_BCAST_BYTES or ranks == 1:
        _wait(comm.Ibcast(blob, root=root), comm, what)
    else:
        counts = [(blob.size * (r + 1)) // ranks - (blob.size * r) // ranks for r in range(ranks)]
        displs = _offsets(np.array(counts)).tolist()
        pieces = [blob, (counts, displs), MPI.BYTE]
        mine = MPI.IN_PLACE if rank == root else blob[displs[rank] : displs[rank] + counts[rank]]
        _wait(comm.Iscatterv(pieces if rank == root else None, mine, root=root), comm, what)
        _wait(comm.Iallgatherv(MPI.IN_PLACE, pieces), comm, what)
    return obj if rank == root else _unpickled(blob, 0, blob.size)


def waited_gather(comm, obj, root, what):
    """comm.gather(obj, root) under the stall limits: the list of every rank's obj on
    the root, None elsewhere."""
    rank = comm.Get_rank()
    payload, refused = _pickled_or_refused(obj)
    sizes = np.zeros(comm.Get_size(), np.int64)  # every rank's: all raise when one could not pickle
    _wait(comm.Iallgather(_size_of(payload), sizes), comm, what)
    _raise_if_refused(sizes, refused, what)
    if rank != root:
        _wait(comm.Igatherv(payload, None, root=root), comm, what)
        return None
    blob, displs = _room_for(sizes)
    _wait(comm.Igatherv(payload, [blob, (sizes.tolist(), displs.tolist()), MPI.BYTE], root=root), comm, what)
    return [_unpickled(blob, d, n) for d, n in zip(displs, sizes)]


def waited_scatter(comm, objs, root, what):
    """comm.scatter(objs, root) under the stall limits: objs (one per rank, on the
    root; None elsewhere) [rank] on each rank."""
    parts = sizes = refused = None
    ranks = comm.Get_size()
    if comm.Get_rank() == root:
        if len(objs) != ranks:
            refused = ValueError(f"{what}: {len(objs)} parts for {ranks} ranks")
        pickled = [] if refused else [_pickled_or_refused(o) for o in objs]
        refused = refused or next((error for _, error in pickled if error is not None), None)
        sizes = np.full(ranks, _REFUSED, np.int64)
        if refused is None:
            sizes = np.array([p.size for p, _ in pickled], np.int64)
            parts = [np.concatenate([p for p, _ in pickled]), (sizes.tolist(), _offsets(sizes).tolist()), MPI.BYTE]
    size = np.zeros(1, np.int64)
    _wait(comm.Iscatter(sizes, size, root=root), comm, what)
    _raise_if_refused(np.array([size[0] if r == root else 0 for r in range(ranks)]), refused, what)
    mine = np.empty(int(size[0]), np.uint8)
    _wait(comm.Iscatterv(parts, mine, root=root), comm, what)
    return _unpickled(mine, 0, mine.size)


def waited_barrier(comm, what):
    """comm.Barrier() under the stall limits."""
    _wait(comm.Ibarrier(), comm, what)


def waited_allreduce(comm, array, op, what):
    """comm.Allreduce(MPI.IN_PLACE, array, op) under the stall limits (array: numpy, in place)."""
    _wait(comm.Iallreduce(MPI.IN_PLACE, array, op=op), comm, what)


def _pickled_or_refused(obj):
    """(obj's pickle as a writable uint8 array, None), without a copy of the bytes (a long
    broadcast's root receives into it); (None, the error) where obj cannot be pickled,
    which the collective then sends as the size _REFUSED, so every rank raises."""
    stream = io.BytesIO()
    try:
        pickle.dump(obj, stream, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 - any pickling error is raised on every rank
        return None, error
    return np.frombuffer(stream.getbuffer(), np.uint8), None


def _size_of(payload):
    return np.array([_REFUSED if payload is None else payload.size], np.int64)


def _raise_if_refused(sizes, refused, what):
    """After the sizes: where a rank sent _REFUSED, every rank raises, that rank its own
    error and the others an HpcdlError naming it, instead of waiting for bytes that
    will not come."""
    if refused is not None:
        raise refused
    failed = [r for r, n in enumerate(sizes.tolist()) if n == _REFUSED]
    if failed:
        raise HpcdlError(f"hpcdl: {what}: {describe_ranks(failed)} could not send (see the error there)")


def _room_for(sizes):
    """A receive buffer for pieces of ``sizes`` bytes, and each piece's offset."""
    return np.empty(int(sizes.sum()), np.uint8), _offsets(sizes)


def _offsets(sizes):
    return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)


def _unpickled(blob, start, length):
    return pickle.loads(blob[start : start + length])  # no copy: a state_dict may be gigabytes


def _wait(request, comm, what):
    wait = PoliteWait(_MAX_POLL_SLEEP_S)
    while not request.Test():
        wait.check(
            lambda waited: (
                f"{what} has waited {waited:.1f} s for the {comm.Get_size()} ranks of the communicator: "
                "some rank has not reached it (stopped, dead, or in another step)"
            )
        )
        wait.sleep()


def call_on_every_rank(comm, fn, *args):
    """fn(*args) on every rank; if any rank raised, raise on every rank (the
    raising rank's own exception, the others its type and message with its rank).
    Collective over comm: one allgather of None or (type, message)."""
    _core.require_mpi_process("hpcdl's ranks agreeing")
    try:
        result, error = fn(*args), None
    except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
        result, error = None, exc
    # mpi4py's blocking allgather, not waited_allgather's stall limits: the step may take
    # one rank long by design (rank 0 plans a packing of millions of files).
    errors = comm.allgather(None if error is None else _describe(error))
    if error is not None:
        raise error
    for rank, info in enumerate(errors):
        if info is not None:
            kind, message, code = info
            try:
                # An OSError keeps its errno (ENOSPC, ENOENT: what callers test for).
                exc = (
                    kind(code, f"[hpcdl rank {rank}] {message}")
                    if code is not None
                    else kind(f"[hpcdl rank {rank}] {message}")
                )
            except Exception:  # noqa: BLE001 - a type that takes other arguments
                exc = HpcdlError(f"[hpcdl rank {rank}] {kind.__name__}: {message}")
            raise exc
    return result


def _describe(error):
    """(type, message, errno or None): what the other ranks need to raise the same error."""
    if isinstance(error, OSError) and error.errno is not None and error.strerror:
        return type(error), error.strerror + (f": '{error.filename}'" if error.filename else ""), error.errno
    return type(error), str(error), None


def check_same_on_all_ranks(comm, entries, what, settings=None):
    """Raise MismatchError on every rank unless all ranks pass equal ``entries``.

    entries: a list of (name, shape, dtype) tuples; settings: a dict of options
    that must agree too. Collective over ``comm``: one small allgather of a
    digest, and a second one of the full lists only when the digests differ.
    """
    _core.require_mpi_process("hpcdl's ranks agreeing")
    mine = _description(entries, settings)
    digest = hashlib.sha1(repr(mine).encode()).hexdigest()
    if len(set(waited_allgather(comm, digest, f"the check that {what} agree"))) == 1:
        return
    everyone = waited_allgather(comm, mine, f"the check that {what} agree")
    raise MismatchError(f"{what} differ across ranks: " + "; ".join(_differences(everyone, range(len(everyone)))))


def check_same_through_engine(comm, entries, what, settings, name, allgather):
    """check_same_on_all_ranks through hpcdl's engine, for checks made while training:
    ``allgather(array, comm, name)`` is hpcdl's, in which a rank that has joined
    (hpcdl.join) takes part with no rows, so the ranks still training check among
    themselves where an mpi4py collective would wait for the joined ranks for ever.
    One allgather of a digest and the description's length ("{name}.check"), and a
    second one of the descriptions ("{name}.check.lists") only when the digests differ;
    every rank taking part raises the same MismatchError."""
    mine = _description(entries, settings)
    payload = pickle.dumps((comm.Get_rank(), mine))
    row = hashlib.sha1(repr(mine).encode()).digest() + len(payload).to_bytes(8, "little")
    rows = allgather(np.frombuffer(row, np.uint8).reshape(1, -1).copy(), comm, f"{name}.check")
    if len({bytes(r[:20]) for r in rows}) == 1:
        return
    blob = bytes(allgather(np.frombuffer(payload, np.uint8).copy(), comm, f"{name}.check.lists"))
    described, start = [], 0
    for r in rows:
        length = int.from_bytes(bytes(r[20:]), "little")
        described.append(pickle.loads(blob[start : start + length]))
        start += length
    ranks, everyone = zip(*described)
    raise MismatchError(f"{what} differ across ranks: " + "; ".join(_differences(list(everyone), ranks)))


def _description(entries, settings):
    """What ranks compare: the (name, shape, dtype) entries in plain types, and the settings."""
    return [(str(n), tuple(int(d) for d in s), str(t)) for n, s, t in entries], dict(settings or {})


def check_same_identity(comm, identity, where, what, hint=""):
    """Raise MismatchError on every rank unless all ranks pass an equal ``identity``.

    identity: a short text (a fingerprint); where: this rank's description of
    its copy (its path, its size), named in the message and free to differ;
    hint: what to do, appended to the message. Collective over ``comm``: one
    allgather of the identity, and a second one of ``where`` only when the
    identities differ.
    """
    _core.require_mpi_process("hpcdl's ranks agreeing")
    identities = waited_allgather(comm, str(identity), f"the check that {what} agree")
    if len(set(identities)) == 1:
        return
    wheres = waited_allgather(comm, str(where), f"the check that {what} agree")
    groups = {}  # identity -> its ranks, in order of each identity's first rank
    for rank, ident in enumerate(identities):
        groups.setdefault(ident, []).append(rank)
    parts = []
    for ident, ranks in list(groups.items())[:_MAX_LISTED]:
        places = list(dict.fromkeys(wheres[r] for r in ranks))
        shown = ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else "")
        parts.append(f"{describe_ranks(ranks)} {'has' if len(ranks) == 1 else 'have'} {ident}: {shown}")
    more = len(groups) - _MAX_LISTED
    raise MismatchError(
        f"{what} differ across ranks: "
        + "; ".join(parts)
        + (f"; ... {more} more" if more > 0 else "")
        + (f". {hint}" if hint else "")
    )


def describe_ranks(ranks):
    """'rank 3' or 'ranks 0-2, 5' (sorted ranks, consecutive ones as ranges)."""
    runs = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:_MAX_LISTED])
    more = len(runs) - _MAX_LISTED
    return ("rank " if len(ranks) == 1 else "ranks ") + text + (f" and {more} more ranges" if more > 0 else "")


def _differences(everyone, ranks):
    """Human-readable differences of every rank from the first (the same text on every
    rank); everyone[i] is the description of rank ranks[i]."""
    ref_entries, ref_settings = everyone[0]
    first = ranks[0]
    ref = {name: (shape, dtype) for name, shape, dtype in ref_entries}
    found = []
    for rank, (entries, settings) in zip(ranks[1:], everyone[1:]):
        have = {name: (shape, dtype) for name, shape, dtype in entries}
        before = len(found)
        for key in sorted(set(ref_settings) | set(settings)):
            if ref_settings.get(key) != settings.get(key):
                found.append(
                    f"{key} is {ref_settings.get(key)!r} on rank {first} but {settings.get(key)!r} on rank {rank}"
                )
        missing = [n for n, _, _ in ref_entries if n not in have]
        extra = [n for n, _, _ in entries if n not in ref]
        if missing:
            found.append(f"{_names(missing)} on rank {first} but not on rank {rank}")
        if extra:
            found.append(f"{_names(extra)} on rank {rank} but not on rank {first}")
        for name, (shape, dtype) in ref.items():
            if name in have and have[name] != (shape, dtype):
                other_shape, other_dtype = have[name]
                found.append(
                    f"'{name}' is {dtype}{list(shape)} on rank {first} but {other_dtype}{list(other_shape)} on rank {rank}"
                )
        common_ref = [n for n, _, _ in ref_entries if n in have]
        common = [n for n, _, _ in entries if n in ref]
        if common_ref != common and len(found) == before:
            found.append(
                f"the order differs on rank {rank} (rank {first}: {_names(common_ref)}; rank {rank}: {_names(common)})"
            )
    return found[:_MAX_LISTED] + ([f"... {len(found) - _MAX_LISTED} more"] if len(found) > _MAX_LISTED else [])


def _names(names):
    shown = ", ".join(f"'{n}'" for n in names[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")
