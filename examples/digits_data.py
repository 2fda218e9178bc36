"""Data for the training examples: the scikit-learn digits packed into hpcdl
stores, training samples read through hpcdl's clairvoyant prefetcher.

prepare_stores() packs the digits (a fixed train/test split) unless --data
names a store; make_prefetcher() stages the training samples for the whole
run (RAM tier, optional node-local disk tier, peers' RAM, the store); the
examples then read it with the framework adapters (hpcdl.torch.TorchDataset,
hpcdl.tensorflow.tf_dataset). The held-out set is small and read once per epoch,
directly from its store.
"""

import io
import json
import os
import sys
import tempfile

import numpy as np
from mpi4py import MPI

import hpcdl
import hpcdl.store
from hpcdl.measure import rate, ratio, show
from hpcdl.prefetch import Prefetcher

TEST_FRACTION = 0.2
SPLIT_SEED = 1234


def log(message):
    if hpcdl.rank() == 0:
        print(f"[hpcdl rank 0] {message}", flush=True)


def _write_digits(src):
    """The digits as .npy files, class-per-directory, under src/train and src/test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(digits.target))
    held_out = set(order[: max(1, int(len(order) * TEST_FRACTION))].tolist())
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        part = os.path.join(src, "test" if i in held_out else "train", f"digit{label}")
        os.makedirs(part, exist_ok=True)
        np.save(os.path.join(part, f"{i:04d}.npy"), (image / 16.0).astype(np.float32))


def prepare_stores(data, test_data, comm=MPI.COMM_WORLD):
    """(train store, test store or None): the given stores, else the digits packed into two."""
    if data:
        train, test = hpcdl.store.Store(data), hpcdl.store.Store(test_data) if test_data else None
        if test is not None and test.classes != train.classes:
            sys.exit(
                f"[hpcdl rank {comm.Get_rank()}] {test_data} has classes {test.classes}, "
                f"{data} has {train.classes}: labels would not match"
            )
        return train, test
    root = os.path.join(tempfile.gettempdir(), f"hpcdl-digits-{os.getuid()}")
    src = os.path.join(root, "split")
    marker = os.path.join(root, "split.complete")  # outside src: it must not be packed as a sample
    if comm.Get_rank() == 0 and not os.path.exists(marker):
        _write_digits(src)
        open(marker, "w").close()
    comm.barrier()
    stores = []
    for part in ("train", "test"):
        dst = os.path.join(root, f"{part}.hpcdl")
        hpcdl.store.pack(os.path.join(src, part), dst, comm=comm, force=True, progress=False)
        stores.append(hpcdl.store.Store(dst))
    log(
        f"packed the scikit-learn digits into {stores[0].root} ({len(stores[0])} samples) "
        f"and {stores[1].root} ({len(stores[1])})"
    )
    return tuple(stores)


def decode(view):
    """One sample (.npy bytes) as a flat float32 vector."""
    return np.load(io.BytesIO(view.tobytes())).reshape(-1).astype(np.float32)


def make_prefetcher(store, args, comm=MPI.COMM_WORLD):
    """The prefetcher over the training store for the whole run: global batch =
    --batch-size x ranks, disk tier in --cache-dir (default $HPCDL_SCRATCH, set by slurm/job-env.sh)."""
    cache_dir = args.cache_dir or os.environ.get("HPCDL_SCRATCH")
    if len(store) < args.batch_size * comm.Get_size():
        sys.exit(
            f"[hpcdl rank {comm.Get_rank()}] {len(store)} samples are too few for "
            f"{comm.Get_size()} ranks x batch {args.batch_size}"
        )
    return Prefetcher(
        store,
        batch_size=args.batch_size * comm.Get_size(),
        epochs=args.epochs,
        seed=args.seed,
        comm=comm,
        ram_bytes=args.ram_mib << 20,
        disk_dir=cache_dir,
        disk_bytes=(args.disk_mib << 20) if cache_dir else 0,
    )


def feature_count(store):
    return decode(np.frombuffer(store[0], dtype=np.uint8)).size


def evaluate(store, predict, comm=MPI.COMM_WORLD, batch_size=64):
    """(correct, count) of predict(x) -> class numbers on this rank's share of the held-out store."""
    correct = count = 0
    mine = np.arange(comm.Get_rank(), len(store) if store is not None else 0, comm.Get_size())
    for start in range(0, len(mine), batch_size):
        indices = mine[start : start + batch_size]
        data, offsets = store.read_many(indices)
        x = np.stack([decode(data[offsets[k] : offsets[k + 1]]) for k in range(len(indices))])
        correct += int(np.sum(np.asarray(predict(x)) == store.labels[indices]))
        count += len(indices)
    return correct, count


def codec_text(text):
    """--compression's type: the codec's canonical text, read by hpcdl's own parser (argparse
    reports its ValueError as an invalid value)."""
    import hpcdl.compression as codecs

    return str(codecs.from_text(text))


def compression_codec(text):
    """The hpcdl.compression codec that --compression names (None: dense)."""
    import hpcdl.compression as codecs

    codec = codecs.from_text(text)
    return codec if codec.canonical() else None


def add_common_arguments(parser):
    parser.add_argument(
        "--data", help="a packed hpcdl store of .npy samples to train on (default: pack the scikit-learn digits)"
    )
    parser.add_argument("--test-data", help="a packed store of held-out samples (with --data; default: none)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="the prefetcher's shuffle and the model's init")
    parser.add_argument(
        "--compression",
        type=codec_text,
        default="none",
        help="gradient codec as hpcdl.compression.from_text reads it: none, fp16, bf16, int8, "
        "topk, or with settings, e.g. 'int8(block=64)', 'topk(ratio=0.05)'",
    )
    parser.add_argument("--ram-mib", type=int, default=256, help="prefetcher RAM tier per rank")
    parser.add_argument(
        "--cache-dir",
        help="node-local directory for the prefetcher's disk tier (default: $HPCDL_SCRATCH if set, else no disk tier)",
    )
    parser.add_argument("--disk-mib", type=int, default=1024, help="prefetcher disk tier per rank")
    parser.add_argument(
        "--metrics", help="rank 0 appends each epoch's figures, unrounded, to this file (one JSON object a line)"
    )


def gradient_traffic():
    """(bytes sent, dense bytes) of this rank's allreduces since the last call."""
    rows = hpcdl.stats(reset=True).get("allreduce", {}).values()
    return sum(r["bytes_sent"] for r in rows), sum(r["dense_bytes"] for r in rows)


class EpochReport:
    """Per-epoch figures summed over the ranks and printed by rank 0: loss,
    accuracy, samples/s, the prefetcher's stall time, gradient bytes vs dense."""

    def __init__(self, comm, prefetcher, metrics=None):
        self.comm, self.prefetcher, self.metrics = comm, prefetcher, metrics
        self.stalled = prefetcher.stats()["stall_seconds"]
        gradient_traffic()

    def __call__(self, epoch, seconds, samples, loss_sum, correct, test_correct, test_count):
        stalled = self.prefetcher.stats()["stall_seconds"]
        stall, self.stalled = stalled - self.stalled, stalled
        sent, dense = gradient_traffic()
        totals = self.comm.allreduce(
            np.array([samples, loss_sum, correct, test_correct, test_count, sent, dense], dtype=np.float64)
        )
        stall_max = self.comm.allreduce(stall, op=MPI.MAX)
        seconds = self.comm.allreduce(seconds, op=MPI.MAX)
        samples, loss_sum, correct, test_correct, test_count, sent, dense = totals
        figures = {
            "epoch": epoch,
            "loss": loss_sum / samples,
            "train_acc": correct / samples,
            "test_acc": ratio(test_correct, test_count),
            "samples_per_s": rate(samples, seconds),
            "stall_s": stall_max,
            "stall_fraction": ratio(stall_max, seconds),
            "grad_bytes_sent": sent,
            "grad_bytes_dense": dense,
        }
        log(
            f"epoch {epoch:3d}  loss {figures['loss']:.4f}  train acc {figures['train_acc']:.3f}  "
            f"test acc {show(figures['test_acc'], '.3f', 'n/a')}  {show(figures['samples_per_s'], '8.0f')} "
            f"samples/s  stall {stall_max:.3f} s ({show(figures['stall_fraction'], '.1%')})  "
            f"grad bytes sent {sent / 1e6:.2f} MB vs dense {dense / 1e6:.2f} MB "
            f"({show(ratio(dense, sent), '.2f', '1.00')}x fewer)"
        )
        if self.metrics and self.comm.Get_rank() == 0:
            with open(self.metrics, "a") as fh:
                fh.write(json.dumps(figures) + "\n")
        return figures["test_acc"]

    def summary(self):
        stats = self.prefetcher.stats()
        log(f"prefetcher on rank 0: hits {stats['hits']}, stall {stats['stall_seconds']:.3f} s in total")
