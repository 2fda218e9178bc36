"""Cases shared by the single-process and MPI compression tests."""

import numpy as np

ODD_COUNTS = [0, 1, 2, 3, 5, 7, 63, 64, 65, 255, 257, 4097, 100_003]


def k_largest(x, k):
    """Indices of the k largest magnitudes of x, ascending; lower indices win ties."""
    return np.sort(np.argsort(-np.abs(x), kind="stable")[:k])


def topk_reuse_select(x, k, reuse_steps, state):
    """TopK(ratio, reuse_steps) on one rank, as docs/compression.md ("Threshold
    reuse") states it: (indices sent, ascending; the tensor's state after).
    state: None (a new tensor) or (threshold t, the k it was taken for, calls
    left that may reuse it). With uses left, a positive t and the same k, every
    index with |x| >= t is sent if their count c is in [ceil(k/2), 2k];
    otherwise the exact k are, and their smallest magnitude is the new t with
    reuse_steps uses."""
    if state is not None:
        t, k_then, left = state
        if left > 0 and k_then == k and t > 0:
            sent = np.flatnonzero(np.abs(x) >= t)
            if (k + 1) // 2 <= sent.size <= 2 * k:
                return sent, (t, k, left - 1)
    sent = k_largest(x, k)
    return sent, (np.abs(x[sent]).min() if k else np.float32(0), k, reuse_steps)
