"""Packing a directory tree of small files into a store, on any number of ranks:
rank 0 lists and plans, each rank writes its shards, rank 0 writes the manifest.
Samples are ordered by their relative path (UTF-8 bytes), so the index -> name
mapping does not depend on the number of ranks that packed them.
"""

import errno
import hashlib
import os
import socket
import stat
import time
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor

import h5py
import numpy as np
from mpi4py import MPI

from hpcdl import _core
from hpcdl._agree import call_on_every_rank, waited_bcast, waited_gather
from hpcdl.errors import CorruptDataError
from hpcdl.store.manifest import (
    _SHARD_PREFIX,
    _TMP_SUFFIX,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    _create_checked,
    _fsync_path,
    _read_checked,
    shard_name,
    write_manifest,
)
from hpcdl.store.progress import _bar, _Progress
from hpcdl.store.reader import DEFAULT_THREADS, Store
from hpcdl.store.space import SHARD_OVERHEAD_BYTES, require_space, shard_bytes_needed, write_hdf5
from hpcdl.units import positive_int

DEFAULT_SHARD_BYTES = 1 << 30
_LOCK = ".hpcdl-pack.lock"
_WRITE_BLOCK = 16 << 20  # bytes gathered before one HDF5 write
_READ_WINDOW = 256  # files in flight per packing rank


PackResult = namedtuple("PackResult", "samples bytes shards skipped reused_shards seconds")
PackResult.__doc__ = """What pack() did: skipped is a list of (path, reason) of files left out."""


def _display(rel):
    """A relative path (bytes) for messages, even when it is not valid UTF-8."""
    return rel.decode("utf-8", "backslashreplace")


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
        work = [
            (rel, size, mtime, label_of_class.get(_label_of(rel), -1))
            for rel, size, mtime in files[bounds[k] : bounds[k + 1]]
        ]
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
            return (
                f"another hpcdl pack is writing to '{dst}' (its lock file {_LOCK} is unreadable); "
                f"if no pack is running there, delete '{os.path.join(dst, _LOCK)}'"
            )
        host, pid, started = holder
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        return (
            f"another hpcdl pack is writing to '{dst}': pid {pid} on host {host}, started {since}; wait for "
            f"it to finish, or if it is dead, delete '{os.path.join(dst, _LOCK)}'"
        )

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
    ours = [
        n
        for n in names
        if n == MANIFEST
        or n.startswith(_SHARD_PREFIX)
        or (n.startswith("." + _SHARD_PREFIX) and n.endswith(_TMP_SUFFIX))
    ]
    foreign = sorted(set(names) - set(ours))
    if not force:
        if MANIFEST in names:
            raise FileExistsError(
                f"destination '{dst}' already holds a packed store; pass --force (force=True) to replace it"
            )
        if foreign:
            raise FileExistsError(
                f"destination '{dst}' is not empty and is not an hpcdl store "
                f"(it holds {foreign[0]!r}...); choose another or pass --force"
            )
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
    return data, _core.crc32c(data), None


def _reuse_shard(path, plan):
    """The summary of an already written shard for exactly this plan, else None."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            if f.attrs.get("plan_digest") != plan["digest"] or not f.attrs.get("complete"):
                return None
            return {
                "index": plan["index"],
                "samples": int(f.attrs["num_samples"]),
                "bytes": int(f.attrs["data_bytes_used"]),
                "reused": True,
                "skipped": [
                    (n.decode(), r.decode())
                    for n, r in zip(
                        _read_checked(f, "skipped_names", "the shard"), _read_checked(f, "skipped_reasons", "the shard")
                    )
                ],
            }
    except (OSError, KeyError, ValueError, CorruptDataError):
        return None


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
    summary = write_hdf5(
        tmp, shard_bytes_needed(plan["files"]), f"shard {name}", lambda f: _fill_shard(f, src, plan, pool, progress)
    )
    _fsync_path(tmp)
    os.replace(tmp, final)
    _fsync_path(dst, directory=True)
    return summary


def _fill_shard(f, src, plan, pool, progress):
    """Write plan's files and index into the open HDF5 file f; the shard's summary."""
    root = os.fsencode(src)
    files = plan["files"]
    planned = sum(item[1] for item in files)
    offsets, sizes, crcs, labels, names, skipped = [], [], [], [], [], []
    # Contiguous, unchunked, unfiltered: the reader preads at its file offset.
    data = f.create_dataset("data", shape=(planned,), dtype=np.uint8)
    pending, start, at = [], 0, 0
    for w in range(0, len(files), _READ_WINDOW):
        window = files[w : w + _READ_WINDOW]
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
    f.attrs.update(
        {
            "format": FORMAT + "-shard",
            "format_version": FORMAT_VERSION,
            "shard_index": plan["index"],
            "num_shards": plan["count"],
            "num_samples": len(offsets),
            "data_bytes_used": at,
            "checksum": "crc32c",
            "plan_digest": plan["digest"],
            "complete": 1,
        }
    )
    return {"index": plan["index"], "samples": len(offsets), "bytes": at, "reused": False, "skipped": skipped}


def pack(
    src_dir,
    dst,
    shards=None,
    shard_bytes=DEFAULT_SHARD_BYTES,
    comm=None,
    force=False,
    progress=True,
    threads=DEFAULT_THREADS,
):
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
        positive_int(threads, "threads")  # every rank its own, inside the agreement
        if shards is not None:
            positive_int(shards, "shards")
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
        to_write = [p for p in plans if _reuse_shard(os.path.join(dst, shard_name(p["index"], p["count"])), p) is None]
        require_space(
            dst,
            sum(shard_bytes_needed(p["files"]) for p in to_write) + SHARD_OVERHEAD_BYTES,
            f"packing {sum(len(p['files']) for p in to_write)} files into {len(to_write)} shards",
        )
        return label_names, plans, skipped, sum(f[1] for f in files)

    try:
        planned = call_on_every_rank(comm, plan_on_rank0)
        label_names, plans, skipped_listing, total_bytes = waited_bcast(
            comm, planned, 0, "pack's broadcast of the plan"
        )
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

        summaries = call_on_every_rank(comm, reraise_local)
        gathered = waited_gather(comm, summaries, 0, "pack's gather of the shards written")

        def manifest_on_rank0():
            if rank != 0:
                return None
            every = [s for part in gathered for s in part]
            skipped = write_manifest(src_dir, dst, label_names, every, skipped_listing, time.monotonic() - started)
            Store(dst).close()  # no success reported over a store that does not open (index checked)
            return PackResult(
                samples=sum(s["samples"] for s in every),
                bytes=sum(s["bytes"] for s in every),
                shards=len(every),
                skipped=skipped,
                reused_shards=sum(s["reused"] for s in every),
                seconds=time.monotonic() - started,
            )

        result = call_on_every_rank(comm, manifest_on_rank0)
        return waited_bcast(comm, result, 0, "pack's broadcast of its result")
    finally:
        for lock in locks:
            lock.release()
