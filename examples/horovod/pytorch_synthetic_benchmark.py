"""A Horovod PyTorch synthetic benchmark, run on hpcdl by changing only the import.

    mpiexec -n 2 python examples/horovod/pytorch_synthetic_benchmark.py --num-iters 3

Written as a Horovod script (``import hpcdl.horovod.torch as hvd`` where it said
``import horovod.torch as hvd``): a small convolutional network on random
images made on the fly (CPU), images per second per rank and in total.
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import hpcdl.horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch synthetic benchmark")
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="fp16 compression in allreduce")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size")
parser.add_argument("--image-size", type=int, default=32, help="input height and width")
parser.add_argument("--num-warmup-batches", type=int, default=2, help="warm-up batches, not timed")
parser.add_argument("--num-batches-per-iter", type=int, default=5, help="batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=5, help="benchmark iterations")
args = parser.parse_args()

hvd.init()
torch.manual_seed(42)
torch.set_num_threads(1)


class Net(torch.nn.Module):
    def __init__(self, classes=100):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc = torch.nn.Linear(32 * (args.image_size // 4) ** 2, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.randint(0, 100, (args.batch_size,))


def benchmark_step():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(data), target)
    loss.backward()
    optimizer.step()


def log(text):
    if hvd.rank() == 0:
        print(text, flush=True)


log(f"Model: Net, batch size {args.batch_size}, number of ranks {hvd.size()}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
rates = []
for i in range(args.num_iters):
    seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    rate = args.batch_size * args.num_batches_per_iter / seconds
    log(f"Iter #{i}: {rate:.1f} img/sec per rank")
    rates.append(rate)
mean = np.mean(rates)
spread = 1.96 * np.std(rates)
log(f"Img/sec per rank: {mean:.1f} +-{spread:.1f}")
log(f"Total img/sec on {hvd.size()} ranks: {hvd.size() * mean:.1f} +-{hvd.size() * spread:.1f}")
# every rank holds rank 0's weights after the run (the gradients were averaged)
with torch.no_grad():
    checksum = torch.tensor([sum(float(p.double().sum()) for p in model.parameters())], dtype=torch.float64)
differ = hvd.allreduce(torch.tensor([int(not torch.equal(checksum, hvd.broadcast(checksum, root_rank=0)))]), op=hvd.Sum)
log(f"Ranks whose weights differ from rank 0's: {int(differ.item())}")
