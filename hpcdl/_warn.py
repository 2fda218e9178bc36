"""hpcdl's one warning channel on the Python side: an operation's stall notices,
the prefetcher's tier warnings and the store's go through warn(), which puts
this process's rank in front, so that the merged output of a job says which
rank warned."""

import warnings

from mpi4py import MPI


def warn(message, category, stacklevel=1):
    """warnings.warn(message, category) as "[hpcdl rank R] message" (R: the rank in
    COMM_WORLD); stacklevel counts from warn()'s caller, as warnings.warn's does."""
    warnings.warn(f"[hpcdl rank {MPI.COMM_WORLD.Get_rank()}] {message}", category, stacklevel=stacklevel + 1)
