"""Data for the training examples: the scikit-learn digits packed into an hpcdl store,
read back in rank-sharded, per-epoch shuffled batches.

`epoch_batches` is the one data-loading function of both examples; it is
where hpcdl.prefetch.Prefetcher (and its PyTorch / tf.data adapters) plugs in.
"""

import io
import os
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import hpcdl
import hpcdl.store

TEST_FRACTION = 0.2
SPLIT_SEED = 1234


def log(message):
    if hpcdl.rank() == 0:
        print(f"[hpcdl rank 0] {message}", flush=True)


def prepare_store(data, comm=MPI.COMM_WORLD):
    """The store to train on: ``data`` when given, else the digits packed into a temporary store."""
    if data:
        return hpcdl.store.Store(data)
    root = os.path.join(tempfile.gettempdir(), f"hpcdl-digits-{os.getuid()}")
    src, dst = os.path.join(root, "src"), os.path.join(root, "store")
    marker = os.path.join(root, "src.complete")  # outside src: it must not be packed as a sample
    if comm.Get_rank() == 0 and not os.path.exists(marker):
        from sklearn.datasets import load_digits

        digits = load_digits()
        for i, (image, label) in enumerate(zip(digits.images, digits.target)):
            os.makedirs(os.path.join(src, f"digit{label}"), exist_ok=True)
            np.save(os.path.join(src, f"digit{label}", f"{i:04d}.npy"), (image / 16.0).astype(np.float32))
        open(marker, "w").close()
    comm.barrier()
    hpcdl.store.pack(src, dst, comm=comm, force=True, progress=False)
    log(f"packed {len(os.listdir(os.path.join(src)))} classes of scikit-learn digits into {dst}")
    return hpcdl.store.Store(dst)


def split(store):
    """Fixed train/test split of the store's indices (the same on every rank)."""
    order = np.random.default_rng(SPLIT_SEED).permutation(len(store))
    n_test = max(1, int(len(store) * TEST_FRACTION))
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def decode(store, indices):
    """Samples (.npy bytes) as a float32 matrix, one flattened sample per row, and their labels."""
    data, offsets = store.read_many(indices)
    rows = [np.load(io.BytesIO(data[offsets[k]:offsets[k + 1]].tobytes())).reshape(-1)
            for k in range(len(indices))]
    return np.stack(rows).astype(np.float32), store.labels[indices].astype(np.int64)


def eval_batch_size(indices, comm=MPI.COMM_WORLD):
    """Up to 16 per rank, fewer when the held-out set is small (every rank still gets one batch)."""
    return max(1, min(16, len(indices) // comm.Get_size()))


def epoch_batches(store, indices, batch_size, epoch, seed, comm=MPI.COMM_WORLD):
    """This rank's batches for one epoch: (x, y, seconds spent waiting for them).

    Shuffled with seed + epoch (the same permutation on every rank), dealt
    round-robin, and cut so that every rank runs the same number of steps.
    Reads are synchronous here, so all read time is stall time.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    order = indices[np.random.default_rng(seed + epoch).permutation(len(indices))]
    steps = len(order) // (size * batch_size)
    if steps == 0:
        sys.exit(f"[hpcdl rank {rank}] {len(order)} samples are too few for {size} ranks x batch {batch_size}")
    mine = order[rank::size][:steps * batch_size]
    for s in range(steps):
        started = time.perf_counter()
        x, y = decode(store, mine[s * batch_size:(s + 1) * batch_size])
        yield x, y, time.perf_counter() - started


def compression_codec(name, int8_block, topk_ratio):
    """The hpcdl.compression codec for --compression (None: dense)."""
    if name == "none":
        return None
    try:
        import hpcdl.compression as codecs
    except ImportError:
        sys.exit("hpcdl.compression is not available in this build: use --compression none")
    return {"fp16": lambda: codecs.FP16(), "bf16": lambda: codecs.BF16(),
            "int8": lambda: codecs.Int8(block=int8_block), "topk": lambda: codecs.TopK(ratio=topk_ratio)}[name]()


def add_common_arguments(parser):
    parser.add_argument("--data", help="a packed hpcdl store of .npy samples (default: pack the digits)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compression", choices=["none", "fp16", "bf16", "int8", "topk"], default="none")
    parser.add_argument("--int8-block", type=int, default=256)
    parser.add_argument("--topk-ratio", type=float, default=0.05)


def gradient_traffic():
    """(bytes sent, dense bytes) of this rank's allreduces since the last call."""
    rows = hpcdl.stats(reset=True).get("allreduce", {}).values()
    return sum(r["bytes_sent"] for r in rows), sum(r["dense_bytes"] for r in rows)


def report_epoch(comm, epoch, seconds, samples, loss_sum, correct, stall, test_correct, test_count):
    """Sum this epoch's figures over the ranks and print them on rank 0."""
    sent, dense = gradient_traffic()
    totals = comm.allreduce(np.array([samples, loss_sum, correct, test_correct, test_count, sent, dense],
                                     dtype=np.float64))
    stall_max = comm.allreduce(stall, op=MPI.MAX)
    seconds = comm.allreduce(seconds, op=MPI.MAX)
    samples, loss_sum, correct, test_correct, test_count, sent, dense = totals
    log(f"epoch {epoch:3d}  loss {loss_sum / samples:.4f}  train acc {correct / samples:.3f}  "
        f"test acc {test_correct / test_count:.3f}  {samples / seconds:8.0f} samples/s  "
        f"stall {stall_max:.3f} s  grad bytes sent {sent / 1e6:.2f} MB vs dense {dense / 1e6:.2f} MB "
        f"({sent / dense if dense else 1:.2f}x)")
    return test_correct / test_count
