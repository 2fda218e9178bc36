"""HDF5-aggregated small-file store: pack a directory tree of small files into a
few HDF5 shards, then read samples by index with plain positioned reads.

Format (version 1, see docs/store.md): DST/manifest.h5 lists the shards
DST/shard-KKKKK-of-NNNNN.h5; each shard holds one contiguous uint8 data set
``data`` with the sample bytes back to back, and per sample ``offsets``,
``sizes``, ``crc32c``, ``labels`` and ``names``. Samples are ordered by their
relative path (UTF-8 bytes), so the index -> name mapping does not depend on
the number of ranks that packed them.

Reading never calls HDF5 after open: the C++ reader (include/hpcdl/store_reader.hpp)
preads at the data set's file offset, checks the CRC32C and releases the GIL.
"""

import bisect
import errno
import hashlib
import os
import socket
import stat
import sys
import time
import warnings
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
from mpi4py import MPI

from hpcdl import _store
from hpcdl.errors import CorruptDataError, HpcdlError


class StoreWarning(UserWarning):
    """A store opens but lacks a safeguard (e.g. packed by an older hpcdl without index checksums)."""


FORMAT = "hpcdl-store"
FORMAT_VERSION = 2
_FIRST_CHECKED_VERSION = 2  # stores packed before it carry no index checksums
MANIFEST = "manifest.h5"
DEFAULT_SHARD_BYTES = 1 << 30
DEFAULT_THREADS = 8
_SHARD_PREFIX = "shard-"
_TMP_SUFFIX = ".tmp"
_LOCK = ".hpcdl-pack.lock"
_WRITE_BLOCK = 16 << 20     # bytes gathered before one HDF5 write
_READ_WINDOW = 256          # files in flight per packing rank
_PROGRESS_TAG = 4242

PackResult = namedtuple("PackResult", "samples bytes shards skipped reused_shards seconds")
PackResult.__doc__ = """What pack() did: skipped is a list of (path, reason) of files left out."""

VerifyReport = namedtuple("VerifyReport", "samples bytes_read seconds problems damaged")
VerifyReport.__doc__ = """Result of Store.verify(): problems is a list of (index, name, reason) of bad
samples in readable shards; damaged a list of (shard path, first sample, samples, reason) of shards
that could not be opened (each reported once, all its samples lost)."""


def crc32c(data, crc=0):
    """CRC32C of a bytes-like object (the checksum the store keeps per sample)."""
    return _store.crc32c(data, crc)


def _index_crc(values):
    """CRC32C of an index data set's contents: numbers as their little-endian
    bytes; strings as their UTF-8 bytes after the list of their lengths (so a
    byte moved between two names changes it)."""
    values = np.asarray(values)
    if values.dtype.kind in "OSU":
        parts = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values.ravel()]
        lengths = np.array([len(p) for p in parts], dtype="<u8")
        return _store.crc32c(b"".join(parts), _store.crc32c(lengths.tobytes()))
    return _store.crc32c(np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).tobytes())


def _create_checked(f, name, values, dtype=None):
    """Write an index data set with the CRC32C of its contents as its attribute `crc32c`."""
    if dtype is not None and h5py.check_string_dtype(dtype):
        values = np.array(list(values), dtype=object)
    f.create_dataset(name, data=values, dtype=dtype).attrs["crc32c"] = np.uint32(_index_crc(values))


def _read_checked(f, name, where, checked=True):
    """An index data set's contents after checking them against its `crc32c`
    attribute (checked=False: a store packed before index checksums).
    Strings come back as UTF-8 bytes."""
    values = f[name][:]
    if checked:
        stored = f[name].attrs.get("crc32c")
        computed = _index_crc(values)
        if stored is None or int(stored) != computed:
            found = "no checksum" if stored is None else f"stored crc32c 0x{int(stored):08x}, read 0x{computed:08x}"
            raise CorruptDataError(f"index data set '{name}' of {where} is damaged ({found})")
    return values


def shard_name(index, count):
    return f"{_SHARD_PREFIX}{index:05d}-of-{count:05d}.h5"


def _log(rank, message):
    print(f"[hpcdl rank {rank}] {message}", file=sys.stderr, flush=True)


def _display(rel):
    """A relative path (bytes) for messages, even when it is not valid UTF-8."""
    return rel.decode("utf-8", "backslashreplace")


def _agree(comm, fn, *args):
    """Run fn on every rank; if any rank raised, raise on every rank (never a hang)."""
    try:
        result, error = fn(*args), None
    except Exception as exc:  # noqa: BLE001 - re-raised below on every rank
        result, error = None, exc
    errors = comm.allgather(None if error is None else (type(error), str(error)))
    if error is not None:
        raise error
    for rank, info in enumerate(errors):
        if info is not None:
            kind, message = info
            try:
                exc = kind(f"[hpcdl rank {rank}] {message}")
            except Exception:  # noqa: BLE001 - a type that takes other arguments
                exc = HpcdlError(f"[hpcdl rank {rank}] {kind.__name__}: {message}")
            raise exc
    return result


# --------------------------------------------------------------------------- listing

def _list_source(src, exclude, progress):
    """Regular files under src as sorted [(relpath bytes, size, mtime_ns)] and the
    skipped entries as [(display path, reason)]. Follows symlinks; a directory
    reached twice (a symlink loop or a second link to it) is listed once."""
    root = os.fsencode(src)
    files, skipped = [], []
    root_st = os.stat(root)
    visited = {(root_st.st_dev, root_st.st_ino)} | set(exclude)
    stack = [b""]
    bar = _bar(progress, desc="[hpcdl rank 0] listing", unit=" files")
    while stack:
        rel_dir = stack.pop()
        try:
            with os.scandir(os.path.join(root, rel_dir) if rel_dir else root) as it:
                entries = list(it)
        except OSError as exc:
            skipped.append((_display(rel_dir), f"cannot list directory: {exc.strerror}"))
            continue
        for entry in entries:
            rel = os.path.join(rel_dir, entry.name) if rel_dir else entry.name
            try:
                entry.name.decode("utf-8")
            except UnicodeDecodeError:
                skipped.append((_display(rel), "name is not valid UTF-8 (rename it)"))
                continue
            try:
                st = os.stat(entry.path)
            except FileNotFoundError:
                reason = "dangling symlink" if entry.is_symlink() else "vanished while listing"
                skipped.append((_display(rel), reason))
                continue
            except OSError as exc:
                reason = "symlink loop" if exc.errno == errno.ELOOP else f"cannot stat: {exc.strerror}"
                skipped.append((_display(rel), reason))
                continue
            if stat.S_ISDIR(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if key in visited:
                    if key not in exclude:
                        skipped.append((_display(rel), "symlink loop (directory already visited)"))
                    continue
                visited.add(key)
                stack.append(rel)
            elif stat.S_ISREG(st.st_mode):
                files.append((rel, st.st_size, st.st_mtime_ns))
                bar.update(1)
            else:
                skipped.append((_display(rel), "not a regular file"))
    bar.close()
    files.sort()
    return files, skipped


def _label_of(rel):
    """ImageFolder convention: the class is the first-level sub-directory."""
    head, sep, _ = rel.partition(b"/")
    return head if sep else None


# --------------------------------------------------------------------------- planning

def _plan(src, files, shards, shard_bytes, nranks):
    """Split the sorted files into contiguous shards of about equal bytes.

    Returns (label_names, shard plans); a plan is a dict with index, count,
    files [(rel, size, mtime_ns, label)] and a digest naming exactly this work.
    """
    classes = sorted({c for c in (_label_of(f[0]) for f in files) if c is not None})
    label_of_class = {c: i for i, c in enumerate(classes)}
    sizes = np.array([f[1] for f in files], dtype=np.uint64)
    total = int(sizes.sum())
    if shards is None:
        shards = max(-(-total // max(int(shard_bytes), 1)), nranks)
    shards = max(1, min(int(shards), len(files)))
    cumulative = np.cumsum(sizes, dtype=np.float64)
    bounds = [0]
    for k in range(1, shards):
        cut = int(np.searchsorted(cumulative, total * k / shards, side="left")) + 1
        bounds.append(min(max(cut, bounds[-1] + 1), len(files) - (shards - k)))
    bounds.append(len(files))
    plans = []
    for k in range(shards):
        work = [(rel, size, mtime, label_of_class.get(_label_of(rel), -1))
                for rel, size, mtime in files[bounds[k]:bounds[k + 1]]]
        digest = hashlib.sha256(repr((FORMAT_VERSION, os.path.abspath(src), k, shards, work)).encode())
        plans.append({"index": k, "count": shards, "files": work, "digest": digest.hexdigest()})
    return [c.decode() for c in classes], plans


class _PackLock:
    """DST/.hpcdl-pack.lock: one pack at a time per destination.

    Created with O_CREAT|O_EXCL (atomic on local file systems, Lustre and NFS
    v3+, and independent of HDF5_USE_FILE_LOCKING and of flock support); it
    holds "host pid start-time". A lock left by a dead process on this host is
    taken over; one from another host is only reported (its liveness cannot be
    checked from here): delete the file when that run is known to be gone.
    """

    def __init__(self, dst):
        if os.path.exists(dst) and not os.path.isdir(dst):
            raise FileExistsError(f"destination '{dst}' exists and is not a directory")
        os.makedirs(dst, exist_ok=True)
        self.path = os.path.join(dst, _LOCK)
        self.token = f"{socket.gethostname()} {os.getpid()} {time.time():.3f}"
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None or not self._take_over_if_dead(holder):
                    raise FileExistsError(self._busy_message(dst, holder)) from None
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(self.token)
            return
        raise FileExistsError(self._busy_message(dst, self._holder()))

    def _holder(self, path=None):
        """(host, pid, started) from a lock file; None when it is gone or not (yet) written."""
        try:
            with open(path or self.path) as fh:
                host, pid, started = fh.read().split()
            return host, int(pid), float(started)
        except (OSError, ValueError):
            return None

    def _take_over_if_dead(self, holder):
        host, pid, _ = holder
        if host != socket.gethostname():
            return False
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            pass
        except PermissionError:  # alive, another user's
            return False
        # Rename first: of two runs taking over the same stale lock only one renames it.
        aside = f"{self.path}.stale-{os.getpid()}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True  # another run took it over: try again
        if self._holder(aside) != holder:  # a live run's lock, made in between: put it back
            os.rename(aside, self.path)
            return False
        os.remove(aside)
        return True

    @staticmethod
    def _busy_message(dst, holder):
        if holder is None:
            return (f"another hpcdl pack is writing to '{dst}' (its lock file {_LOCK} is unreadable); "
                    f"if no pack is running there, delete '{os.path.join(dst, _LOCK)}'")
        host, pid, started = holder
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        return (f"another hpcdl pack is writing to '{dst}': pid {pid} on host {host}, started {since}; wait for "
                f"it to finish, or if it is dead, delete '{os.path.join(dst, _LOCK)}'")

    def release(self):
        if self._is_mine():
            os.remove(self.path)

    def _is_mine(self):
        try:
            with open(self.path) as fh:
                return fh.read() == self.token
        except OSError:
            return False


def _prepare_destination(dst, force):
    """Make dst (locked by this run) ready: new, empty, or an unfinished store to
    continue. Never overwrites a finished store (or foreign files) unless force."""
    names = [n for n in os.listdir(dst) if n != _LOCK]
    ours = [n for n in names if n == MANIFEST or n.startswith(_SHARD_PREFIX)
            or (n.startswith("." + _SHARD_PREFIX) and n.endswith(_TMP_SUFFIX))]
    foreign = sorted(set(names) - set(ours))
    if not force:
        if MANIFEST in names:
            raise FileExistsError(f"destination '{dst}' already holds a packed store; "
                                  "pass --force (force=True) to replace it")
        if foreign:
            raise FileExistsError(f"destination '{dst}' is not empty and is not an hpcdl store "
                                  f"(it holds {foreign[0]!r}...); choose another or pass --force")
    if MANIFEST in names:  # first, so no manifest ever lists a shard being replaced
        os.remove(os.path.join(dst, MANIFEST))
    for n in ours:
        if n != MANIFEST and (force or n.endswith(_TMP_SUFFIX)):
            os.remove(os.path.join(dst, n))


def _remove_stale_shards(dst, plans):
    wanted = {shard_name(p["index"], p["count"]) for p in plans}
    for n in os.listdir(dst):
        if n.startswith(_SHARD_PREFIX) and n not in wanted:
            os.remove(os.path.join(dst, n))


# --------------------------------------------------------------------------- writing

def _read_file(root, rel, planned_size):
    """(bytes, crc, None) or (None, None, reason)."""
    try:
        with open(os.path.join(root, rel), "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        return None, None, "vanished before it was read"
    except PermissionError:
        return None, None, "unreadable (permission denied)"
    except OSError as exc:
        reason = "symlink loop" if exc.errno == errno.ELOOP else f"unreadable: {exc.strerror or exc}"
        return None, None, reason
    if len(data) != planned_size:
        return None, None, f"changed while packing ({planned_size} bytes when listed, {len(data)} when read)"
    return data, _store.crc32c(data), None


def _reuse_shard(path, plan):
    """The summary of an already written shard for exactly this plan, else None."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            if f.attrs.get("plan_digest") != plan["digest"] or not f.attrs.get("complete"):
                return None
            return {"index": plan["index"], "samples": int(f.attrs["num_samples"]),
                    "bytes": int(f.attrs["data_bytes_used"]), "reused": True,
                    "skipped": [(n.decode(), r.decode()) for n, r in
                                zip(_read_checked(f, "skipped_names", "the shard"),
                                    _read_checked(f, "skipped_reasons", "the shard"))]}
    except (OSError, KeyError, ValueError, CorruptDataError):
        return None


def _fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_shard(src, dst, plan, pool, progress):
    """Write one shard under a temporary name, then rename it into place."""
    name = shard_name(plan["index"], plan["count"])
    final = os.path.join(dst, name)
    if os.path.exists(final):
        summary = _reuse_shard(final, plan)
        if summary is not None:
            progress.advance(len(plan["files"]), sum(f[1] for f in plan["files"]))
            return summary
        os.remove(final)
    tmp = os.path.join(dst, "." + name + _TMP_SUFFIX)
    root = os.fsencode(src)
    files = plan["files"]
    planned = sum(f[1] for f in files)
    offsets, sizes, crcs, labels, names, skipped = [], [], [], [], [], []
    with h5py.File(tmp, "w") as f:
        # Contiguous, unchunked, unfiltered: the reader preads at its file offset.
        data = f.create_dataset("data", shape=(planned,), dtype=np.uint8)
        pending, start, at = [], 0, 0
        for w in range(0, len(files), _READ_WINDOW):
            window = files[w:w + _READ_WINDOW]
            results = pool.map(lambda item: _read_file(root, item[0], item[1]), window)
            for (rel, size, _, label), (content, crc, reason) in zip(window, results):
                if reason is not None:
                    skipped.append((_display(rel), reason))
                else:
                    offsets.append(at)
                    sizes.append(len(content))
                    crcs.append(crc)
                    labels.append(label)
                    names.append(rel.decode("utf-8"))
                    pending.append(content)
                    at += len(content)
                    if at - start >= _WRITE_BLOCK:
                        data[start:at] = np.frombuffer(b"".join(pending), dtype=np.uint8)
                        pending, start = [], at
                progress.advance(1, size)
        if at > start:
            data[start:at] = np.frombuffer(b"".join(pending), dtype=np.uint8)
        _create_checked(f, "offsets", np.array(offsets, dtype=np.uint64))
        _create_checked(f, "sizes", np.array(sizes, dtype=np.uint64))
        _create_checked(f, "crc32c", np.array(crcs, dtype=np.uint32))
        _create_checked(f, "labels", np.array(labels, dtype=np.int32))
        text = h5py.string_dtype("utf-8")
        _create_checked(f, "names", names, text)
        _create_checked(f, "skipped_names", [s[0] for s in skipped], text)
        _create_checked(f, "skipped_reasons", [s[1] for s in skipped], text)
        f.attrs.update({"format": FORMAT + "-shard", "format_version": FORMAT_VERSION,
                        "shard_index": plan["index"], "num_shards": plan["count"],
                        "num_samples": len(offsets), "data_bytes_used": at,
                        "checksum": "crc32c", "plan_digest": plan["digest"], "complete": 1})
    _fsync_path(tmp)
    os.replace(tmp, final)
    _fsync_path(dst, directory=True)
    return {"index": plan["index"], "samples": len(offsets), "bytes": at, "reused": False,
            "skipped": skipped}


def _write_manifest(src, dst, label_names, summaries, skipped_listing, pack_seconds):
    summaries = sorted(summaries, key=lambda s: s["index"])
    counts = np.array([s["samples"] for s in summaries], dtype=np.uint64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.uint64)
    skipped = list(skipped_listing) + [x for s in summaries for x in s["skipped"]]
    text = h5py.string_dtype("utf-8")
    path = os.path.join(dst, MANIFEST)
    tmp = os.path.join(dst, "." + MANIFEST + _TMP_SUFFIX)
    with h5py.File(tmp, "w") as f:
        n = len(summaries)
        _create_checked(f, "shard_files", [shard_name(s["index"], n) for s in summaries], text)
        _create_checked(f, "shard_first_sample", first)
        _create_checked(f, "shard_num_samples", counts)
        _create_checked(f, "shard_data_bytes", np.array([s["bytes"] for s in summaries], dtype=np.uint64))
        _create_checked(f, "label_names", label_names, text)
        _create_checked(f, "skipped_names", [s[0] for s in skipped], text)
        _create_checked(f, "skipped_reasons", [s[1] for s in skipped], text)
        f.attrs.update({"format": FORMAT, "format_version": FORMAT_VERSION,
                        "num_samples": int(counts.sum()),
                        "total_bytes": int(sum(s["bytes"] for s in summaries)),
                        "num_shards": n, "checksum": "crc32c", "source": os.path.abspath(src),
                        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "pack_seconds": pack_seconds})
    _fsync_path(tmp)
    os.replace(tmp, path)
    _fsync_path(dst, directory=True)
    return skipped


def _bar(enabled, **kwargs):
    from tqdm import tqdm

    return tqdm(disable=not enabled, mininterval=0.5, **kwargs)


class _Progress:
    """Packing progress of every rank on one tqdm bar on rank 0 (files/s, MB/s).

    Other ranks send (files, bytes) increments at most twice a second on their
    own communicator; rank 0 collects them whenever it reports its own work.
    """

    def __init__(self, comm, total_files, total_bytes, enabled):
        self.comm, self.rank = comm, comm.Get_rank()
        self.files = self.bytes = 0
        self.unsent = [0, 0]
        self.last_send = time.monotonic()
        self.requests = []
        self.start = time.monotonic()
        self.total_files = total_files
        self.finished_ranks = 0
        self.bar = _bar(enabled and self.rank == 0, total=total_bytes, unit="B", unit_scale=True,
                        desc="[hpcdl rank 0] packing") if self.rank == 0 else None

    def advance(self, files, nbytes):
        if self.rank == 0:
            self._show(files, nbytes)
            self._collect(block=False)
            return
        self.unsent[0] += files
        self.unsent[1] += nbytes
        if time.monotonic() - self.last_send > 0.5:
            self._send(done=False)

    def _send(self, done):
        self.requests.append(self.comm.isend((self.unsent[0], self.unsent[1], done), 0, _PROGRESS_TAG))
        self.unsent = [0, 0]
        self.last_send = time.monotonic()

    def _show(self, files, nbytes):
        self.files += files
        self.bytes += nbytes
        self.bar.update(nbytes)
        rate = self.files / max(time.monotonic() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.files}/{self.total_files} files, {rate:.0f} files/s", refresh=False)

    def _collect(self, block):
        """Show the reports that arrived; with block, wait until every rank said done."""
        nranks = self.comm.Get_size()
        while (block and self.finished_ranks < nranks - 1) or self.comm.iprobe(MPI.ANY_SOURCE, _PROGRESS_TAG):
            files, nbytes, done = self.comm.recv(source=MPI.ANY_SOURCE, tag=_PROGRESS_TAG)
            self._show(files, nbytes)
            self.finished_ranks += done

    def finish(self):
        """Collective: rank 0 waits for every rank's last report."""
        if self.rank == 0:
            self._collect(block=True)
            self.bar.close()
        else:
            self._send(done=True)
            MPI.Request.Waitall(self.requests)


def pack(src_dir, dst, shards=None, shard_bytes=DEFAULT_SHARD_BYTES, comm=None, force=False,
         progress=True, threads=DEFAULT_THREADS):
    """Pack every regular file under ``src_dir`` into an hpcdl store in directory ``dst``.

    Collective over ``comm`` (default ``MPI.COMM_WORLD``): rank 0 lists the
    files, each rank writes its share of the shards, rank 0 writes the
    manifest last. shards: number of shards (default: total bytes /
    shard_bytes, at least one per rank). threads: files read at once per rank.

    Files that cannot be packed (unreadable, vanished, symlink loops, names
    that are not valid UTF-8, changed while packing) are skipped and reported:
    they are listed in the result and in the manifest. Zero-byte files are
    packed as empty samples. An empty source raises ValueError.

    Crash safety: shards are written under a temporary name and renamed when
    complete; the manifest comes last. Re-running after a crash reuses the
    complete shards of the same plan and redoes the rest. An existing store
    (or a non-empty foreign directory) is only replaced with ``force=True``.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, nranks = comm.Get_rank(), comm.Get_size()
    src_dir, dst = os.fspath(src_dir), os.fspath(dst)
    started = time.monotonic()
    locks = []  # rank 0's lock on dst, held until the store reads back

    def plan_on_rank0():
        if rank != 0:
            return None
        if not os.path.isdir(src_dir):
            raise FileNotFoundError(f"source '{src_dir}' is not a directory")
        locks.append(_PackLock(dst))
        _prepare_destination(dst, force)
        dst_st = os.stat(dst)
        files, skipped = _list_source(src_dir, {(dst_st.st_dev, dst_st.st_ino)}, progress)
        if not files:
            detail = f" ({len(skipped)} entries skipped, e.g. {skipped[0][0]!r}: {skipped[0][1]})" if skipped else ""
            raise ValueError(f"source '{src_dir}' holds no files to pack{detail}")
        label_names, plans = _plan(src_dir, files, shards, shard_bytes, nranks)
        _remove_stale_shards(dst, plans)
        return label_names, plans, skipped, sum(f[1] for f in files)

    try:
        planned = _agree(comm, plan_on_rank0)
        label_names, plans, skipped_listing, total_bytes = comm.bcast(planned, root=0)
        mine = [p for p in plans if p["index"] % nranks == rank]
        total_files = sum(len(p["files"]) for p in plans)

        progress_comm = comm.Dup()
        reporter = _Progress(progress_comm, total_files, total_bytes, progress)

        def write_mine():
            with ThreadPoolExecutor(max(1, threads)) as pool:
                return [_write_shard(src_dir, dst, p, pool, reporter) for p in mine]

        try:
            summaries, error = write_mine(), None
        except Exception as exc:  # noqa: BLE001 - raised below on every rank
            summaries, error = None, exc
        finally:
            reporter.finish()
            progress_comm.Free()

        def reraise_local():
            if error is not None:
                raise error
            return summaries

        summaries = _agree(comm, reraise_local)
        gathered = comm.gather(summaries, root=0)

        def manifest_on_rank0():
            if rank != 0:
                return None
            every = [s for part in gathered for s in part]
            skipped = _write_manifest(src_dir, dst, label_names, every, skipped_listing,
                                      time.monotonic() - started)
            Store(dst).close()  # no success reported over a store that does not open (index checked)
            return PackResult(samples=sum(s["samples"] for s in every), bytes=sum(s["bytes"] for s in every),
                              shards=len(every), skipped=skipped,
                              reused_shards=sum(s["reused"] for s in every),
                              seconds=time.monotonic() - started)

        result = _agree(comm, manifest_on_rank0)
        return comm.bcast(result, root=0)
    finally:
        for lock in locks:
            lock.release()


# --------------------------------------------------------------------------- reading

class _Names:
    """Sample names (relative paths) as a read-only sequence, kept as one UTF-8
    blob plus offsets rather than a Python string per sample."""

    def __init__(self, blob, offsets):
        self._blob, self._offsets = blob, offsets

    def __len__(self):
        return len(self._offsets) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"name index {i} out of range [0, {n})")
        return self._blob[self._offsets[i]:self._offsets[i + 1]].decode("utf-8")

    def raw(self, i):
        return self._blob[self._offsets[i]:self._offsets[i + 1]]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        return f"<hpcdl store names: {len(self)}>"


class _Raw:
    """A sequence view of names as UTF-8 bytes over [lo, hi), for bisect."""

    def __init__(self, names, lo, hi):
        self.names, self.lo, self.hi = names, lo, hi

    def __len__(self):
        return self.hi - self.lo

    def __getitem__(self, k):
        return self.names.raw(self.lo + k)


def _manifest_path(path):
    path = os.fspath(path)
    return os.path.join(path, MANIFEST) if os.path.isdir(path) else path


class Store:
    """A packed store, opened once: ``len(store)``, ``store[i]`` (bytes),
    ``read_many(indices)``, ``names``, ``labels``, ``label_map``, ``verify()``,
    ``index_of(name)``.

    Opening reads the manifest and each shard's index with h5py, then closes
    them: reads go through the C++ reader (pread, checksum checked, GIL
    released). A Store may be opened before DataLoader workers fork; its
    thread pool is remade in each child. threads: read_many() parallelism.
    allow_damaged: open even when some shards cannot be read (their samples
    raise CorruptDataError); verify() reports them.
    """

    def __init__(self, path, threads=DEFAULT_THREADS, verify_checksums=True, allow_damaged=False):
        self.path = _manifest_path(path)
        self.root = os.path.dirname(os.path.abspath(self.path))
        self._args = (path, threads, verify_checksums, allow_damaged)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"no hpcdl store at '{path}' (missing {MANIFEST}: not packed, "
                                    "or the packing did not finish)")
        try:
            with h5py.File(self.path, "r", locking=False) as m:
                if m.attrs.get("format") != FORMAT:
                    raise CorruptDataError(f"'{self.path}' is not an hpcdl store manifest")
                version = int(m.attrs["format_version"])
                if version > FORMAT_VERSION:
                    raise HpcdlError(f"store '{self.path}' has format version {version}; this hpcdl "
                                     f"reads up to {FORMAT_VERSION}: upgrade hpcdl")
                self._checked = version >= _FIRST_CHECKED_VERSION

                def read(name):
                    return _read_checked(m, name, f"manifest '{self.path}'", self._checked)

                def text(name):
                    return [v.decode("utf-8") for v in read(name)]

                shard_files = text("shard_files")
                first = read("shard_first_sample").astype(np.int64)
                counts = read("shard_num_samples").astype(np.int64)
                self.shard_data_bytes = read("shard_data_bytes").astype(np.int64)
                self.classes = text("label_names")
                self.skipped = list(zip(text("skipped_names"), text("skipped_reasons")))
                self.attrs = dict(m.attrs)
        except (OSError, KeyError, ValueError) as exc:
            raise CorruptDataError(f"cannot read the manifest '{self.path}': {exc}") from None
        if not self._checked:
            warnings.warn(f"store '{self.root}' was packed by an older hpcdl (format version {version}) "
                          "without index checksums: damaged labels, names or offsets cannot be detected; "
                          "re-pack it", StoreWarning, stacklevel=2)
        self.shard_paths = [os.path.join(self.root, f) for f in shard_files]
        self.shard_first = first
        self.shard_counts = counts
        infos, labels, name_parts, self.damaged = [], [], [], []
        for k, path_k in enumerate(self.shard_paths):
            try:
                info, shard_labels, shard_names = self._open_shard(path_k, int(counts[k]), self._checked)
            except (OSError, KeyError, ValueError, CorruptDataError) as exc:
                last = int(first[k] + counts[k]) - 1
                reason = (f"shard '{path_k}' cannot be used ({exc}); samples {first[k]}..{last} "
                          "are lost: the file is truncated or damaged, re-pack the store")
                if not allow_damaged:
                    raise CorruptDataError(reason) from None
                self.damaged.append((k, reason))
                info = {"path": path_k, "damaged": reason, "count": int(counts[k])}
                shard_labels = np.full(int(counts[k]), -1, dtype=np.int32)
                shard_names = [b""] * int(counts[k])
            infos.append(info)
            labels.append(shard_labels)
            name_parts.extend(shard_names)
        self.labels = np.concatenate(labels) if labels else np.zeros(0, np.int32)
        lengths = np.fromiter((len(n) for n in name_parts), dtype=np.int64, count=len(name_parts))
        self.names = _Names(b"".join(name_parts), np.concatenate([[0], np.cumsum(lengths)]))
        del name_parts
        self.shard_infos = infos  # kept: the prefetcher opens its own reader over the same shards
        self._reader = _store.Reader(infos, threads, verify_checksums)
        self.sizes = np.concatenate([i["sizes"] if "sizes" in i else np.zeros(i["count"], np.uint64)
                                     for i in infos]) if infos else np.zeros(0, np.uint64)

    @staticmethod
    def _open_shard(path, expected, checked):
        def read(name):
            return _read_checked(f, name, "the shard", checked)

        with h5py.File(path, "r", locking=False) as f:
            if not f.attrs.get("complete") or int(f.attrs["num_samples"]) != expected:
                raise CorruptDataError(f"it holds {f.attrs.get('num_samples')} samples, "
                                       f"the manifest says {expected}")
            data = f["data"]
            if data.chunks is not None or data.compression or data.dtype != np.uint8 or data.ndim != 1:
                raise CorruptDataError("its data set is not a contiguous, unfiltered 1-D uint8 array")
            offset = data.id.get_offset()  # None when the data set is empty (never allocated)
            info = {"path": path, "data_offset": 0 if offset is None else offset,
                    "data_bytes": data.shape[0], "offsets": read("offsets"),
                    "sizes": read("sizes"), "crc32c": read("crc32c")}
            return info, read("labels").astype(np.int32), list(read("names"))

    def __reduce__(self):
        return Store, self._args

    def __len__(self):
        return len(self._reader)

    def _index(self, i):
        i = int(i)
        n = len(self._reader)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample index {i} out of range [0, {n})")
        return i

    def _named(self, exc):
        """Add the sample's name to a reader error."""
        sample = getattr(exc, "sample", None)
        if sample is not None and sample < len(self.names) and self.names.raw(sample):
            exc.args = (f"{exc.args[0]}; name '{self.names[sample]}'",) + exc.args[1:]
        return exc

    def __getitem__(self, i):
        """Sample i as bytes (a copy); see read_into() and read_many() for zero-copy reads."""
        return self.read(i)

    def read(self, i):
        i = self._index(i)
        try:
            return self._reader.read(i)
        except (CorruptDataError, OSError) as exc:
            raise self._named(exc) from None

    def read_into(self, i, buffer):
        """Read sample i into the start of a writable buffer (numpy uint8, bytearray); returns its size."""
        i = self._index(i)
        try:
            return self._reader.read_into(i, buffer)
        except (CorruptDataError, OSError) as exc:
            raise self._named(exc) from None

    def size(self, i):
        return int(self.sizes[self._index(i)])

    def read_many(self, indices, out=None):
        """Read many samples at once on the reader's threads into one uint8 buffer.

        Returns (data, offsets): sample k is data[offsets[k]:offsets[k + 1]].
        out: an optional preallocated uint8 array of at least the total size.
        """
        idx = np.asarray(indices, dtype=np.int64).ravel()
        n = len(self._reader)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            bad = idx[(idx < -n) | (idx >= n)][0]
            raise IndexError(f"sample index {bad} out of range [0, {n})")
        idx = np.where(idx < 0, idx + n, idx).astype(np.uint64)
        offsets = np.zeros(idx.size + 1, dtype=np.uint64)
        np.cumsum(self.sizes[idx], out=offsets[1:])
        total = int(offsets[-1])
        if out is None:
            out = np.empty(total, dtype=np.uint8)
        elif out.nbytes < total:
            raise ValueError(f"out holds {out.nbytes} bytes, the samples need {total}")
        try:
            self._reader.read_many(idx, out, offsets[:-1])
        except (CorruptDataError, OSError) as exc:
            raise self._named(exc) from None
        return out[:total], offsets

    @property
    def label_map(self):
        """Class name -> label (ImageFolder's class_to_idx). Files at the top level have label -1."""
        return {c: i for i, c in enumerate(self.classes)}

    def index_of(self, name):
        """Index of the sample with this relative path; KeyError when absent."""
        key = os.fsencode(name) if not isinstance(name, bytes) else name
        for k in range(len(self.shard_paths)):
            lo, hi = int(self.shard_first[k]), int(self.shard_first[k] + self.shard_counts[k])
            raw = _Raw(self.names, lo, hi)
            if hi > lo and raw[0] <= key <= raw[hi - lo - 1]:
                j = bisect.bisect_left(raw, key)
                if j < hi - lo and raw[j] == key:
                    return lo + j
        raise KeyError(f"no sample named {name!r} in the store")

    def verify(self, progress=False):
        """Read every sample front to back and check its CRC32C. Returns a
        VerifyReport; report.problems lists (index, name, reason) and
        report.damaged the shards that could not be opened; both empty when all is well."""
        bar = _bar(progress, total=int(self.sizes.sum()), unit="B", unit_scale=True, desc="verify")
        started = time.monotonic()
        problems, bytes_read = [], 0
        damaged = [(self.shard_paths[k], int(self.shard_first[k]), int(self.shard_counts[k]), reason)
                   for k, reason in self.damaged]
        for k in range(len(self.shard_paths)):
            if "damaged" in self.shard_infos[k]:
                continue
            bad, reasons, nbytes = self._reader.verify_shard(k)
            problems.extend((i, self.names[i], r) for i, r in zip(bad, reasons))
            bytes_read += nbytes
            bar.update(int(self.sizes[self.shard_first[k]:self.shard_first[k] + self.shard_counts[k]].sum()))
        bar.close()
        return VerifyReport(samples=len(self), bytes_read=bytes_read,
                            seconds=time.monotonic() - started, problems=problems, damaged=damaged)

    def close(self):
        self._reader = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<hpcdl.store.Store '{self.root}': {len(self)} samples in {len(self.shard_paths)} shards>"
