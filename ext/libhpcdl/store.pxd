from libc.stdint cimport uint32_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.functional cimport function
from libcpp.memory cimport unique_ptr
from libcpp.string cimport string
from libcpp.vector cimport vector

from libhpcdl.status cimport CStatus

cdef extern from "hpcdl/crc32c.hpp" namespace "hpcdl" nogil:
    uint32_t crc32c(const void* data, size_t n, uint32_t crc)
    uint32_t crc32c_software(const void* data, size_t n, uint32_t crc)
    cbool crc32c_hardware_available()

cdef extern from "hpcdl/thread_pool.hpp" namespace "hpcdl" nogil:
    cdef cppclass CThreadPool "hpcdl::ThreadPool":
        CThreadPool(size_t threads)
        size_t size()

cdef extern from "hpcdl/store_reader.hpp" namespace "hpcdl" nogil:
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
