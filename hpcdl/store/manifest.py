"""The store's on-disk format: DST/manifest.h5 lists the shards
DST/shard-KKKKK-of-NNNNN.h5; each shard holds one contiguous uint8 data set
``data`` with the sample bytes back to back, and per sample ``offsets``,
``sizes``, ``crc32c``, ``labels`` and ``names``, each index data set with the
CRC32C of its contents as its attribute ``crc32c`` (docs/store.md).
"""

import os
import time

import h5py
import numpy as np

from hpcdl import _core
from hpcdl.errors import CorruptDataError
from hpcdl.store.space import write_small_hdf5

FORMAT = "hpcdl-store"
FORMAT_VERSION = 2
_FIRST_CHECKED_VERSION = 2  # stores packed before it carry no index checksums
MANIFEST = "manifest.h5"
_SHARD_PREFIX = "shard-"
_TMP_SUFFIX = ".tmp"


def crc32c(data, crc=0):
    """CRC32C of a bytes-like object (the checksum the store keeps per sample)."""
    return _core.crc32c(data, crc)


def _index_crc(values):
    """CRC32C of an index data set's contents: numbers as their little-endian
    bytes; strings as their UTF-8 bytes after the list of their lengths (so a
    byte moved between two names changes it)."""
    values = np.asarray(values)
    if values.dtype.kind in "OSU":
        parts = [v if isinstance(v, bytes) else str(v).encode("utf-8") for v in values.ravel()]
        lengths = np.array([len(p) for p in parts], dtype="<u8")
        return _core.crc32c(b"".join(parts), _core.crc32c(lengths.tobytes()))
    return _core.crc32c(np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<")).tobytes())


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


def _manifest_path(path):
    path = os.fspath(path)
    return os.path.join(path, MANIFEST) if os.path.isdir(path) else path


def _fsync_path(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(src, dst, label_names, summaries, skipped_listing, pack_seconds):
    summaries = sorted(summaries, key=lambda s: s["index"])
    counts = np.array([s["samples"] for s in summaries], dtype=np.uint64)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.uint64)
    skipped = list(skipped_listing) + [x for s in summaries for x in s["skipped"]]
    text = h5py.string_dtype("utf-8")
    path = os.path.join(dst, MANIFEST)
    tmp = os.path.join(dst, "." + MANIFEST + _TMP_SUFFIX)

    def fill(f):
        n = len(summaries)
        _create_checked(f, "shard_files", [shard_name(s["index"], n) for s in summaries], text)
        _create_checked(f, "shard_first_sample", first)
        _create_checked(f, "shard_num_samples", counts)
        _create_checked(f, "shard_data_bytes", np.array([s["bytes"] for s in summaries], dtype=np.uint64))
        _create_checked(f, "label_names", label_names, text)
        _create_checked(f, "skipped_names", [s[0] for s in skipped], text)
        _create_checked(f, "skipped_reasons", [s[1] for s in skipped], text)
        f.attrs.update(
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "num_samples": int(counts.sum()),
                "total_bytes": int(sum(s["bytes"] for s in summaries)),
                "num_shards": n,
                "checksum": "crc32c",
                "source": os.path.abspath(src),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "pack_seconds": pack_seconds,
            }
        )

    write_small_hdf5(tmp, "the manifest", fill)
    _fsync_path(tmp)
    os.replace(tmp, path)
    _fsync_path(dst, directory=True)
    return skipped
