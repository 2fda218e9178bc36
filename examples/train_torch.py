"""Data-parallel PyTorch training with hpcdl: an MLP on the scikit-learn digits.

    mpiexec -n 4 python examples/train_torch.py --epochs 10 [--compression int8]

Training samples come from an hpcdl store (the digits are packed into one when
--data is not given) through the clairvoyant prefetcher and its PyTorch
adapter (hpcdl.torch.TorchDataset in a DataLoader); gradients are averaged
by hpcdl.torch.DistributedOptimizer, overlapping the backward pass. Rank 0
prints per epoch: loss, accuracy, samples/s, stall time and gradient bytes
sent vs dense.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from digits_data import (
    EpochReport,
    add_common_arguments,
    compression_codec,
    decode,
    evaluate,  # noqa: E402
    feature_count,
    log,
    make_prefetcher,
    prepare_stores,
)

import hpcdl  # noqa: E402
import hpcdl.prefetch  # noqa: E402
import hpcdl.torch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--bucket-bytes", type=int, default=hpcdl.torch.DEFAULT_BUCKET_BYTES)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    comm = hpcdl.init()

    train, test = prepare_stores(args.data, args.test_data, comm)
    features, classes = feature_count(train), max(len(train.classes), 2)

    torch.manual_seed(args.seed)  # the same on every rank; broadcast_parameters makes sure
    model = torch.nn.Sequential(
        torch.nn.Linear(features, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, classes),
    )
    optimizer = hpcdl.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        model.named_parameters(),
        compression=compression_codec(args.compression),
        bucket_bytes=args.bucket_bytes,
    )
    hpcdl.torch.broadcast_parameters(model.state_dict(), root_rank=0)
    hpcdl.torch.broadcast_optimizer_state(optimizer, root_rank=0)

    with make_prefetcher(train, args, comm) as prefetcher:
        # one epoch per pass over the loader; the prefetcher stages the whole run ahead
        loader = torch.utils.data.DataLoader(
            hpcdl.torch.TorchDataset(prefetcher, transform=lambda view: torch.from_numpy(decode(view)), epochs=1),
            batch_size=prefetcher.local_batch,
        )
        log(
            f"{hpcdl.size()} ranks, {len(train)} train / {len(test) if test else 0} test samples, "
            f"{features} features, {classes} classes, compression {args.compression}, "
            f"{prefetcher.steps_per_epoch} steps of {prefetcher.local_batch} per rank and epoch"
        )
        report = EpochReport(comm, prefetcher, args.metrics)
        for epoch in range(args.epochs):
            model.train()
            started = time.perf_counter()
            samples, loss_sum, correct = 0, 0.0, 0
            for x, y in loader:
                optimizer.zero_grad()
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
                loss.backward()
                optimizer.step()
                samples += len(y)
                loss_sum += loss.item() * len(y)
                correct += int((logits.argmax(1) == y).sum())
            seconds = time.perf_counter() - started
            model.eval()
            with torch.no_grad():
                test_correct, test_count = evaluate(test, lambda x: model(torch.from_numpy(x)).argmax(1).numpy(), comm)
            report(epoch, seconds, samples, loss_sum, correct, test_correct, test_count)
        report.summary()


if __name__ == "__main__":
    main()
