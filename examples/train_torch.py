"""Data-parallel PyTorch training with hpcdl: an MLP on the scikit-learn digits.

    mpiexec -n 4 python examples/train_torch.py --epochs 10 [--compression int8]

Samples come from an hpcdl store (the digits are packed into one when --data
is not given) through digits_data.epoch_batches; gradients are averaged by
hpcdl.torch.DistributedOptimizer, overlapping the backward pass. Rank 0 prints
per epoch: loss, accuracy, samples/s, stall time and gradient bytes sent vs dense.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import hpcdl  # noqa: E402
import hpcdl.torch  # noqa: E402
from digits_data import (add_common_arguments, compression_codec, epoch_batches, eval_batch_size, log, prepare_store,  # noqa: E402
                         report_epoch, split)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--bucket-bytes", type=int, default=hpcdl.torch.DEFAULT_BUCKET_BYTES)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    comm = hpcdl.init()

    store = prepare_store(args.data, comm)
    train_idx, test_idx = split(store)
    x0, _ = next(epoch_batches(store, train_idx, 1, 0, args.seed, comm))[:2]
    features, classes = x0.shape[1], max(len(store.classes), 2)

    torch.manual_seed(args.seed)  # the same on every rank; broadcast_parameters makes sure
    model = torch.nn.Sequential(torch.nn.Linear(features, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, classes))
    optimizer = hpcdl.torch.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), model.named_parameters(),
        compression=compression_codec(args.compression, args.int8_block, args.topk_ratio),
        bucket_bytes=args.bucket_bytes)
    hpcdl.torch.broadcast_parameters(model.state_dict(), root_rank=0)
    hpcdl.torch.broadcast_optimizer_state(optimizer, root_rank=0)
    log(f"{hpcdl.size()} ranks, {len(train_idx)} train / {len(test_idx)} test samples, {features} features, "
        f"{classes} classes, compression {args.compression}")
    hpcdl.stats(reset=True)

    for epoch in range(args.epochs):
        model.train()
        started = time.perf_counter()
        samples, loss_sum, correct, stall = 0, 0.0, 0, 0.0
        for x, y, waited in epoch_batches(store, train_idx, args.batch_size, epoch, args.seed, comm):
            x, y = torch.from_numpy(x), torch.from_numpy(y)
            optimizer.zero_grad()
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            samples += len(y)
            loss_sum += loss.item() * len(y)
            correct += int((logits.argmax(1) == y).sum())
            stall += waited
        seconds = time.perf_counter() - started
        model.eval()
        test_correct = test_count = 0
        with torch.no_grad():
            for x, y, _ in epoch_batches(store, test_idx, eval_batch_size(test_idx, comm), 0, args.seed, comm):
                test_correct += int((model(torch.from_numpy(x)).argmax(1) == torch.from_numpy(y)).sum())
                test_count += len(y)
        report_epoch(comm, epoch, seconds, samples, loss_sum, correct, stall, test_correct, test_count)


if __name__ == "__main__":
    main()
