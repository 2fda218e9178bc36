"""hpcdl's demo: run with `mpiexec -n 4 python -m hpcdl.demo` (./scripts/demo.sh).

Packs scikit-learn's bundled digits images (8x8, 10 classes) as small files
into an hpcdl store (every rank writes shards), then trains a small MLP with
data-parallel SGD: every rank reads its share of each global batch from the
store and the gradients are averaged with hpcdl's ring allreduce. Prints, per
epoch, test accuracy, samples/s and the bytes the allreduce sent.
"""

import argparse
import hashlib
import os
import sys
import traceback
import shutil
import tempfile
import time

import numpy as np
from mpi4py import MPI

import hpcdl
from hpcdl.store import Store, pack


def log(comm, message):
    if comm.Get_rank() == 0:
        print(f"[hpcdl rank 0] {message}", flush=True)


def write_digits(root):
    """The digits data as one small file per image, class = sub-directory (ImageFolder)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        folder = os.path.join(root, f"digit{label}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{i:05d}.u8"), "wb") as f:
            f.write(image.astype(np.uint8).tobytes())
    return len(digits.target)


def decode(store, indices):
    data, offsets = store.read_many(indices)
    x = np.frombuffer(data, dtype=np.uint8).reshape(len(indices), 64).astype(np.float32) / 16.0
    return x, store.labels[indices]


class MLP:
    def __init__(self, hidden, seed):
        rng = np.random.default_rng(seed)
        self.params = {
            "w1": (rng.standard_normal((64, hidden)) * np.sqrt(2 / 64)).astype(np.float32),
            "b1": np.zeros(hidden, np.float32),
            "w2": (rng.standard_normal((hidden, 10)) * np.sqrt(1 / hidden)).astype(np.float32),
            "b2": np.zeros(10, np.float32),
        }

    def logits(self, x):
        h = np.maximum(x @ self.params["w1"] + self.params["b1"], 0)
        return h, h @ self.params["w2"] + self.params["b2"]

    def gradients(self, x, y, global_batch):
        """Gradients of the mean cross-entropy over the global batch (this rank's share of the sum)."""
        h, z = self.logits(x)
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        dz = p / global_batch
        dh = (dz @ self.params["w2"].T) * (h > 0)
        return {"w1": x.T @ dh, "b1": dh.sum(0), "w2": h.T @ dz, "b2": dz.sum(0)}

    def accuracy(self, x, y):
        return float((self.logits(x)[1].argmax(1) == y).mean())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (all ranks)")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="where the files and the store go (default: a temp dir)")
    args = parser.parse_args(argv)

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    workdir = comm.bcast(args.workdir or (tempfile.mkdtemp(prefix="hpcdl-demo-") if rank == 0 else None))
    src, dst = os.path.join(workdir, "digits"), os.path.join(workdir, "digits.hpcdl")
    if rank == 0:
        n = write_digits(src)
        log(comm, f"wrote {n} digit images as small files under {src}")
    comm.Barrier()
    t0 = time.perf_counter()
    pack(src, dst, shards=size, comm=comm, force=True, progress=False)
    log(comm, f"packed into {size} HDF5 shards by {size} ranks in {time.perf_counter() - t0:.2f} s: {dst}")

    store = Store(dst)
    order = np.random.default_rng(args.seed).permutation(len(store))
    test_idx, train_idx = np.sort(order[:360]), order[360:]
    x_test, y_test = decode(store, test_idx)
    model = MLP(args.hidden, args.seed)
    per_rank = args.batch_size // size
    global_batch = per_rank * size
    steps = len(train_idx) // global_batch
    log(comm, f"training on {len(train_idx)} samples, {size} ranks x {per_rank} per step, {steps} steps/epoch")
    for epoch in range(args.epochs):
        hpcdl.stats(reset=True)
        epoch_order = train_idx[np.random.default_rng((args.seed, epoch)).permutation(len(train_idx))]
        t0 = time.perf_counter()
        for step in range(steps):
            mine = epoch_order[step * global_batch + rank * per_rank:][:per_rank]
            x, y = decode(store, mine)
            grads = model.gradients(x, y, global_batch)
            handles = [hpcdl.allreduce_async(g, name=f"grad.{k}") for k, g in grads.items()]
            for h in handles:
                h.wait()
            for k, g in grads.items():
                model.params[k] -= args.lr * g
        seconds = time.perf_counter() - t0
        sent = comm.allreduce(hpcdl.stats()["allreduce"]["none"]["bytes_sent"])
        log(comm, f"epoch {epoch + 1}: test accuracy {model.accuracy(x_test, y_test):.3f}  "
                  f"{steps * global_batch / seconds:,.0f} samples/s  "
                  f"allreduce sent {sent / 1e6:.2f} MB over {steps * len(grads)} ops")
    digests = comm.allgather(hashlib.sha1(b"".join(p.tobytes() for p in model.params.values())).digest())
    log(comm, f"parameters bitwise identical on all {size} ranks: {len(set(digests)) == 1}")
    store.close()
    comm.Barrier()
    if rank == 0 and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        # One failing rank must not leave the others waiting in a collective.
        print(f"[hpcdl rank {MPI.COMM_WORLD.Get_rank()}] demo failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
