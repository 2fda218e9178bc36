# The one trace event list (include/hpcdl/timeline.hpp) that the engine and the
# prefetcher record into; hpcdl/timeline.py writes it.

from libcpp.vector cimport vector

from libhpcdl.timeline cimport CTimeline, CTraceEvent


def timeline_enable(bint on):
    CTimeline.instance().enable(on)


def timeline_take():
    """Recorded trace events since the last call: (name, category, start_us, duration_us, track)."""
    cdef vector[CTraceEvent] events = CTimeline.instance().take()
    return [(e.name.decode(), e.category.decode(), e.start_us, e.duration_us, e.track) for e in events]
