"""Cases shared by the single-process and MPI compression tests."""

import numpy as np

ODD_COUNTS = [0, 1, 2, 3, 5, 7, 63, 64, 65, 255, 257, 4097, 100_003]


def k_largest(x, k):
    """Indices of the k largest magnitudes of x, ascending; lower indices win ties."""
    return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])
