"""Stores and fixtures shared by the single-process and MPI prefetcher tests."""

import os
import shutil
import tempfile

import numpy as np
from mpi4py import MPI

from hpcdl import store


def make_store(root, files=150, seed=0, max_size=3000, comm=None, edit=None):
    """A packed store of random files (sizes 0..max_size, a few classes); returns the Store.
    Packing is collective over comm (default COMM_WORLD). edit: a function
    applied to each file's bytes before it is written (a stale copy of the data set)."""
    rng = np.random.default_rng(seed)
    src = os.path.join(root, "src")
    for i in range(files):
        path = os.path.join(src, f"c{i % 3}", f"{i:05d}.bin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = rng.bytes(int(rng.integers(0, max_size)) if i % 17 else 0)
        with open(path, "wb") as fh:
            fh.write(edit(data) if edit else data)
    dst = os.path.join(root, "store")
    store.pack(src, dst, progress=False, comm=comm)
    return store.Store(dst)


def store_made_by_rank0(comm, prefix, files, seed):
    """For a module fixture of MPI tests: rank 0 makes a store in a new folder, every rank
    opens it; removed after the module's tests (a generator: `yield from` it)."""
    root = None
    if comm.Get_rank() == 0:
        root = tempfile.mkdtemp(prefix=prefix)
        make_store(root, files=files, seed=seed, comm=MPI.COMM_SELF).close()
    root = comm.bcast(root, root=0)
    yield store.Store(os.path.join(root, "store"))
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


# Stale copies of one data set, as a per-node copy left from another version
# would be: the same files, the same sizes, byte 0 of each one different; or
# each file one byte shorter.
STALE_EDITS = {"byte0": lambda b: bytes([b[0] ^ 0xFF]) + b[1:] if b else b, "shorter": lambda b: b[:-1]}


def copies_made_by_rank0(comm, prefix, files, seed):
    """For a module fixture of MPI tests: rank 0 packs one set of files as it
    is ("fresh"), again at another path ("same": a faithful copy), and once per
    STALE_EDITS; every rank gets {name: store path}; removed after the module's
    tests (a generator: `yield from` it)."""
    root = None
    if comm.Get_rank() == 0:
        root = tempfile.mkdtemp(prefix=prefix)
        for name, edit in [("fresh", None), ("same", None)] + list(STALE_EDITS.items()):
            make_store(os.path.join(root, name), files=files, seed=seed, comm=MPI.COMM_SELF, edit=edit).close()
    root = comm.bcast(root, root=0)
    yield {name: os.path.join(root, name, "store") for name in ["fresh", "same"] + list(STALE_EDITS)}
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)


def corrupt_sample(st, victim):
    """Flip one byte of sample `victim` on disk; returns its shard's path."""
    info = next(i for i in st.shard_infos if "offsets" in i)
    with open(info["path"], "r+b") as fh:
        fh.seek(info["data_offset"] + int(info["offsets"][victim]))
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    return info["path"]
