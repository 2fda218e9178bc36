from libc.stdint cimport uint8_t, uint64_t
from libcpp.string cimport string

from libhpcdl.status cimport CStatus

cdef extern from "hpcdl/codec_array.hpp" namespace "hpcdl" nogil:
    CStatus codec_encoded_bytes(const string& text, size_t n, size_t* out)
    CStatus codec_encode(const string& text, const float* x, size_t n, uint8_t* out, float* err, uint64_t stream)
    CStatus codec_decode(const string& text, const uint8_t* data, size_t n, float* out)
