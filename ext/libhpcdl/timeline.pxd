from libcpp cimport bool as cbool
from libcpp.string cimport string
from libc.stdint cimport uint64_t
from libcpp.vector cimport vector

cdef extern from "hpcdl/util/timeline.hpp" namespace "hpcdl" nogil:
    cdef cppclass CTraceEvent "hpcdl::TraceEvent":
        string name, category
        double start_us, duration_us
        int track

    cdef cppclass CTimeline "hpcdl::Timeline":
        @staticmethod
        CTimeline& instance()
        void enable(cbool on, uint64_t max_events)
        cbool enabled()
        vector[CTraceEvent] take(uint64_t* dropped)
