"""Compressed gradients still train: data-parallel SGD on scikit-learn's digits.

A one-hidden-layer numpy MLP, each rank on its own shard of the training set,
gradients averaged with hpcdl.allreduce every step. Trained once dense, once
with TopK 1% + error feedback (auto: the sparse allgather at this size, and
the split allreduce, which keeps only the global k), once with Int8; the same steps, the same
initialization. Each compressed run must reach the dense run's test accuracy
within 1.5 points.
"""

import numpy as np
import pytest
from mpi4py import MPI
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hpcdl
from hpcdl.compression import Int8, TopK

from conftest import agree

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD
HIDDEN, STEPS, BATCH, LR = 64, 600, 32, 0.1


def digits():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)


class MLP:
    def __init__(self, n_in, n_hidden, n_out):
        rng = np.random.default_rng(0)  # same on every rank
        self.shapes = [(n_in, n_hidden), (n_hidden,), (n_hidden, n_out), (n_out,)]
        self.flat = np.zeros(sum(int(np.prod(s)) for s in self.shapes), np.float32)
        w1, b1, w2, b2 = self.params()
        w1[:] = rng.standard_normal(w1.shape) * np.sqrt(2 / n_in)
        w2[:] = rng.standard_normal(w2.shape) * np.sqrt(1 / n_hidden)

    def params(self, flat=None):
        flat = self.flat if flat is None else flat
        out, at = [], 0
        for s in self.shapes:
            n = int(np.prod(s))
            out.append(flat[at : at + n].reshape(s))
            at += n
        return out

    def forward(self, x):
        w1, b1, w2, b2 = self.params()
        h = np.maximum(x @ w1 + b1, 0)
        return h, h @ w2 + b2

    def gradient(self, x, y):
        """Flat float32 gradient of the mean cross-entropy on (x, y)."""
        w1, b1, w2, b2 = self.params()
        h, logits = self.forward(x)
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        d_logits = p / len(y)
        d_h = (d_logits @ w2.T) * (h > 0)
        grad = np.zeros_like(self.flat)
        g_w1, g_b1, g_w2, g_b2 = self.params(grad)
        g_w1[:], g_b1[:] = x.T @ d_h, d_h.sum(axis=0)
        g_w2[:], g_b2[:] = h.T @ d_logits, d_logits.sum(axis=0)
        return grad

    def accuracy(self, x, y):
        return float(np.mean(self.forward(x)[1].argmax(axis=1) == y))


def train(compression, name):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x_train, x_test, y_train, y_test = digits()
    shard = np.arange(rank, len(x_train), size)
    x_mine, y_mine = x_train[shard], y_train[shard]
    model = MLP(x_train.shape[1], HIDDEN, 10)
    rng = np.random.default_rng(100 + rank)
    hpcdl.compression.reset_state()
    for _ in range(STEPS):
        batch = rng.choice(len(x_mine), BATCH, replace=False)
        grad = model.gradient(x_mine[batch], y_mine[batch])
        hpcdl.allreduce(grad, op="average", name=name, compression=compression)
        model.flat -= LR * grad
    digests = WORLD.allgather(model.flat.tobytes())
    return model.accuracy(x_test, y_test), len(set(digests)) == 1


def test_compressed_sgd_matches_dense_accuracy_on_digits():
    dense, dense_same = train(None, "digits.grad")
    results = {}
    for label, codec in (
        ("topk1%+ef", TopK(0.01)),
        ("topk1%split+ef", TopK(0.01, algorithm="split")),
        ("int8", Int8()),
    ):
        results[label] = train(codec, "digits.grad")
    bad = {label: acc for label, (acc, same) in results.items() if not same or acc < dense - 0.015}
    detail = f"dense {dense:.4f}, " + ", ".join(f"{k} {a:.4f} (ranks identical: {s})" for k, (a, s) in results.items())
    if WORLD.Get_rank() == 0:
        print(f"[hpcdl rank 0] digits accuracy after {STEPS} steps: {detail}")
    agree(WORLD, dense_same and dense > 0.9 and not bad, detail)
