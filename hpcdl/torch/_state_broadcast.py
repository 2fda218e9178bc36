"""broadcast_optimizer_state's way: the root's state_dict() travels as a small pickled
skeleton, and each of its tensors of more than _INLINE_BYTES by the engine's broadcast,
in place into a tensor every other rank allocates on its own device.

Pickling the whole state would put every byte of it (twice the parameters for Adam)
in one pickle on the root and in one receive buffer on every rank, would need MPI-4's
large counts past 2 GiB, and would unpickle a CUDA tensor onto the root's GPU index on
every rank (a CUDA context and memory on another rank's GPU) before load_state_dict
moved it. Horovod broadcasts the state tensor by tensor for the same reasons.
"""

from dataclasses import dataclass

import torch

import hpcdl
from hpcdl._agree import waited_bcast

_INLINE_BYTES = 4096  # a tensor up to a page (a step count, a small bias's moments) rides in the skeleton


@dataclass(frozen=True)
class _Hole:
    """Where the skeleton had a tensor: the index of its broadcast, with its value (a CPU
    copy) when it rides inline (small, sparse, or of a dtype hpcdl does not broadcast);
    on_cuda: the root's was on a GPU; param: the index of the parameter whose state it
    is (state_dict()["state"][param]), or None."""

    index: int
    shape: tuple
    dtype: torch.dtype
    on_cuda: bool
    param: object
    value: torch.Tensor | None = None


def broadcast_state(optimizer, state, root, comm, broadcastable, what):
    """The root's ``state`` (its optimizer.state_dict(); None elsewhere) on every rank, the
    root's object on the root. Elsewhere a tensor lands on this rank's device: the root's CUDA
    tensor on the device of the parameter it belongs to (else the current CUDA device), a CPU
    tensor on the CPU. Tensors of a dtype outside ``broadcastable`` ride inline."""
    rank = comm.Get_rank()
    sent = []
    skeleton = None
    if rank == root:
        skeleton = {
            key: (
                {param: _hollowed(entry, sent, param, broadcastable) for param, entry in value.items()}
                if key == "state" and isinstance(value, dict)
                else _hollowed(value, sent, None, broadcastable)
            )
            for key, value in state.items()
        }
    skeleton = waited_bcast(comm, skeleton, root, what)
    holes = []
    _collect_holes(skeleton, holes)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    filled, pending = {}, []
    for hole in holes:
        if rank != root:
            device = _device_of(hole, params)
            if hole.value is not None:
                filled[hole.index] = hole.value.to(device)
                continue
            filled[hole.index] = torch.empty(hole.shape, dtype=hole.dtype, device=device)
        elif hole.value is not None:
            continue
        buf = sent[hole.index] if rank == root else filled[hole.index]
        pending.append(hpcdl.broadcast_async(buf, root=root, comm=comm, name=f"torch.optimizer_state.{hole.index}"))
    for handle in pending:
        handle.wait()
    return state if rank == root else _filled(skeleton, filled)


def _hollowed(value, sent, param, broadcastable):
    """value with each tensor replaced by a _Hole; the tensors broadcast go to ``sent``."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
        index = len(sent)
        inline = (
            tensor.layout != torch.strided  # sparse: pickled as it is
            or tensor.dtype not in broadcastable
            or tensor.numel() * tensor.element_size() <= _INLINE_BYTES
        )
        sent.append(None if inline else tensor.contiguous())
        value = tensor.cpu().clone() if inline else None
        return _Hole(index, tuple(tensor.shape), tensor.dtype, tensor.is_cuda, param, value)
    if isinstance(value, dict):
        return {key: _hollowed(item, sent, param, broadcastable) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [_hollowed(item, sent, param, broadcastable) for item in value])
    return value


def _collect_holes(value, holes):
    if isinstance(value, _Hole):
        holes.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_holes(item, holes)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_holes(item, holes)


def _filled(value, tensors):
    if isinstance(value, _Hole):
        return tensors[value.index]
    if isinstance(value, dict):
        return {key: _filled(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return _rebuilt(value, [_filled(item, tensors) for item in value])
    return value


def _rebuilt(sequence, items):
    """A list or tuple of sequence's type holding items (a namedtuple takes them as arguments)."""
    return type(sequence)(*items) if hasattr(sequence, "_fields") else type(sequence)(items)


def _device_of(hole, params):
    if not hole.on_cuda:
        return torch.device("cpu")
    if isinstance(hole.param, int) and 0 <= hole.param < len(params) and params[hole.param].is_cuda:
        return params[hole.param].device
    return torch.device("cuda", torch.cuda.current_device())
