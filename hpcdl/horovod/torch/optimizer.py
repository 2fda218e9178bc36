"""Horovod's torch DistributedOptimizer, broadcast_parameters and broadcast_optimizer_state,
mapped onto hpcdl.torch's."""

import contextlib

import hpcdl.torch
from hpcdl.horovod import common
from hpcdl.horovod.common import Average, global_process_set
from hpcdl.horovod.torch.compression import Compression, codec


class _SkipSynchronize:
    """Horovod's skip_synchronize(), mixed into hpcdl's wrapped optimizer class."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        """step() inside this block does not synchronize: for code that called
        synchronize() itself (to clip or unscale the reduced gradients first).
        hpcdl's backward already ends with the gradients reduced, so step() would not
        reduce them again anyway; the block only makes it certain."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    def step(self, closure=None):
        if getattr(self, "_skip_synchronize", False):
            self._synchronized = False  # the next backward starts a new round, as after hpcdl's step()
            return self._base_class.step(self, closure)
        return super().step(closure)


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    compression=Compression.none,
    backward_passes_per_step=1,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    sparse_as_dense=False,
    process_set=global_process_set,
):
    """Horovod's DistributedOptimizer: hpcdl.torch.DistributedOptimizer over init()'s communicator
    (or ``process_set``'s).

    compression: Compression.none, Compression.fp16 (hpcdl's FP16 codec, float32
    gradients) or an hpcdl.compression codec. op: hvd.Average or hvd.Sum.
    gradient_predivide_factor: with op=Average the result is the average either
    way; Horovod divides before and after the sum to keep float16 sums in range,
    which hpcdl does not need (it sums float16 in float32). num_groups/groups:
    hpcdl fuses by size (hpcdl.torch.DistributedOptimizer's bucket_bytes), so
    anything but the defaults raises ValueError.
    """
    op_name = common.reduce_op(op, None)
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    common.check_default(
        "num_groups",
        num_groups,
        0,
        "hpcdl fuses gradients by size: use hpcdl.torch.DistributedOptimizer(bucket_bytes=...)",
    )
    common.check_default(
        "groups", groups, None, "hpcdl fuses gradients by size: use hpcdl.torch.DistributedOptimizer(bucket_bytes=...)"
    )
    wrapped = common.call(
        hpcdl.torch.DistributedOptimizer,
        optimizer,
        named_parameters,
        codec(compression),
        hpcdl.torch.DEFAULT_BUCKET_BYTES,
        op_name,
        backward_passes_per_step,
        common.comm_of(process_set),
        None,
        sparse_as_dense,
    )
    base = type(wrapped)
    wrapped.__class__ = type(base.__name__, (_SkipSynchronize, base), {})
    return wrapped


def _prefixed(params, prefix):
    if prefix is None:
        return params
    if isinstance(params, dict):
        return {f"{prefix}{name}": t for name, t in params.items()}
    params = list(params)
    return [(f"{prefix}{name}", t) for name, t in params] if params and isinstance(params[0], tuple) else params


def broadcast_parameters(params, root_rank, prefix=None, process_set=global_process_set):
    """Rank ``root_rank``'s tensors in every rank's (a state_dict, named_parameters() or a list),
    in place; ``prefix`` is put before the names that identify them across ranks.
    ``process_set`` (hpcdl's addition): among its ranks only, ``root_rank`` one of them."""
    common.call(
        hpcdl.torch.broadcast_parameters,
        _prefixed(params, prefix),
        common.root_in(process_set, root_rank),
        common.comm_of(process_set),
    )


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set):
    """Rank ``root_rank``'s optimizer state and hyperparameters on every rank (of ``process_set``,
    hpcdl's addition). hpcdl broadcasts the whole state_dict (state not yet created on some
    ranks included), so ``model``, which Horovod uses to create missing state first, is not needed."""
    common.call(
        hpcdl.torch.broadcast_optimizer_state,
        optimizer,
        common.root_in(process_set, root_rank),
        common.comm_of(process_set),
    )


__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state"]
