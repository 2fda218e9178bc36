from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.memory cimport shared_ptr, unique_ptr
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector
from mpi4py.libmpi cimport MPI_Comm

from libhpcdl.status cimport CStatus
from libhpcdl.store cimport CStoreReader

cdef extern from "hpcdl/prefetch/shuffle.hpp" namespace "hpcdl" nogil:
    uint64_t shuffle_draw(uint64_t seed, uint64_t epoch, uint64_t k)
    void epoch_order[T](uint64_t n, uint64_t seed, uint64_t epoch, T* out)

cdef extern from "hpcdl/prefetch/stream.hpp" namespace "hpcdl" nogil:
    cdef cppclass CStreamSpec "hpcdl::StreamSpec":
        uint64_t samples, global_batch, ranks, epochs, seed
        cbool drop_last
        CStatus validate()
        CStatus check_rank(uint64_t rank)
        uint64_t local_batch()
        uint64_t batches_per_epoch()
        uint64_t per_epoch()
        uint64_t length()
        vector[uint64_t] rank_stream(uint64_t rank, uint64_t start)

cdef extern from "hpcdl/prefetch/placement.hpp" namespace "hpcdl" nogil:
    cdef cppclass CPlacement "hpcdl::Placement":
        vector[uint32_t] freq
        vector[uint64_t] first
        vector[uint8_t] tier
        vector[uint64_t] offset
        vector[uint64_t] lists[2]
        uint64_t used[2]
    CPlacement place(const vector[uint64_t]& stream, const uint64_t* sizes, uint64_t samples,
                     const uint64_t* capacity)
    cdef cppclass CPeerSources "hpcdl::PeerSources":
        vector[int32_t] rank
        vector[uint64_t] key
    cdef cppclass CPlan "hpcdl::Plan":
        vector[uint64_t] stream
        CPlacement placement
        CPeerSources sources
    CStatus make_plan(const CStreamSpec& spec, uint64_t start, uint64_t self, const uint64_t* sizes,
                      const uint64_t* own_caps, const vector[uint64_t]& ram_capacity,
                      const vector[uint64_t]& disk_capacity, CPlan* out)

cdef extern from "hpcdl/prefetch/peer_service.hpp" namespace "hpcdl" nogil:
    cdef cppclass CPeerService "hpcdl::PeerService":
        @staticmethod
        vector[pair[uint64_t, uint64_t]] pieces(uint64_t total, uint64_t max_message)

cdef extern from "hpcdl/prefetch/prefetcher.hpp" namespace "hpcdl" nogil:
    uint64_t kDefaultStagingBytes

    cdef cppclass CPrefetchConfig "hpcdl::PrefetchConfig":
        pass

    cdef cppclass CConfigField "hpcdl::ConfigField":
        const char* name
        uint64_t* u64
        size_t* count
        double* seconds
        cbool* flag
        string* text
        vector[uint64_t]* list

    vector[CConfigField] config_fields(CPrefetchConfig& c)

    cdef cppclass CPrefetchStats "hpcdl::PrefetchStats":
        uint64_t hits[4]
        uint64_t bytes[4]

    cdef cppclass CStatField "hpcdl::StatField":
        const char* name
        const uint64_t* count
        const double* seconds

    vector[CStatField] stat_fields(const CPrefetchStats& s)

    cdef cppclass CBatchView "hpcdl::BatchView":
        uint64_t batch, ring_offset, bytes, count
        const uint64_t* samples
        const uint64_t* offsets

    cdef cppclass CPrefetcher "hpcdl::Prefetcher":
        @staticmethod
        CStatus create(unique_ptr[CStoreReader] reader, CPrefetchConfig cfg, unique_ptr[CPrefetcher]* out)
        CStatus start(MPI_Comm comm)
        CStatus close(double timeout_s)
        CStatus next_batch(CBatchView* out)
        const shared_ptr[char]& staging()
        uint64_t staging_bytes()
        CPrefetchStats stats()
        vector[string] take_warnings()
        const CPlacement& placement()
        const CPeerSources& sources()
