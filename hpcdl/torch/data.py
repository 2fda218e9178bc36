"""The prefetcher as a PyTorch IterableDataset yielding decoded samples in
exactly the prefetcher's stream order.

    ds = hpcdl.torch.TorchDataset(pf, transform=decode)        # decode(bytes view) -> tensor
    loader = torch.utils.data.DataLoader(ds, batch_size=pf.local_batch, num_workers=0)

num_workers=0 is right: the prefetcher already reads on its own threads (GIL
released), and worker processes would each need their own prefetcher.
"""

import torch
from torch.utils.data import IterableDataset


class TorchDataset(IterableDataset):
    """(transform(sample), label) for every remaining sample of the run, in
    stream order. transform gets a uint8 numpy view valid only during the
    call (default: a copy as a uint8 tensor). epochs: how many epochs one
    iteration covers (None: the rest of the run), so `for epoch: for x, y in
    loader` works with epochs=1."""

    def __init__(self, prefetcher, transform=None, epochs=None):
        super().__init__()
        self.prefetcher = prefetcher
        self.transform = transform if transform is not None else (lambda view: torch.tensor(view))
        self.epochs = epochs

    def __len__(self):
        pf = self.prefetcher
        epochs = pf.num_epochs if self.epochs is None else self.epochs
        return epochs * pf.steps_per_epoch * pf.local_batch

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None and info.num_workers > 0:
            raise RuntimeError(
                "TorchDataset runs in the main process: use DataLoader(..., num_workers=0); "
                "the prefetcher already reads on its own threads"
            )
        for count, epoch in enumerate(self.prefetcher.epochs()):
            if self.epochs is not None and count >= self.epochs:
                return
            for batch in epoch:
                for view, label in batch:
                    yield self.transform(view), label
