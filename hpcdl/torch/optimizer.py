"""PyTorch gradients averaged over the ranks: DistributedOptimizer, the broadcasts and a DDP hook.

Nothing here is compiled against torch: tensors become numpy views
(``Tensor.numpy()`` shares memory with a CPU tensor) and go through hpcdl's one
buffer intake. CUDA gradients are copied into host buffers (pinned when CUDA is
available) and back, since the core reduces host memory.

``import torch`` below is an absolute import and binds the real PyTorch, not
the package hpcdl.torch.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from mpi4py import MPI

import hpcdl
from hpcdl._agree import check_same_on_all_ranks

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "ddp_comm_hook"]

DEFAULT_BUCKET_BYTES = 4 << 20
_BROADCASTABLE = {getattr(torch, name): name for name in hpcdl.DTYPES}  # the core's types, torch's names
_REDUCIBLE = {t: name for t, name in _BROADCASTABLE.items() if t.is_floating_point}  # gradients


def _numpy_view(tensor):
    """A zero-copy numpy view of a contiguous CPU tensor and the dtype name for the core.

    bfloat16 has no numpy type: its bits go as int16 with dtype="bfloat16".
    """
    flat = tensor.detach()
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy(), "bfloat16"
    return flat.numpy(), None


def _optional(compression):
    """compression= goes to the core only when the user asked for a codec."""
    return {} if compression is None else {"compression": compression}


class _Bucket:
    """Gradients of several parameters of one dtype, fused into one flat host buffer."""

    def __init__(self, index, name, dtype, slots):
        self.index = index
        self.name = name
        self.slots = slots                  # [(param, offset, numel)]
        numel = sum(n for _, _, n in slots)
        pin = torch.cuda.is_available() and any(p.is_cuda for p, _, _ in slots)
        self.flat = torch.zeros(numel, dtype=dtype, pin_memory=pin)
        self.array, self.core_dtype = _numpy_view(self.flat)
        self.filled = set()                 # params whose gradient is in the buffer
        self.handle = None

    def view(self, offset, numel, param):
        return self.flat[offset:offset + numel].view(param.shape)


class _DistributedOptimizerMixin:
    """Methods of the class DistributedOptimizer() builds over the user's optimizer class."""

    def _hpcdl_setup(self, named_parameters, compression, bucket_bytes, op, backward_passes_per_step,
                     comm, name):
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self._compression = compression
        self._op = op
        self.backward_passes_per_step = int(backward_passes_per_step)
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        named = self._named(named_parameters, params)
        check_same_on_all_ranks(
            self._comm, [(n, p.shape, p.dtype) for n, p in named], "the parameters of DistributedOptimizer",
            {"bucket_bytes": int(bucket_bytes), "op": op, "name": name,
             "backward_passes_per_step": self.backward_passes_per_step,
             "compression": None if compression is None else repr(compression)})
        self._buckets = self._make_buckets(named, int(bucket_bytes), name)
        self._bucket_of = {p: (b, off, n) for b in self._buckets for p, off, n in b.slots}
        self._passes = {p: 0 for _, p in named}
        self._lock = threading.Lock()
        self._round_open = False            # this step's bucket allreduces are submitted
        self._synchronized = False
        self._last_timings = []
        self._hook_handles = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]

    @staticmethod
    def _named(named_parameters, params):
        if named_parameters is None:
            return [(f"param.{i}", p) for i, p in enumerate(params)]
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        names = [n for n, _ in named]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"named_parameters has duplicate names: {duplicates}")
        given = {p for _, p in named}
        unnamed = sum(1 for p in params if p not in given)
        if unnamed:
            raise ValueError(f"{unnamed} parameters of the optimizer are missing from named_parameters "
                             "(pass model.named_parameters() of the model the optimizer trains)")
        in_optimizer = set(params)
        return [(n, p) for n, p in named if p in in_optimizer]

    def _make_buckets(self, named, bucket_bytes, name):
        """Reverse registration order (the order backward produces gradients), one dtype per
        bucket, a new bucket once bucket_bytes is reached: the same on every rank."""
        open_slots, buckets = {}, []

        def close(dtype):
            slots = open_slots.pop(dtype)
            buckets.append(_Bucket(len(buckets), f"{name}.bucket.{len(buckets)}", dtype, slots))

        for pname, p in reversed(named):
            if p.dtype not in _REDUCIBLE:
                raise TypeError(f"parameter '{pname}' has dtype {p.dtype}; hpcdl reduces "
                                f"{', '.join(str(t) for t in _REDUCIBLE)}")
            slots = open_slots.setdefault(p.dtype, [])
            offset = sum(n for _, _, n in slots)
            slots.append((p, offset, p.numel()))
            if (offset + p.numel()) * p.element_size() >= bucket_bytes:
                close(p.dtype)
        for dtype in list(open_slots):
            close(dtype)
        return buckets

    def _on_grad(self, param):
        """Autograd hook: the gradient of param is complete for this backward pass."""
        with self._lock:
            self._synchronized = False
            self._passes[param] += 1
            if self._passes[param] < self.backward_passes_per_step:
                return
            bucket, offset, numel = self._bucket_of[param]
            if param in bucket.filled or (bucket.handle is not None and bucket.handle.ready()):
                raise RuntimeError(
                    f"a gradient was computed {self._passes[param]} times before step() with "
                    f"backward_passes_per_step={self.backward_passes_per_step}: call step() (or "
                    "synchronize()) after each group of backward passes, or raise backward_passes_per_step")
            if not self._round_open:
                self._open_round()
            with torch.no_grad():
                bucket.view(offset, numel, param).copy_(param.grad)
            bucket.filled.add(param)
            if len(bucket.filled) == len(bucket.slots):
                bucket.handle.mark_ready()

    def _open_round(self):
        """First gradient of the step: submit every bucket's allreduce deferred, so the
        ranks agree on them while backward still computes; each one's data moves as
        soon as its bucket is full. Buckets that backward leaves incomplete go at its
        end (unused parameters), so none waits for step() while the user's code
        between backward and step() might wait on other hpcdl operations."""
        for bucket in self._buckets:
            bucket.handle = self._submit(bucket, deferred=True)
        self._round_open = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self):
        """End of the backward pass that completed the step's gradients: the
        allreduce finishes here, so .grad holds the averaged gradients when
        backward() returns, for whatever reads them before step(): GradScaler's
        unscale_ and its inf check (then the same on every rank), gradient
        clipping. step() itself then only steps."""
        self.synchronize()

    def _release_incomplete(self):
        """Announced buckets that are not full go as they are (under self._lock)."""
        for bucket in self._buckets:
            if bucket.handle is not None and not bucket.handle.ready():
                self._fill_missing(bucket)
                bucket.handle.mark_ready()

    @staticmethod
    def _fill_missing(bucket):
        """Parameters whose hook did not fire contribute their current .grad, or zeros."""
        with torch.no_grad():
            for p, offset, numel in bucket.slots:
                if p not in bucket.filled:
                    slot = bucket.view(offset, numel, p)
                    slot.copy_(p.grad) if p.grad is not None else slot.zero_()

    def _submit(self, bucket, deferred):
        return hpcdl.allreduce_async(bucket.array, op=self._op, comm=self._comm, name=bucket.name,
                                     dtype=bucket.core_dtype, deferred=deferred, **_optional(self._compression))

    def synchronize(self):
        """Finish the gradient allreduce of this step (the end of backward does;
        step() does when no backward ran). Does nothing when the gradients are
        already reduced and no backward ran since.

        Every bucket runs on every rank every step. A parameter whose hook did
        not fire this step contributes its current .grad, or zeros when it has
        none, and ends with the reduced gradient in .grad like the others.
        """
        with self._lock:
            if self._synchronized:
                return
            self._release_incomplete()  # backward raised before its end
            for bucket in self._buckets:
                if bucket.handle is None:  # no backward this step
                    self._fill_missing(bucket)
                    bucket.handle = self._submit(bucket, deferred=False)
            timings = []
            with torch.no_grad():
                # Each bucket is unpacked as soon as it is reduced, while the
                # engine still moves the later ones.
                for bucket in self._buckets:
                    bucket.handle.wait()
                    timings.append(dict(bucket.handle.timings(), name=bucket.name))
                    for p, offset, numel in bucket.slots:
                        reduced = bucket.view(offset, numel, p)
                        if p.grad is None:
                            p.grad = reduced.to(p.device, copy=True)
                        else:
                            p.grad.copy_(reduced)
                    bucket.handle = None
                    bucket.filled.clear()
            for p in self._passes:
                self._passes[p] = 0
            self._round_open = False
            self._last_timings = timings
            self._synchronized = True

    def step(self, closure=None):
        """Average the gradients over all ranks (unless synchronize() already did), then step."""
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return self._base_class.step(self, closure)

    def bucket_layout(self):
        """[(bucket name, dtype, [parameter shapes])]: the fusion plan, in launch order."""
        return [(b.name, str(b.flat.dtype), [tuple(p.shape) for p, _, _ in b.slots]) for b in self._buckets]

    def last_timings(self):
        """Per bucket of the last synchronize(): name and wall-clock microseconds
        submitted_us (announced, when backward began) / agreed_us / ready_us
        (bucket full) / started_us (data moving) / finished_us (the clock of
        time.time())."""
        return list(self._last_timings)

    def remove_hooks(self):
        """Detach from the parameters' autograd hooks (the wrapper stops reducing)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, bucket_bytes=DEFAULT_BUCKET_BYTES,
                         op="average", backward_passes_per_step=1, comm=None, name="torch"):
    """Wrap a torch optimizer so step() applies the gradients averaged over all ranks.

    Returns an instance of a subclass of the optimizer's class that shares the
    original's parameter groups and state (so LR schedulers, state_dict() and
    isinstance checks work). Per-parameter hooks copy each finished gradient
    into a fusion bucket; a bucket's allreduce starts as soon as its last
    gradient is in, overlapping the rest of the backward pass.

    named_parameters: model.named_parameters(); names identify the buckets'
        contents across ranks and appear in error messages. Checked at
        construction: a model that differs across ranks raises MismatchError on
        every rank.
    compression: a codec from hpcdl.compression (None: dense). Bucket operations
        are named "{name}.bucket.{i}", so error feedback follows each bucket.
    bucket_bytes: a bucket is closed once it holds this many bytes.
    op: "average" (default) or "sum".
    backward_passes_per_step: gradients accumulate locally over this many
        backward passes; the allreduce starts on the last one.
    comm: the mpi4py communicator (default COMM_WORLD).
    name: prefix of the bucket names; give two wrapped optimizers different ones.
    """
    mixin = dict(_DistributedOptimizerMixin.__dict__)
    for key in ("__dict__", "__weakref__"):
        mixin.pop(key, None)
    cls = type(f"Distributed{type(optimizer).__name__}", (type(optimizer),), mixin)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # shares param_groups, state and hooks
    wrapped.optimizer = optimizer
    wrapped._base_class = type(optimizer)
    wrapped._hpcdl_setup(named_parameters, compression, bucket_bytes, op, backward_passes_per_step, comm, name)
    return wrapped


def _named_tensors(params):
    if isinstance(params, dict):
        return list(params.items())
    params = list(params)
    if params and isinstance(params[0], tuple):
        return params
    return [(f"tensor.{i}", p) for i, p in enumerate(params)]


def broadcast_parameters(params, root_rank=0, comm=None):
    """Copy rank ``root_rank``'s tensors into every rank's, in place.

    params: model.state_dict() (parameters and buffers), model.named_parameters(),
    or a list of tensors. Names, shapes and dtypes are checked across ranks first.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    named = _named_tensors(params)
    check_same_on_all_ranks(comm, [(n, t.shape, t.dtype) for n, t in named], "the tensors to broadcast",
                            {"root_rank": int(root_rank)})
    pending = []
    for name, tensor in named:
        host = tensor.detach()
        staged = host.is_cuda or not host.is_contiguous()  # broadcast a host copy, then copy back
        if staged:
            host = host.cpu().contiguous()
        handle = None
        if host.dtype in _BROADCASTABLE:
            array, dtype = _numpy_view(host)
            handle = hpcdl.broadcast_async(array, root=root_rank, comm=comm, name=f"torch.broadcast.{name}",
                                           dtype=dtype)
        else:  # bool, uint8, int8...: the same bytes, through MPI directly
            comm.Bcast(host.view(-1).view(torch.uint8).numpy(), root=root_rank)
        pending.append((tensor, host, staged, handle))
    for tensor, host, staged, handle in pending:
        if handle is not None:
            handle.wait()
        if staged:
            with torch.no_grad():
                tensor.copy_(host)


def broadcast_optimizer_state(optimizer, root_rank=0, comm=None):
    """Give every rank rank ``root_rank``'s optimizer state and hyperparameters.

    One pickled broadcast of state_dict() (a one-time cost at start or after
    loading a checkpoint on the root), then load_state_dict() on the others.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    state = comm.bcast(optimizer.state_dict() if comm.Get_rank() == root_rank else None, root=root_rank)
    if comm.Get_rank() != root_rank:
        optimizer.load_state_dict(state)


_ddp_waiter = {"pool": None}


def ddp_comm_hook(state, bucket):
    """DistributedDataParallel communication hook: DDP's gradient buckets go through hpcdl.

        model = DistributedDataParallel(model)           # any process group (gloo)
        model.register_comm_hook({"compression": None}, hpcdl.torch.ddp_comm_hook)

    state: None or a dict with optional "compression" (an hpcdl.compression
    codec) and "comm" (mpi4py communicator). Gradients are averaged.
    """
    state = state or {}
    buffer = bucket.buffer()
    host = buffer if not buffer.is_cuda else buffer.cpu()
    array, dtype = _numpy_view(host)
    handle = hpcdl.allreduce_async(array, op="average", comm=state.get("comm"),
                                   name=f"ddp.bucket.{bucket.index()}", dtype=dtype,
                                   **_optional(state.get("compression")))
    future = torch.futures.Future()

    def finish():
        try:
            handle.wait()
            future.set_result(buffer.copy_(host) if host is not buffer else buffer)
        except Exception as exc:  # noqa: BLE001 - handed to DDP through the future
            future.set_exception(exc)

    if _ddp_waiter["pool"] is None:
        _ddp_waiter["pool"] = ThreadPoolExecutor(1, thread_name_prefix="hpcdl-ddp")
    _ddp_waiter["pool"].submit(finish)
    return future
