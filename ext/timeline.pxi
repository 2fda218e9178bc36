# The one trace event list (include/hpcdl/util/timeline.hpp) that the engine and the
# prefetcher record into; hpcdl/timeline.py writes it.

from libc.stdint cimport uint64_t
from libcpp.vector cimport vector

from libhpcdl.timeline cimport CTimeline, CTraceEvent


def timeline_enable(bint on, uint64_t max_events):
    CTimeline.instance().enable(on, max_events)


def timeline_take():
    """Trace events recorded since the last call, (name, category, start_us,
    duration_us, track) each, and how many more were not kept (the limit)."""
    cdef uint64_t dropped = 0
    cdef vector[CTraceEvent] events = CTimeline.instance().take(&dropped)
    return [(e.name.decode(), e.category.decode(), e.start_us, e.duration_us, e.track) for e in events], dropped
