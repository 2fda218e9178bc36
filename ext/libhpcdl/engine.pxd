from libc.stdint cimport int32_t, int64_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.memory cimport shared_ptr
from libcpp.string cimport string
from libcpp.vector cimport vector
from mpi4py.libmpi cimport MPI_Comm

from libhpcdl.status cimport CStatus

cdef extern from "hpcdl/util/segments.hpp" namespace "hpcdl" nogil:
    cdef cppclass CFloatSegment "hpcdl::FloatSegment":
        float* data
        size_t count

cdef extern from "hpcdl/engine/engine.hpp" namespace "hpcdl" nogil:
    cdef enum class COpKind "hpcdl::OpKind":
        kAllreduce
        kBroadcast
        kBarrier
        kAllgather
        kReduceScatter
        kAlltoall
        kGroupedAllreduce
        kGroupedAllgather
        kGroupedReduceScatter
        kJoin

    cdef enum class CDType "hpcdl::DType":
        kFloat32
        kFloat64
        kFloat16
        kBFloat16
        kInt32
        kInt64
        kBool
        kUInt8
        kInt8
        kInt16
        kUInt16
        kUInt32
        kUInt64

    cdef enum class CReduceOp "hpcdl::ReduceOp":
        kSum
        kAverage
        kMin
        kMax
        kProduct

    cdef cppclass CGroupMember "hpcdl::GroupMember":
        CDType dtype
        uint64_t count
        vector[int64_t] shape

    cdef cppclass COpDesc "hpcdl::OpDesc":
        COpKind kind
        CDType dtype
        CReduceOp reduce_op
        int32_t root
        uint64_t count
        vector[int64_t] shape
        uint64_t chunk_bytes
        string codec
        vector[CGroupMember] members

    cdef cppclass COpRequest "hpcdl::OpRequest":
        string name
        COpDesc desc
        void* data
        vector[void*] member_data
        cbool deferred
        uint64_t rows
        vector[uint64_t] splits
        vector[uint64_t] member_rows

    cdef cppclass COpResult "hpcdl::OpResult":
        uint64_t bytes
        vector[uint64_t] rows
        char* ptr()

    cdef cppclass COpTimes "hpcdl::OpTimes":
        double submitted_us, ready_us, agreed_us, started_us, reduce_scatter_end_us, finished_us

    cdef cppclass COperation "hpcdl::Operation":
        const string& name()
        cbool done()
        void mark_ready()
        CStatus mark_ready(vector[CFloatSegment] segments)
        cbool ready()
        cbool wait_for(double seconds)
        CStatus status()
        vector[string] take_notices()
        COpTimes times()
        COpResult& result()
        COpResult& member_result(size_t i)

    cdef enum class CNoticeKind "hpcdl::EngineNotice::Kind":
        kStall
        kRankLeft
        kError

    cdef cppclass CEngineNotice "hpcdl::EngineNotice":
        CNoticeKind kind
        string message

    cdef cppclass CEngineStats "hpcdl::EngineStats":
        string kind, codec
        uint64_t ops, bytes_sent, bytes_received, dense_bytes
        double seconds

    cdef cppclass CAgreementStats "hpcdl::AgreementStats":
        uint64_t messages_sent, messages_received, entries_received, descriptions_received, one_hop_runs

    cdef cppclass CEngine "hpcdl::Engine":
        @staticmethod
        CEngine& instance()
        CStatus submit(MPI_Comm comm, COpRequest req, shared_ptr[COperation]* out)
        CStatus submit_transfer(MPI_Comm comm, cbool send, void* data, uint64_t nbytes, int peer, int tag,
                                shared_ptr[COperation]* out)
        void set_stall_limits(double warn_seconds, double error_seconds)
        vector[CEngineStats] stats()
        CAgreementStats agreement_stats()
        void reset_stats()
        void reset_compression_state()
        vector[CEngineNotice] take_notices(uint64_t* dropped)
        CStatus copy_residual(MPI_Comm comm, const string& name, vector[float]* out, cbool* found)
        CStatus free_residual(MPI_Comm comm, const string& name, cbool* found)
        CStatus set_residual(MPI_Comm comm, const string& name, vector[float] values)
        uint64_t residual_bytes()
        void shutdown()

    size_t kMaxNotices "hpcdl::Engine::kMaxNotices"

cdef extern from "hpcdl/engine/stall_inspector.hpp" namespace "hpcdl" nogil:
    double kDefaultStallWarningSeconds, kDefaultStallErrorSeconds

cdef extern from "hpcdl/engine/settings.hpp" namespace "hpcdl" nogil:
    cdef cppclass CEnvSetting "hpcdl::EnvSetting":
        const char* key
        const char* variable
        cbool integer
        int64_t low, high

    const CEnvSetting* kEnvSettings
    size_t kEnvSettingCount
    int64_t kUnbounded

cdef extern from "hpcdl/util/dtype.hpp" namespace "hpcdl" nogil:
    size_t dtype_size(CDType t)
    const char* dtype_name(CDType t)
    cbool dtype_is_float(CDType t)
    cbool dtype_valid(int t)
    cbool reduce_op_valid(int op)
    const char* reduce_op_name(CReduceOp op)

cdef extern from "hpcdl/algorithms/ring.hpp" namespace "hpcdl" nogil:
    size_t kDefaultChunkBytes, kMinChunkBytes, kMaxChunkBytes

cdef extern from "hpcdl/algorithms/recursive_doubling.hpp" namespace "hpcdl" nogil:
    size_t kRecursiveDoublingMaxBytes
    cbool use_recursive_doubling(size_t bytes)

cdef extern from "hpcdl/algorithms/halving_doubling.hpp" namespace "hpcdl" nogil:
    size_t kHalvingDoublingMaxSegmentBytes
    int kHalvingDoublingMinRanks
    cbool use_halving_doubling(int p, size_t bytes)

cdef extern from "hpcdl/util/mpi_process.hpp" namespace "hpcdl" nogil:
    void remember_mpi_process()
    cbool in_mpi_process()
    CStatus require_mpi_process(const string& who)
