# The store reader (include/hpcdl/store/store_reader.hpp) and CRC32C
# (include/hpcdl/util/crc32c.hpp). The Pythonic layer is hpcdl/store/.

import os

import numpy as np

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint32_t, uint64_t
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string
from libcpp.utility cimport move
from libcpp.vector cimport vector

from libhpcdl.status cimport CStatus, check_status
from libhpcdl.store cimport (CShardInfo, CStoreReader, CThreadPool, crc32c as c_crc32c,
                             crc32c_hardware_available, crc32c_software as c_crc32c_software,
                             kDefaultReaderThreads, shard_infos)

# Files a rank reads at once unless told otherwise (include/hpcdl/store/store_reader.hpp).
DEFAULT_READER_THREADS = kDefaultReaderThreads


def crc32c(const unsigned char[::1] data, uint32_t crc=0):
    """CRC32C of a bytes-like object (SSE4.2 when available); ``crc`` continues a previous value."""
    cdef size_t n = data.shape[0]
    cdef const unsigned char* p = &data[0] if n else NULL
    with nogil:
        crc = c_crc32c(p, n, crc)
    return crc


def crc32c_software(const unsigned char[::1] data, uint32_t crc=0):
    """CRC32C computed with the table-driven code only (for tests and comparison)."""
    cdef size_t n = data.shape[0]
    cdef const unsigned char* p = &data[0] if n else NULL
    with nogil:
        crc = c_crc32c_software(p, n, crc)
    return crc


def crc32c_hardware():
    """True when crc32c() uses the SSE4.2 instruction on this CPU."""
    return crc32c_hardware_available()


cdef class Reader:
    """Serves samples of opened shards with pread; see hpcdl.store.Store.

    shards: one dict per shard with path, data_offset, data_bytes and the
    numpy arrays offsets (uint64), sizes (uint64), crc32c (uint32); or with
    path, damaged (the reason) and count for a shard that cannot be used.
    """
    cdef unique_ptr[CStoreReader] reader
    cdef CThreadPool* pool
    cdef int pool_pid
    cdef readonly int threads

    def __cinit__(self, shards, int threads=kDefaultReaderThreads, bint verify_checksums=True):
        cdef vector[CShardInfo] infos = shard_infos(shards)
        cdef CStatus st
        self.pool = NULL
        self.threads = max(threads, 1)
        with nogil:
            st = CStoreReader.open(move(infos), &self.reader)
        check_status(st)
        self.reader.get().set_verify_checksums(verify_checksums)

    def __dealloc__(self):
        # A pool made before fork() has no threads in the child: joining it
        # there would hang, so a child leaves its parent's pool alone.
        if self.pool != NULL and self.pool_pid == os.getpid():
            del self.pool

    cdef CThreadPool* _pool(self):
        if self.pool == NULL or self.pool_pid != os.getpid():
            self.pool = new CThreadPool(self.threads)
            self.pool_pid = os.getpid()
        return self.pool

    def __len__(self):
        return self.reader.get().count()

    def size(self, uint64_t i):
        return self.reader.get().size(i)

    def read(self, uint64_t i):
        """Sample i as a new bytes object."""
        cdef CStoreReader* r = self.reader.get()
        cdef CStatus st
        if i >= r.count():
            raise IndexError(f"sample index {i} out of range [0, {r.count()})")
        out = PyBytes_FromStringAndSize(NULL, r.size(i))
        cdef char* dst = PyBytes_AS_STRING(out)
        with nogil:
            st = r.read(i, dst)
        self._check(st, i)
        return out

    def read_into(self, uint64_t i, unsigned char[::1] out):
        """Read sample i into the start of a writable buffer; returns its size."""
        cdef CStoreReader* r = self.reader.get()
        cdef CStatus st
        if i >= r.count():
            raise IndexError(f"sample index {i} out of range [0, {r.count()})")
        cdef uint64_t n = r.size(i)
        if <uint64_t>out.shape[0] < n:
            raise ValueError(f"buffer of {out.shape[0]} bytes is too small for sample {i} ({n} bytes)")
        cdef unsigned char* dst = &out[0] if out.shape[0] else NULL
        with nogil:
            st = r.read(i, dst)
        self._check(st, i)
        return n

    def read_many(self, indices, unsigned char[::1] out, dst_offsets):
        """Read samples indices[k] into out at dst_offsets[k], on the reader's threads."""
        cdef CStoreReader* r = self.reader.get()
        cdef const uint64_t[::1] idx = np.ascontiguousarray(indices, dtype=np.uint64)
        cdef const uint64_t[::1] offs = np.ascontiguousarray(dst_offsets, dtype=np.uint64)
        cdef size_t n = idx.shape[0]
        cdef uint64_t failed = 0
        cdef CStatus st
        cdef CThreadPool* pool = self._pool()
        if offs.shape[0] != <Py_ssize_t>n:
            raise ValueError("indices and dst_offsets differ in length")
        if n == 0:
            return
        cdef unsigned char* dst = &out[0] if out.shape[0] else NULL
        with nogil:
            st = r.read_many(&idx[0], n, dst, &offs[0], pool, &failed)
        self._check(st, failed)

    cdef int _check(self, const CStatus& st, uint64_t sample) except -1:
        if not st.ok():
            try:
                check_status(st)
            except Exception as exc:
                exc.sample = sample
                raise
        return 0

    def verify_shard(self, size_t shard):
        """(bad sample indices, reasons, bytes read) of one shard's checksum scan."""
        cdef vector[uint64_t] bad
        cdef vector[string] reasons
        cdef uint64_t bytes_read = 0
        cdef CStatus st
        with nogil:
            st = self.reader.get().verify_shard(shard, &bad, &reasons, &bytes_read)
        check_status(st)
        return list(bad), [x.decode("utf-8", "replace") for x in reasons], bytes_read
