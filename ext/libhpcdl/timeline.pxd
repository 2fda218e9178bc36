from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.vector cimport vector

cdef extern from "hpcdl/timeline.hpp" namespace "hpcdl" nogil:
    cdef cppclass CTraceEvent "hpcdl::TraceEvent":
        string name, category
        double start_us, duration_us
        int track

    cdef cppclass CTimeline "hpcdl::Timeline":
        @staticmethod
        CTimeline& instance()
        void enable(cbool on)
        cbool enabled()
        vector[CTraceEvent] take()
