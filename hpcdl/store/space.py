"""Room on the destination's file system for a pack: checked before writing
and reserved per shard, so that a full file system ends a pack with one clear
error ("no space left on DST: ...") instead of HDF5 failing half-way through a
file. HDF5 must never meet a full file system: objects it then cannot close
stay open, and it crashes closing them at exit. So a shard's whole size is
reserved before HDF5 writes to it, and small files (the manifest) are built
in memory and written with plain I/O.

free_bytes counts what this process may use: statvfs's f_bavail for other
users, f_bfree for root (ext4's reserved blocks are root's)."""

import ctypes
import ctypes.util
import errno
import io
import os
import traceback

import h5py

# HDF5's own bytes per shard besides the samples: superblock, object headers,
# the index data sets (offsets, sizes, crc32c, labels: 24 bytes a sample) and
# names (counted with their text).
SHARD_OVERHEAD_BYTES = 64 << 10
INDEX_BYTES_PER_SAMPLE = 24 + 16  # the four index entries and a name's heap overhead

_FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def free_bytes(path):
    """Bytes this process may still write on the file system holding ``path``."""
    st = os.statvfs(path)
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def shard_bytes_needed(files):
    """A shard's size on disk for its planned files ((name, size, ...) tuples)."""
    return SHARD_OVERHEAD_BYTES + sum(f[1] + INDEX_BYTES_PER_SAMPLE + len(f[0]) for f in files)


def no_space(path, needed, what, while_writing=False):
    """The OSError (ENOSPC) a pack raises when ``what`` needs more than ``path``'s file system has."""
    how = "ran out of space writing" if while_writing else "needs"
    return OSError(
        errno.ENOSPC, f"no space left on '{path}': {what} {how} {_mb(needed)}; {_mb(free_bytes(path))} free now"
    )


def require_space(path, needed, what):
    """no_space before anything is written when ``what`` needs more than the file system has."""
    if needed > free_bytes(path):
        raise no_space(path, needed, what)


def reserve(path, nbytes, what):
    """Allocate ``nbytes`` for the file at ``path`` without changing its size
    (fallocate, FALLOC_FL_KEEP_SIZE): a full file system fails here, before
    any sample is written. A file system without fallocate is left to the writes."""
    fd = os.open(path, os.O_WRONLY)
    try:
        if _libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE, ctypes.c_int64(0), ctypes.c_int64(nbytes)) != 0:
            err = ctypes.get_errno()
            if err in (errno.ENOSPC, errno.EDQUOT):
                raise no_space(os.path.dirname(path) or ".", nbytes, what, while_writing=True)
    finally:
        os.close(fd)


def write_hdf5(path, needed, what, fill):
    """Create the HDF5 file ``path`` (a temporary name), reserve ``needed`` bytes
    for it, run fill(file) and close it; fill's result. On failure no HDF5
    object of it stays open (HDF5 would close them at exit, on a file it could
    not flush: a crash) and the file is removed; a full file system raises
    no_space naming ``what``."""
    f = h5py.File(path, "w")
    try:
        try:
            reserve(path, needed, what)
        except OSError:
            # A reservation that failed may keep what it allocated: given back,
            # so that closing the (still empty) HDF5 file has room to write.
            os.truncate(path, 0)
            raise
        result = fill(f)
        f.close()
        os.truncate(path, os.path.getsize(path))  # gives back what reserve() allocated past the end
        return result
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # fill's data set handles go with its frames
        _close_quietly(f)
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        if is_out_of_space(exc):
            raise no_space(os.path.dirname(path) or ".", needed, what, while_writing=True) from None
        raise


def write_small_hdf5(path, what, fill):
    """Build an HDF5 file in memory with fill(file), then write it to ``path``
    (a temporary name) with plain I/O: a full file system is a plain OSError
    here (no_space naming ``what``, the file removed), never HDF5's."""
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        fill(f)
    data = buffer.getbuffer()
    try:
        with open(path, "wb") as out:
            out.write(data)
    except OSError as exc:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        if is_out_of_space(exc):
            raise no_space(os.path.dirname(path) or ".", len(data), what, while_writing=True) from None
        raise


def _close_quietly(f):
    """Close an HDF5 file whose writes failed, with every object still open in it."""
    for _ in range(2):  # a close that failed flushing has closed its objects; the second closes the file
        try:
            f.close()
        except Exception:  # noqa: BLE001 - the write's own error is what is reported
            pass
    if f.id.valid:
        for obj in h5py.h5f.get_obj_ids(f.id, h5py.h5f.OBJ_ALL):
            while obj.valid:
                h5py.h5i.dec_ref(obj)


def is_out_of_space(exc):
    """An error from a write (OSError, or h5py's RuntimeError text) that means the file system is full."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc).lower()
    return "no space left" in text or "disk quota exceeded" in text


def _mb(n):
    return f"{n / 1e6:.1f} MB"
