# cython: language_level=3, boundscheck=False, wraparound=False
"""hpcdl's one compiled module: the Cython layer over the whole C++ core.

One extension holds every C++ source (src/*/*.cc), so each singleton of the
core (the engine, the timeline) exists once per process. It is assembled from
one .pxi file per topic, as mpi4py does; the Pythonic layers are
hpcdl/collectives.py, hpcdl/store/ and hpcdl/prefetch.py.
"""

include "status.pxi"
include "engine.pxi"
include "store.pxi"
include "prefetch.pxi"
include "timeline.pxi"
