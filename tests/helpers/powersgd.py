"""A float64 numpy reference of PowerSGD as docs/compression.md states it, for several ranks
in one process, and the digits model the convergence test trains."""

import zlib

import numpy as np


def seeded_q(seed, name, m, rank):
    """The documented start of Q: float32 normals of numpy's PCG64 seeded (seed << 32) | crc32(name)."""
    rng = np.random.Generator(np.random.PCG64((seed << 32) | zlib.crc32(name.encode())))
    return rng.standard_normal((m, rank), dtype=np.float32).astype(np.float64)


def gram_schmidt(p):
    p = p.copy()
    for i in range(p.shape[1]):
        col = p[:, i] - p[:, :i] @ (p[:, :i].T @ p[:, i])
        norm = np.linalg.norm(col)
        p[:, i] = col / norm if norm >= 1e-30 else col
    return p


class Reference:
    """PowerSGD over `ranks` ranks in float64: per matrix M_i = g_i + e_i, P = mean M_i Q,
    orthogonalized, Q = mean M_i^T P, approx = P Q^T, e_i = M_i - approx (0 where not finite); Q warm-starts the
    next step, its dead (zero or non-finite) columns restart from the seeded Q."""

    def __init__(self, shapes, rank, seed, ranks):
        self.q0 = {name: seeded_q(seed, name, m, rank) for name, (n, m) in shapes.items()}
        self.q = {name: q.copy() for name, q in self.q0.items()}
        self.residual = {name: [np.zeros(shape) for _ in range(ranks)] for name, shape in shapes.items()}

    def step(self, name, grads, live=None):
        """The approximation every rank applies, from each rank's n x m gradient. Ranks not in
        `live` (default: all) have joined: their M is zero (the means still divide by every
        rank) and their residual stays as it is."""
        live = range(len(grads)) if live is None else live
        ms = [g + e if r in live else np.zeros_like(g) for r, (g, e) in enumerate(zip(grads, self.residual[name]))]
        p = gram_schmidt(np.mean([m @ self.q[name] for m in ms], axis=0))
        q = np.mean([m.T @ p for m in ms], axis=0)
        approx = p @ q.T
        self.residual[name] = [
            np.where(np.isfinite(m - approx), m - approx, 0.0) if r in live else e
            for r, (m, e) in enumerate(zip(ms, self.residual[name]))
        ]
        dead = ~np.isfinite(q).all(axis=0) | (q == 0).all(axis=0)
        self.q[name] = np.where(dead, self.q0[name], q)
        return approx, ms
