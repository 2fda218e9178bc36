from libc.stdint cimport uint32_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.functional cimport function
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string
from libcpp.vector cimport vector

from libhpcdl.status cimport CStatus

cdef extern from "hpcdl/util/crc32c.hpp" namespace "hpcdl" nogil:
    uint32_t crc32c(const void* data, size_t n, uint32_t crc)
    uint32_t crc32c_software(const void* data, size_t n, uint32_t crc)
    cbool crc32c_hardware_available()

cdef extern from "hpcdl/util/thread_pool.hpp" namespace "hpcdl" nogil:
    cdef cppclass CThreadPool "hpcdl::ThreadPool":
        CThreadPool(size_t threads)
        size_t size()

cdef extern from "hpcdl/store/store_reader.hpp" namespace "hpcdl" nogil:
    size_t kDefaultReaderThreads

    cdef cppclass CShardInfo "hpcdl::ShardInfo":
        string path
        uint64_t data_offset
        uint64_t data_bytes
        vector[uint64_t] offsets
        vector[uint64_t] sizes
        vector[uint32_t] crc32c
        string damaged
        uint64_t damaged_count

    cdef cppclass CStoreReader "hpcdl::StoreReader":
        @staticmethod
        CStatus open(vector[CShardInfo] shards, unique_ptr[CStoreReader]* out)
        size_t count()
        size_t shard_count()
        uint64_t size(size_t i)
        size_t shard_of(size_t i)
        size_t shard_first(size_t shard)
        size_t shard_samples(size_t shard)
        const string& shard_path(size_t shard)
        void set_verify_checksums(cbool on)
        CStatus read(size_t i, void* dst)
        CStatus read_many(const uint64_t* idx, size_t n, void* dst, const uint64_t* dst_offsets,
                          CThreadPool* pool, uint64_t* failed)
        CStatus verify_shard(size_t shard, vector[uint64_t]* bad, vector[string]* reasons,
                             uint64_t* bytes_read)


cdef inline void _copy_u64(vector[uint64_t]& dst, arr) except *:
    import numpy as np
    cdef const uint64_t[::1] view = np.ascontiguousarray(arr, dtype=np.uint64)
    cdef size_t n = view.shape[0]
    dst.resize(n)
    for i in range(n):
        dst[i] = view[i]


# The shard descriptions of hpcdl.store.Store (dicts) as the core's ShardInfo
# list: one dict per shard with path, data_offset, data_bytes and numpy arrays
# offsets (uint64), sizes (uint64), crc32c (uint32); or path, damaged (the
# reason) and count for a shard that cannot be used.
cdef inline vector[CShardInfo] shard_infos(shards) except *:
    import os
    import numpy as np
    cdef vector[CShardInfo] infos
    cdef CShardInfo* info
    cdef const uint32_t[::1] crcs
    for s in shards:
        infos.resize(infos.size() + 1)
        info = &infos.back()
        info.path = os.fsencode(s["path"])
        if s.get("damaged"):
            info.damaged = str(s["damaged"]).encode()
            info.damaged_count = s["count"]
        else:
            info.data_offset = s["data_offset"]
            info.data_bytes = s["data_bytes"]
            _copy_u64(info.offsets, s["offsets"])
            _copy_u64(info.sizes, s["sizes"])
            crcs = np.ascontiguousarray(s["crc32c"], dtype=np.uint32)
            info.crc32c.resize(crcs.shape[0])
            for i in range(crcs.shape[0]):
                info.crc32c[i] = crcs[i]
    return infos
