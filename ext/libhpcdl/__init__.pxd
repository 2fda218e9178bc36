# Declarations of the C++ core (include/hpcdl/), one .pxd per concern.
