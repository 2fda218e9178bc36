"""DLIO data-loader plugin: DLIO's training loop served from an hpcdl store
through the clairvoyant prefetcher (docs/dlio.md).

    hpcdl pack /data/unet3d/train /data/unet3d/train.hpcdl
    mpiexec -n 4 dlio_benchmark workload=unet3d_v100 ++workload.dataset.data_folder=/data/unet3d \\
        ++workload.reader.data_loader_classname=hpcdl.contrib.dlio.HpcdlDataLoader \\
        ++workload.reader.data_loader_sampler=none

DLIO keeps its own batch size (per rank), epochs, seed, rank layout and
metrics; this loader only replaces how samples reach the training loop. Each
DLIO file is one sample of the store (num_samples_per_file must be 1), packed
from ``DATA_FOLDER/train`` into ``DATA_FOLDER/train.hpcdl`` (``valid`` likewise
when DLIO evaluates). Settings DLIO's config has no key for come from the
environment:

    HPCDL_DLIO_TRAIN_STORE, HPCDL_DLIO_VALID_STORE   store paths (defaults above)
    HPCDL_DLIO_RAM          RAM tier per rank (default 1G)
    HPCDL_DLIO_DISK_DIR     node-local directory for the disk tier (default: none)
    HPCDL_DLIO_DISK         disk tier bytes per rank (default: off)
    HPCDL_DLIO_THREADS      staging threads per rank (default max(4, reader.read_threads))
    HPCDL_DLIO_READ_CONCURRENCY  store spans read at once per rank (default auto; 0: no limit)
    HPCDL_DLIO_PACK=1       pack DLIO's files into the store when it is missing (collective,
                            after DLIO generated them: one invocation generates, packs, trains)

Each rank writes ``OUTPUT_FOLDER/hpcdl_<train|valid>_rank<R>.json`` when its
last epoch is done: the sample indices it delivered per epoch and the
prefetcher's stats (hits and bytes per tier, stall seconds).
"""

import json
import os
import sys

try:
    from dlio_benchmark.common.enumerations import DataLoaderType, DatasetType
    from dlio_benchmark.data_loader.base_data_loader import BaseDataLoader
    from dlio_benchmark.utils.utility import DLIOMPI
except ImportError as exc:  # the plugin is only meaningful inside DLIO
    raise ImportError(
        "hpcdl.contrib.dlio needs DLIO: pip install --no-deps -r requirements-dlio.txt "
        f"(scripts/bootstrap.sh does it) [{exc}]"
    ) from exc

from hpcdl import _env
from hpcdl._agree import call_on_every_rank, waited_allgather
from hpcdl.prefetch import DEFAULT_RAM_BYTES, Prefetcher
from hpcdl.store import MANIFEST, Store, pack

__all__ = ["HpcdlDataLoader", "evaluation_passes"]


def evaluation_passes(epochs, eval_after_epoch, epochs_between_evals):
    """How many times DLIO's run() evaluates: at epochs after, after + between, ... <= epochs."""
    if eval_after_epoch > epochs:
        return 0
    return (epochs - eval_after_epoch) // max(epochs_between_evals, 1) + 1


class HpcdlDataLoader(BaseDataLoader):
    """A DLIO data loader (``data_loader_classname``) reading an hpcdl store.

    DLIO calls read() once before the first epoch, next() once per epoch (it
    stops after floor(N / batch / ranks) steps) and finalize() after every
    epoch; the prefetcher spans the whole run, so later epochs come from the
    tiers the first one filled.
    """

    def __init__(self, format_type, dataset_type, epoch):
        super().__init__(format_type, dataset_type, epoch, DataLoaderType.CUSTOM)
        self.kind = "train" if dataset_type is DatasetType.TRAIN else "valid"
        self.prefetcher = None
        self.epochs = []  # the prefetcher's epochs, one per DLIO pass over this set
        self.delivered = []  # per epoch: the sample indices this rank handed to DLIO
        self.epoch_stalls = []  # per epoch: seconds DLIO's loop waited for this rank's prefetcher
        self.passes = 0
        self.passes_done = 0

    def _passes(self):
        """How many times DLIO's run() iterates this set."""
        args = self._args
        if self.kind == "train":
            return args.epochs
        return evaluation_passes(args.epochs, args.eval_after_epoch, args.epochs_between_evals) if args.do_eval else 0

    def _store_path(self):
        """Where this set's store is; raises on settings this loader cannot serve."""
        args = self._args
        if args.num_samples_per_file != 1:
            raise ValueError(
                f"hpcdl's DLIO loader serves one sample per file (each file is a store sample); "
                f"num_samples_per_file is {args.num_samples_per_file}"
            )
        default = os.path.join(args.data_folder, f"{self.kind}.hpcdl")
        return _env.get(f"HPCDL_DLIO_{self.kind.upper()}_STORE", default)

    def _open(self, path):
        """The store, checked against DLIO's set, and the prefetcher's tier settings."""
        args = self._args
        if not os.path.exists(os.path.join(path, MANIFEST)):
            raise FileNotFoundError(
                f"no hpcdl store at {path}: pack DLIO's files first "
                f"(hpcdl pack {os.path.join(args.data_folder, self.kind)} {path})"
            )
        store = Store(path)
        if len(store) != self.num_samples:
            raise ValueError(
                f"the store {path} holds {len(store)} samples but DLIO's {self.kind} set has "
                f"{self.num_samples} (num_files_{'train' if self.kind == 'train' else 'eval'})"
            )
        tiers = {
            "ram_bytes": _env.get("HPCDL_DLIO_RAM", DEFAULT_RAM_BYTES),
            "disk_dir": _env.get("HPCDL_DLIO_DISK_DIR") or None,
            "disk_bytes": _env.get("HPCDL_DLIO_DISK", 0),
            "staging_threads": _env.get("HPCDL_DLIO_THREADS", max(4, args.read_threads)),
            "read_concurrency": _env.get("HPCDL_DLIO_READ_CONCURRENCY", "auto"),
        }
        return store, tiers

    def read(self):
        """Once, before the first epoch: (pack,) open the store and start the prefetcher (collective)."""
        comm = DLIOMPI.get_instance().comm()
        self.passes = self._passes()
        self.delivered = [[] for _ in range(self.passes)]
        if not self.passes:
            return
        path = call_on_every_rank(comm, self._store_path)
        if _env.get("HPCDL_DLIO_PACK", False):
            packed = waited_allgather(
                comm, os.path.exists(os.path.join(path, MANIFEST)), "the check for a packed store"
            )
            if not all(packed):
                pack(os.path.join(self._args.data_folder, self.kind), path, comm=comm, progress=comm.Get_rank() == 0)
        store, tiers = call_on_every_rank(comm, self._open, path)
        # DLIO's batch_size is per rank; the prefetcher takes the global batch.
        self.prefetcher = Prefetcher(
            store, self.batch_size * comm.Get_size(), self.passes, self._args.seed, comm=comm, **tiers
        )
        self.epochs = self.prefetcher.epochs()
        if comm.Get_rank() == 0:
            print(
                f"[hpcdl rank 0] DLIO {self.kind}: {len(store)} samples from {store.root}, "
                f"{self.prefetcher.steps_per_epoch} steps of {self.batch_size} per rank, {self.passes} "
                f"epoch(s), RAM tier {tiers['ram_bytes'] >> 20} MiB/rank",
                file=sys.stderr,
                flush=True,
            )

    def next(self):
        """One epoch's batches (Batch objects: zero-copy views, valid until the next one)."""
        if self.passes_done >= len(self.epochs):
            raise RuntimeError(
                f"[hpcdl rank {self._args.my_rank}] DLIO asked for a {self.kind} epoch "
                f"that was not planned (read() not called, or the run is over)"
            )
        # An epoch DLIO left early (train.total_training_steps) is skipped by the next one.
        epoch = self.passes_done
        for batch in self.epochs[epoch]:
            self.delivered[epoch].extend(int(i) for i in batch.indices)
            yield batch

    def finalize(self):
        """After each epoch; the last one closes the prefetcher (collective) and writes the report."""
        if self.prefetcher is None:
            return
        stalled = self.prefetcher.stats()["stall_seconds"]
        self.epoch_stalls.append(stalled - sum(self.epoch_stalls))
        self.passes_done += 1
        if self.passes_done < self.passes:
            return
        pf, self.prefetcher = self.prefetcher, None
        self.epochs = []
        pf.close()
        report = {
            "rank": self._args.my_rank,
            "ranks": self._args.comm_size,
            "samples": len(pf.store),
            "batch_size": self.batch_size,
            "seed": self._args.seed,
            "steps_per_epoch": pf.steps_per_epoch,
            "delivered": self.delivered,
            "epoch_stall_seconds": self.epoch_stalls,
            "stats": pf.stats(),
        }
        path = os.path.join(self._args.output_folder, f"hpcdl_{self.kind}_rank{self._args.my_rank}.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(report, fh, default=_jsonable)
        os.replace(path + ".tmp", path)


def _jsonable(value):
    """numpy scalars and arrays in the prefetcher's stats."""
    return value.tolist() if hasattr(value, "tolist") else str(value)
