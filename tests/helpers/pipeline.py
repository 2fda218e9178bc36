"""Models and training loops shared by the single-process and MPI pipeline tests."""

import torch
import torch.nn.functional as F

torch.set_num_threads(1)
LR = 0.3


def make_model(seed=0, width=16, blocks=4):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(12, width), torch.nn.Tanh()]
    for _ in range(blocks - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 5))


def batch(step, rows=16, replica=0):
    g = torch.Generator().manual_seed(1000 * replica + step)
    return torch.randn(rows, 12, generator=g), torch.randint(0, 5, (rows,), generator=g)


def train_single(steps, rows=16, replicas=1):
    """The reference: one process, the whole model, the replicas' batches concatenated."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        parts = [batch(step, rows, r) for r in range(replicas)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def train_pipeline(pipe, steps, rows=16, replica=0, optimizer=None):
    opt = optimizer or torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = batch(step, rows, replica)
        opt.zero_grad()
        losses.append(pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None))
        opt.step()
    return losses


def max_difference(pipe, reference):
    ref = dict(reference.named_parameters())
    return max((p - ref[n]).abs().max().item() for n, p in pipe.named_parameters())
