"""HDF5-aggregated small-file store: pack a directory tree of small files into a
few HDF5 shards, then read samples by index with plain positioned reads.

    hpcdl.store.pack("imagenet/train", "train.hpcdl")    # collective: mpiexec -n P
    st = hpcdl.store.Store("train.hpcdl"); st[i], st.labels[i], st.read_many(ids)

Modules: manifest (the on-disk format, docs/store.md), packing (pack()),
reader (Store), progress (the bars of both), probe (the store's measured speed
and the prefetcher's read settings from it).
"""

from hpcdl.store.manifest import FORMAT, FORMAT_VERSION, MANIFEST, crc32c, shard_name
from hpcdl.store.packing import DEFAULT_SHARD_BYTES, PackResult, pack
from hpcdl.store.reader import DEFAULT_THREADS, Store, StoreWarning, VerifyReport

__all__ = [
    "pack",
    "Store",
    "StoreWarning",
    "PackResult",
    "VerifyReport",
    "crc32c",
    "shard_name",
    "MANIFEST",
    "FORMAT",
    "FORMAT_VERSION",
    "DEFAULT_SHARD_BYTES",
    "DEFAULT_THREADS",
]
