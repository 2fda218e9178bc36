"""Reading a packed store: open it once, then read samples by index with plain
positioned reads. Reading never calls HDF5 after open: the C++ reader
(include/hpcdl/store/store_reader.hpp) preads at the data set's file offset, checks
the CRC32C and releases the GIL.
"""

import bisect
import hashlib
import os
import time
from collections import namedtuple

import h5py
import numpy as np

from hpcdl import _core
from hpcdl._warn import warn
from hpcdl.errors import CorruptDataError, HpcdlError
from hpcdl.store.manifest import _FIRST_CHECKED_VERSION, FORMAT, FORMAT_VERSION, MANIFEST, _manifest_path, _read_checked
from hpcdl.store.progress import _bar

DEFAULT_THREADS = _core.DEFAULT_READER_THREADS


class StoreWarning(UserWarning):
    """A store opens but lacks a safeguard (e.g. packed by an older hpcdl without index checksums)."""


VerifyReport = namedtuple("VerifyReport", "samples bytes_read seconds problems damaged")
VerifyReport.__doc__ = """Result of Store.verify(): problems is a list of (index, name, reason) of bad
samples in readable shards; damaged a list of (shard path, first sample, samples, reason) of shards
that could not be opened (each reported once, all its samples lost)."""


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
        return self._blob[self._offsets[i] : self._offsets[i + 1]].decode("utf-8")

    def raw(self, i):
        return self._blob[self._offsets[i] : self._offsets[i + 1]]

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


class Store:
    """A packed store, opened once: ``len(store)``, ``store[i]`` (bytes),
    ``read_many(indices)``, ``names``, ``labels``, ``label_map``, ``verify()``,
    ``index_of(name)``, ``fingerprint()``.

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
            raise FileNotFoundError(
                f"no hpcdl store at '{path}' (missing {MANIFEST}: not packed, or the packing did not finish)"
            )
        try:
            with h5py.File(self.path, "r", locking=False) as m:
                if m.attrs.get("format") != FORMAT:
                    raise CorruptDataError(f"'{self.path}' is not an hpcdl store manifest")
                version = int(m.attrs["format_version"])
                if version > FORMAT_VERSION:
                    raise HpcdlError(
                        f"store '{self.path}' has format version {version}; this hpcdl "
                        f"reads up to {FORMAT_VERSION}: upgrade hpcdl"
                    )
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
            warn(
                f"store '{self.root}' was packed by an older hpcdl (format version {version}) "
                "without index checksums: damaged labels, names or offsets cannot be detected; "
                "re-pack it",
                StoreWarning,
                stacklevel=2,
            )
        self.shard_paths = [os.path.join(self.root, f) for f in shard_files]
        self.shard_first = first
        self.shard_counts = counts
        infos, labels, name_parts, self.damaged = [], [], [], []
        for k, path_k in enumerate(self.shard_paths):
            try:
                info, shard_labels, shard_names = self._open_shard(path_k, int(counts[k]), self._checked)
            except (OSError, KeyError, ValueError, CorruptDataError) as exc:
                last = int(first[k] + counts[k]) - 1
                reason = (
                    f"shard '{path_k}' cannot be used ({exc}); samples {first[k]}..{last} "
                    "are lost: the file is truncated or damaged, re-pack the store"
                )
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
        self._reader = _core.Reader(infos, threads, verify_checksums)
        self.sizes = (
            np.concatenate([i["sizes"] if "sizes" in i else np.zeros(i["count"], np.uint64) for i in infos])
            if infos
            else np.zeros(0, np.uint64)
        )
        self._fingerprint = None

    @staticmethod
    def _open_shard(path, expected, checked):
        def read(name):
            return _read_checked(f, name, "the shard", checked)

        with h5py.File(path, "r", locking=False) as f:
            if not f.attrs.get("complete") or int(f.attrs["num_samples"]) != expected:
                raise CorruptDataError(f"it holds {f.attrs.get('num_samples')} samples, the manifest says {expected}")
            data = f["data"]
            if data.chunks is not None or data.compression or data.dtype != np.uint8 or data.ndim != 1:
                raise CorruptDataError("its data set is not a contiguous, unfiltered 1-D uint8 array")
            offset = data.id.get_offset()  # None when the data set is empty (never allocated)
            info = {
                "path": path,
                "data_offset": 0 if offset is None else offset,
                "data_bytes": data.shape[0],
                "offsets": read("offsets"),
                "sizes": read("sizes"),
                "crc32c": read("crc32c"),
            }
            return info, read("labels").astype(np.int32), list(read("names"))

    def _open_reader(self):
        if self._reader is None:
            raise ValueError(f"store '{self.root}' is closed")
        return self._reader

    def __reduce__(self):
        return Store, self._args

    def __len__(self):
        return len(self._open_reader())

    def _index(self, i):
        i = int(i)
        n = len(self._open_reader())
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
            return self._open_reader().read(i)
        except (CorruptDataError, OSError) as exc:
            raise self._named(exc) from None

    def read_into(self, i, buffer):
        """Read sample i into the start of a writable buffer (numpy uint8, bytearray); returns its size."""
        i = self._index(i)
        try:
            return self._open_reader().read_into(i, buffer)
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
        n = len(self._open_reader())
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
            self._open_reader().read_many(idx, out, offsets[:-1])
        except (CorruptDataError, OSError) as exc:
            raise self._named(exc) from None
        return out[:total], offsets

    def fingerprint(self):
        """The store's identity: 16 hex digits of a 64-bit BLAKE2b hash of what
        it delivers, its sample count and, per sample, the size, CRC32C and
        label its index records. Computed once (O(N), from the index already in
        memory; no sample is read). Two copies of one store have the same
        fingerprint whatever their paths or shard layout; a change to any
        sample's bytes, size or label changes it. A damaged shard's samples
        (allow_damaged) count as empty, with no checksum and label -1."""
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=8)
            h.update(np.array([len(self.sizes)], dtype="<u8").tobytes())
            h.update(np.ascontiguousarray(self.sizes, dtype="<u8").tobytes())
            for info in self.shard_infos:
                crcs = info["crc32c"] if "crc32c" in info else np.zeros(info["count"], np.uint32)
                h.update(np.ascontiguousarray(crcs, dtype="<u4").tobytes())
            h.update(np.ascontiguousarray(self.labels, dtype="<i4").tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

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
        damaged = [
            (self.shard_paths[k], int(self.shard_first[k]), int(self.shard_counts[k]), reason)
            for k, reason in self.damaged
        ]
        for k in range(len(self.shard_paths)):
            if "damaged" in self.shard_infos[k]:
                continue
            bad, reasons, nbytes = self._open_reader().verify_shard(k)
            problems.extend((i, self.names[i], r) for i, r in zip(bad, reasons))
            bytes_read += nbytes
            bar.update(int(self.sizes[self.shard_first[k] : self.shard_first[k] + self.shard_counts[k]].sum()))
        bar.close()
        return VerifyReport(
            samples=len(self),
            bytes_read=bytes_read,
            seconds=time.monotonic() - started,
            problems=problems,
            damaged=damaged,
        )

    def close(self):
        self._reader = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self._reader is None:
            return f"<hpcdl.store.Store '{self.root}' (closed)>"
        return f"<hpcdl.store.Store '{self.root}': {len(self)} samples in {len(self.shard_paths)} shards>"
