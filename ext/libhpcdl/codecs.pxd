from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libcpp.string cimport string

from libhpcdl.status cimport CStatus

cdef extern from "hpcdl/codecs/topk.hpp" namespace "hpcdl" nogil:
    size_t topk_count(size_t n, double ratio)
    size_t topk_reuse_cap(size_t k)

    cdef cppclass CTopkThreshold "hpcdl::TopkThreshold":
        uint32_t magnitude
        size_t k
        uint32_t uses_left

cdef extern from "hpcdl/codecs/codec_array.hpp" namespace "hpcdl" nogil:
    CStatus codec_encoded_bytes(const string& text, size_t n, size_t* out)
    CStatus codec_encode(const string& text, const float* x, size_t n, uint8_t* out, float* err, uint64_t stream)
    CStatus codec_decode(const string& text, const uint8_t* data, size_t n, float* out)
    CStatus topk_contribution_array(const string& text, const float* x, size_t n, float* residual,
                                    CTopkThreshold* threshold, uint32_t* idx, float* val, size_t* count)

cdef extern from "hpcdl/codecs/codec_spec.hpp" namespace "hpcdl" nogil:
    cdef enum class CCodecKind "hpcdl::CodecKind":
        kNone
        kFp16
        kBf16
        kInt8
        kTopK

    cdef enum class CTopkAlgorithm "hpcdl::TopkAlgorithm":
        kAuto
        kAllgather
        kSplit

    cdef cppclass CCodecSpec "hpcdl::CodecSpec":
        CCodecKind kind
        uint32_t block
        bint stochastic
        uint64_t seed
        double ratio
        CTopkAlgorithm topk_algorithm
        uint32_t topk_reuse_steps

    CStatus parse_codec(const string& text, CCodecSpec* out)
    uint32_t kDefaultInt8Block
    const char* codec_name(CCodecKind kind)
    const char* topk_algorithm_name(CTopkAlgorithm algorithm)

cdef extern from "hpcdl/algorithms/sparse_allreduce.hpp" namespace "hpcdl" nogil:
    bint topk_use_split(CTopkAlgorithm algorithm, int p, size_t n, size_t k)
