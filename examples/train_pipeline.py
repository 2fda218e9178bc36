"""Pipeline-parallel PyTorch training with hpcdl: an MLP on the scikit-learn digits,
cut into stages, one stage per rank; with fewer stages than ranks, a grid of
stages x replicas whose gradients hpcdl averages per stage.

    mpiexec -n 4 python examples/train_pipeline.py --stages 4 --schedule 1f1b
    mpiexec -n 4 python examples/train_pipeline.py --stages 2 --compression int8   # 2 stages x 2 replicas

The last stage of the first replica prints per epoch the mean loss and the
samples/s of the whole job; --save writes the whole model's state_dict (loadable
into the plain nn.Sequential) from the first stage.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits

import hpcdl
import hpcdl.torch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages P (default: every rank)")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--micro-batches", type=int, default=8, help="M per mini-batch")
    parser.add_argument("--batch", type=int, default=64, help="mini-batch per replica")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3, help="hidden Linear+ReLU blocks")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--compression",
        type=hpcdl.compression.from_text,
        default="none",
        help="codec of the per-stage gradient allreduce over the replicas, as "
        "hpcdl.compression.from_text reads it (none, fp16, bf16, int8, 'int8(block=64)', ...)",
    )
    parser.add_argument("--save", default=None, help="path of a checkpoint of the whole model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = hpcdl.init()

    digits = load_digits()
    x_all = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y_all = torch.tensor(digits.target)

    torch.manual_seed(args.seed)  # every rank builds the same whole model, then keeps its stage
    layers = [torch.nn.Linear(x_all.shape[1], args.hidden), torch.nn.ReLU()]
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10))

    pipe = hpcdl.torch.Pipeline(
        model, F.cross_entropy, args.micro_batches, schedule=args.schedule, stages=args.stages, comm=comm
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    replicas, replica = pipe.data_comm.Get_size(), pipe.data_comm.Get_rank()
    if replicas > 1:
        codec = args.compression if args.compression.canonical() else None
        optimizer = pipe.distributed_optimizer(optimizer, compression=codec)

    steps = len(x_all) // (args.batch * replicas)
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(args.seed + epoch))
        losses, start = [], time.perf_counter()
        for step in range(steps):
            first = (step * replicas + replica) * args.batch
            rows = order[first : first + args.batch]
            optimizer.zero_grad()
            loss = pipe.train_step(x_all[rows] if pipe.is_first else None, y_all[rows] if pipe.is_last else None)
            optimizer.step()
            losses.append(loss)
        seconds = time.perf_counter() - start
        if pipe.is_last and replica == 0:
            print(
                f"epoch {epoch}: loss {sum(losses) / len(losses):.4f}, "
                f"{steps * args.batch * replicas / seconds:.0f} samples/s "
                f"({pipe.stages} stages x {replicas} replicas, {args.schedule}, M={args.micro_batches})",
                flush=True,
            )

    state = pipe.full_state_dict()
    if args.save and replica == 0 and pipe.is_first:
        torch.save(state, args.save)
        print(f"saved the whole model to {args.save}", flush=True)


if __name__ == "__main__":
    main()
