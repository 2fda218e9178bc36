"""PyTorch gradients averaged over the ranks: DistributedOptimizer, the broadcasts and a DDP hook.

Nothing here is compiled against torch: CPU tensors become numpy views
(``Tensor.numpy()`` shares memory with a CPU tensor) and go through hpcdl's one
tensor intake (hpcdl._tensors). CUDA gradients are gathered per bucket on the
device, encoded there when a codec shrinks them, and staged through pinned
host memory asynchronously (hpcdl.torch._buckets), since the core reduces host
memory.

``import torch`` below is an absolute import and binds the real PyTorch, not
the package hpcdl.torch.
"""

import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from mpi4py import MPI

import hpcdl
from hpcdl import _tensors
from hpcdl._agree import call_on_every_rank, check_same_on_all_ranks
from hpcdl.collectives import _joins_completed
from hpcdl.compression import PowerSGD
from hpcdl.torch import _buckets, powersgd
from hpcdl.torch._state_broadcast import broadcast_state

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "ddp_comm_hook"]

DEFAULT_BUCKET_BYTES = 4 << 20
DEFAULT_NAME = "torch"
_BROADCASTABLE = {getattr(torch, name): name for name in hpcdl.DTYPES}  # the core's types, torch's names
_REDUCIBLE = {t: name for t, name in _BROADCASTABLE.items() if t.is_floating_point}  # gradients

# Bucket names key error-feedback residuals: a name stays with one live optimizer
# per communicator. Default names are counted per communicator ("torch", "torch.1",
# ...), the same on every rank since construction is collective.
_names_in_use = {}  # (communicator, name) -> weakref to the optimizer holding it
_RESIDUALS_KEY = "hpcdl_residuals"  # state_dict()'s error-feedback residuals (codecs other than PowerSGD)
_defaults_given = {}  # communicator -> default names handed out


def _comm_key(comm):
    return MPI.Comm.py2f(comm)


def _name_for(comm, name):
    """(the name to use, whether a live optimizer on comm already holds it)."""
    key = _comm_key(comm)
    if name is None:
        count = _defaults_given.get(key, 0)
        _defaults_given[key] = count + 1
        name = DEFAULT_NAME if count == 0 else f"{DEFAULT_NAME}.{count}"
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    holder = _names_in_use.get((key, name))
    holder = holder() if holder is not None else None
    return name, holder is not None and bool(holder._hook_handles)


def _dense(pname, grad, sparse_as_dense):
    if grad.layout == torch.strided:
        return grad
    if sparse_as_dense:
        return grad.to_dense()
    raise TypeError(
        f"parameter '{pname}' has a sparse gradient ({grad.layout}); DistributedOptimizer "
        "allgathers sparse COO gradients and reduces dense ones: pass sparse_as_dense=True to "
        "densify it"
    )


class _DistributedOptimizerMixin:
    """Methods of the class DistributedOptimizer() builds over the user's optimizer class."""

    def _hpcdl_setup(
        self,
        named_parameters,
        compression,
        bucket_bytes,
        op,
        backward_passes_per_step,
        comm,
        name,
        sparse_as_dense,
        gradient_as_bucket_view,
    ):
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        if isinstance(compression, PowerSGD) and op != "average":
            raise ValueError(f"PowerSGD averages its factors: op must be 'average', got {op!r}")
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self._compression = compression
        self._op = op
        self._sparse_as_dense = bool(sparse_as_dense)
        self._grad_as_view = bool(gradient_as_bucket_view)
        self._bucket_bytes = int(bucket_bytes)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._hook_handles = []
        name, in_use = _name_for(self._comm, name)
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        named = self._named(named_parameters, params)
        check_same_on_all_ranks(
            self._comm,
            [(n, p.shape, p.dtype) for n, p in named],
            "the parameters of DistributedOptimizer",
            {
                "bucket_bytes": self._bucket_bytes,
                "op": op,
                "name": name,
                "name_in_use": in_use,
                "backward_passes_per_step": self.backward_passes_per_step,
                "sparse_as_dense": self._sparse_as_dense,
                "gradient_as_bucket_view": self._grad_as_view,
                "compression": None if compression is None else repr(compression),
            },
        )
        if in_use:
            raise ValueError(
                f"another DistributedOptimizer on this communicator is named '{name}' (bucket names "
                "key error-feedback residuals): give this one another name, leave name unset, or "
                "remove_hooks() of the other first"
            )
        self._name = name
        _names_in_use[(_comm_key(self._comm), name)] = weakref.ref(self)
        self._size = self._comm.Get_size()
        self._low_rank = powersgd.Schedule(compression) if isinstance(compression, PowerSGD) else None
        self._joins_seen = _joins_completed(self._comm)[0]  # PowerSGD shares its state after one
        self._lock = threading.Lock()
        self._buckets, self._bucket_of, self._passes, self._name_of = [], {}, {}, {}
        self._round_open = False  # this step's bucket allreduces are submitted
        self._sparse = {}  # param -> its sparse gradient's allgathers (indices, values) this step
        self._synchronized = False
        self._last_timings = []
        self._add_parameters(named)

    def _add_parameters(self, named):
        if self._low_rank is not None:
            buckets = powersgd.build_buckets(
                named,
                self._bucket_bytes,
                self._name,
                len(self._buckets),
                _REDUCIBLE,
                _tensors.staged,
                self._low_rank,
                self._size,
                self._grad_as_view,
            )
        else:
            buckets = _buckets.make_buckets(
                named,
                self._bucket_bytes,
                self._name,
                len(self._buckets),
                _REDUCIBLE,
                lambda i, bname, dtype, slots: _buckets.Bucket(
                    i,
                    bname,
                    dtype,
                    slots,
                    _tensors.staged(slots[0][0]),
                    self._compression,
                    self._size,
                    self._grad_as_view,
                ),
            )
        for bucket in buckets:  # a new optimizer starts from zero, not from a removed one's of the same name
            hpcdl.compression.free_residual(bucket.name, self._comm)
        self._buckets += buckets
        self._bucket_of.update((p, (b, off, n)) for b in buckets for p, off, n in b.slots)
        self._passes.update((p, 0) for _, p in named)
        self._name_of.update((p, n) for n, p in named)
        self._hook_handles += [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]

    def add_param_group(self, param_group):
        """torch's add_param_group; the new parameters are averaged like the others (new buckets,
        checked across ranks like the constructor's)."""
        if self._round_open:
            raise RuntimeError("add_param_group() during a backward pass: call it between steps")
        self._base_class.add_param_group(self, param_group)
        group = len(self.param_groups) - 1
        new = [p for p in self.param_groups[-1]["params"] if p.requires_grad and p not in self._bucket_of]
        named = [(f"param_group.{group}.{i}", p) for i, p in enumerate(new)]
        check_same_on_all_ranks(
            self._comm,
            [(n, p.shape, p.dtype) for n, p in named],
            "the parameters added to DistributedOptimizer",
            {"group": group},
        )
        self._add_parameters(named)

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
            raise ValueError(
                f"{unnamed} parameters of the optimizer are missing from named_parameters "
                "(pass model.named_parameters() of the model the optimizer trains)"
            )
        in_optimizer = set(params)
        return [(n, p) for n, p in named if p in in_optimizer]

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
                    "synchronize()) after each group of backward passes, or raise backward_passes_per_step"
                )
            gathered = param.grad.layout == torch.sparse_coo and not self._sparse_as_dense
            try:
                grad = None if gathered else _dense(self._name_of[param], param.grad, self._sparse_as_dense)
            except TypeError:
                self._abandon_round()  # every rank raises here (the same model): no operation is left waiting
                raise
            bucket.filled.add(param)
            if bucket.local:
                return
            if not self._round_open:
                self._open_round()
            if gathered:  # its slot in the bucket contributes zeros; synchronize() sets the gathered gradient
                self._sparse[param] = self._gather_sparse(param, param.grad)
            with torch.no_grad():
                bucket.put(offset, numel, param, grad)
            if len(bucket.filled) == len(bucket.slots):
                bucket.launch()
                if self._low_rank is not None:
                    self._low_rank.advance()

    def _gather_sparse(self, param, grad):
        """Start the allgathers of a sparse gradient's indices and values (Horovod's sparse
        path): every rank's entries, concatenated, are the sum of the gradients."""
        grad = grad.coalesce()
        name = f"{self._name}.sparse.{self._name_of[param]}"
        return (
            hpcdl.allgather_async(grad.indices().t().contiguous(), self._comm, f"{name}.indices"),
            hpcdl.allgather_async(grad.values().contiguous(), self._comm, f"{name}.values"),
        )

    def _finish_sparse(self):
        """The gathered sparse gradients into .grad (averaged: values / size), uncoalesced (under self._lock)."""
        for p, (indices, values) in self._sparse.items():
            gathered = values.wait()
            if self._op == "average":
                gathered = gathered / self._size
            p.grad = torch.sparse_coo_tensor(indices.wait().t(), gathered, p.shape, check_invariants=True)
        self._sparse.clear()

    def _open_round(self):
        """First gradient of the step: submit every bucket's allreduce deferred, so the
        ranks agree on them while backward still computes; each one's data moves as
        soon as its bucket is full. Buckets that backward leaves incomplete go at its
        end (unused parameters), so none waits for step() while the user's code
        between backward and step() might wait on other hpcdl operations."""
        for bucket in self._buckets:
            if not bucket.local:
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

    def _release_incomplete(self, zeros=False):
        """Announced buckets that are not full go as they are (under self._lock)."""
        for bucket in self._buckets:
            if bucket.handle is not None and not bucket.handle.ready() and bucket.launched is None:
                self._fill_missing(bucket, zeros)
                bucket.launch()

    def _abandon_round(self):
        """Finish this step's announced operations without touching any .grad (under self._lock)."""
        self._release_incomplete(zeros=True)
        for bucket in self._buckets:
            bucket.wait_launched()
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.end_step()
        for handles in self._sparse.values():
            for handle in handles:
                handle.wait()
        self._sparse.clear()
        for p in self._passes:
            self._passes[p] = 0
        self._round_open = False

    def _fill_missing(self, bucket, zeros=False):
        """Parameters whose hook did not fire contribute their current .grad, or zeros."""
        with torch.no_grad():
            for p, offset, numel in bucket.slots:
                if p not in bucket.filled:
                    if p.grad is None or zeros:
                        bucket.put(offset, numel, p, None)
                    else:
                        bucket.filled.add(p)
                        bucket.put(offset, numel, p, _dense(self._name_of[p], p.grad, self._sparse_as_dense))

    def _submit(self, bucket, deferred):
        if self._low_rank is not None and self._joins_seen != _joins_completed(self._comm)[0]:
            # The step's first bucket after a join: the ranks agree on PowerSGD's state again.
            self._joins_seen, last = _joins_completed(self._comm)
            self._low_rank.share(self._comm, last, self._name)
        return bucket.submit(self._op, self._comm, deferred)

    def _presence(self):
        """(the parameters some rank produced a gradient for this step, as a started int32
        allreduce, None on one rank; this rank's). A parameter no rank has a gradient for
        keeps .grad None."""
        params = list(self._passes)
        mine = np.array([p in self._bucket_of[p][0].filled for p in params], dtype=np.int32)
        handle = None
        if self._size > 1:
            handle = hpcdl.allreduce_async(mine, comm=self._comm, name=f"{self._name}.presence")
        return params, mine, handle

    def synchronize(self):
        """Finish the gradient allreduce of this step (the end of backward does;
        step() does when no backward ran). Does nothing when the gradients are
        already reduced and no backward ran since.

        Every bucket runs on every rank every step. A parameter whose hook did
        not fire this step contributes its current .grad, or zeros when it has
        none, and ends with the reduced gradient in .grad like the others; one
        that no rank has a gradient for (a frozen layer) keeps .grad None.
        """
        with self._lock:
            if self._synchronized:
                return
            self._release_incomplete()  # backward raised before its end
            for bucket in self._buckets:
                if bucket.handle is None and not bucket.local:  # no backward this step
                    bucket.handle = self._submit(bucket, deferred=True)  # (fixes the bucket's mode)
                    self._fill_missing(bucket)
                    bucket.launch()
            for bucket in self._buckets:
                bucket.wait_launched()
            if self._low_rank is not None:
                for bucket in self._low_rank.buckets:  # each Q moves while the next P is orthogonalized
                    bucket.exchange_q()
            params, present, presence = self._presence()
            timings, late = [], []
            with torch.no_grad():
                # Each bucket is unpacked as soon as it is reduced, while the
                # engine still moves the later ones; a parameter without a local
                # gradient waits for the ranks' presence counts.
                for bucket in self._buckets:
                    if not bucket.local:
                        bucket.handle.wait()
                        timings += bucket.timings()
                        for p, flat in bucket.results():
                            if p in self._sparse:
                                continue
                            if p in bucket.filled:
                                bucket.deliver(p, flat)
                            else:
                                late.append((bucket, p, flat))
                    bucket.end_step()
                if presence is not None:
                    presence.wait()
                    count = dict(zip(params, present))
                    for bucket, p, flat in late:
                        if count[p]:
                            bucket.deliver(p, flat)
                self._finish_sparse()
            for p in self._passes:
                self._passes[p] = 0
            self._round_open = False
            self._last_timings = timings
            self._synchronized = True
            if self._low_rank is not None:
                self._low_rank.steps += 1

    def state_dict(self):
        """The wrapped optimizer's state_dict(); with PowerSGD also its state under
        "hpcdl_powersgd": the steps reduced, and per compressed parameter name its Q (the
        same on every rank) and this rank's residual. With another codec, this rank's
        error-feedback residuals under "hpcdl_residuals": per bucket ("bucket.0", ...: its
        name without the optimizer's), its parameters' names in order ("params"), the
        engine's residual ("engine", float32) and, for a bucket encoded on its device, that
        one ("device"); a bucket without a residual yet is left out."""
        state = self._base_class.state_dict(self)
        if self._low_rank is not None:
            state["hpcdl_powersgd"] = self._low_rank.state_dict()
        elif self._compression is not None:
            state[_RESIDUALS_KEY] = {
                self._bucket_key(bucket): saved for bucket in self._buckets if (saved := self._bucket_residuals(bucket))
            }
        return state

    def _bucket_key(self, bucket):
        return bucket.name[len(self._name) + 1 :]

    def _bucket_params(self, bucket):
        return [self._name_of[p] for p, _, _ in bucket.slots]

    def _bucket_residuals(self, bucket):
        if bucket.local:
            return {}
        saved = {}
        engine = hpcdl.compression.residual(bucket.name, self._comm)
        if engine is not None:
            saved["engine"] = torch.from_numpy(engine)
        if bucket.encoder is not None:
            saved["device"] = bucket.residual.detach().clone()
        if saved:
            saved["params"] = self._bucket_params(bucket)
        return saved

    def load_state_dict(self, state_dict):
        """The wrapped optimizer's load_state_dict(); a PowerSGD state in it is loaded too (its
        codec settings, names and shapes checked: a mismatch raises ValueError). Residuals
        under "hpcdl_residuals" become this rank's, checked first: a bucket this optimizer
        lacks, other parameters in a bucket, a size that differs, or residuals for an
        optimizer without a codec raise ValueError; its buckets the state has none for
        start from zero. A state without "hpcdl_residuals" leaves the residuals as they are."""
        state_dict = dict(state_dict)
        low_rank = state_dict.pop("hpcdl_powersgd", None)
        residuals = state_dict.pop(_RESIDUALS_KEY, None)
        if residuals:  # an empty one (nothing compressed yet, or one rank) fits any optimizer
            self._check_residuals(residuals)
        self._base_class.load_state_dict(self, state_dict)
        if low_rank is not None and self._low_rank is not None:
            self._low_rank.load_state_dict(low_rank)
        if residuals is not None and self._compression is not None and self._low_rank is None:
            self._load_residuals(residuals)

    def _check_residuals(self, residuals):
        if self._compression is None or self._low_rank is not None:
            raise ValueError(
                f"the state holds error-feedback residuals ({_RESIDUALS_KEY!r}) but this optimizer runs "
                f"{'PowerSGD, whose state is its own' if self._low_rank is not None else 'no codec'}: "
                f"drop that key to start without them"
            )
        buckets = {self._bucket_key(bucket): bucket for bucket in self._buckets if not bucket.local}
        unknown = sorted(set(residuals) - set(buckets))
        if unknown:
            raise ValueError(
                f"the state has residuals of buckets this optimizer does not have: {unknown} (its "
                f"buckets: {sorted(buckets)}; the parameters and bucket_bytes must be the saver's)"
            )
        for name, saved in residuals.items():
            bucket = buckets[name]
            params = self._bucket_params(bucket)
            if saved.get("params") != params:
                raise ValueError(
                    f"the state's residuals of bucket '{name}' are of parameters {saved.get('params')}, "
                    f"this optimizer's bucket holds {params}"
                )
            numel = bucket.numel
            for kind, tensor in saved.items():
                if kind == "params":
                    continue
                if kind not in ("engine", "device") or (kind == "device" and bucket.encoder is None):
                    raise ValueError(f"the state's residuals of bucket '{name}' hold {kind!r}, which it does not keep")
                if tensor.numel() != numel:
                    raise ValueError(
                        f"the state's {kind} residual of bucket '{name}' has {tensor.numel()} values, not {numel}"
                    )

    def _load_residuals(self, residuals):
        for bucket in self._buckets:
            if bucket.local:
                continue
            saved = residuals.get(self._bucket_key(bucket), {})
            engine = saved.get("engine")
            values = np.zeros(bucket.numel, np.float32) if engine is None else engine.detach().to("cpu", torch.float32)
            hpcdl.compression.set_residual(bucket.name, np.asarray(values).reshape(-1), self._comm)
            if bucket.encoder is not None:
                with torch.no_grad():
                    device = saved.get("device")
                    if device is None:
                        bucket.residual.zero_()
                    else:
                        bucket.residual.copy_(device.reshape(-1))

    def step(self, closure=None):
        """Average the gradients over all ranks (unless synchronize() already did), then step."""
        if not self._synchronized:
            self.synchronize()
        self._synchronized = False
        return self._base_class.step(self, closure)

    def bucket_layout(self):
        """[(bucket name, dtype, [parameter shapes])]: the fusion plan, in launch order."""
        return [(b.name, str(b.dtype), [tuple(p.shape) for p, _, _ in b.slots]) for b in self._buckets]

    def last_timings(self):
        """Per bucket of the last synchronize(): name and wall-clock microseconds
        submitted_us (announced, when backward began) / agreed_us / ready_us
        (bucket full) / started_us (data moving) / finished_us (the clock of
        time.time()). A PowerSGD bucket past its warm-up has two: "{bucket}.P" and
        "{bucket}.Q"."""
        return list(self._last_timings)

    def remove_hooks(self):
        """Detach from the parameters' autograd hooks (the wrapper stops reducing)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []  # its name is free again


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    compression=None,
    bucket_bytes=DEFAULT_BUCKET_BYTES,
    op="average",
    backward_passes_per_step=1,
    comm=None,
    name=None,
    sparse_as_dense=False,
    gradient_as_bucket_view=False,
):
    """Wrap a torch optimizer so step() applies the gradients averaged over all ranks.

    Returns an instance of a subclass of the optimizer's class that shares the
    original's parameter groups and state (so LR schedulers, state_dict() and
    isinstance checks work). Per-parameter hooks copy each finished gradient
    into a fusion bucket; a bucket's allreduce starts as soon as its last
    gradient is in, overlapping the rest of the backward pass. A float32 CPU
    bucket with TopK copies nothing: the engine reduces each contiguous .grad
    in place, as a segment of the bucket (hpcdl.torch._buckets).

    named_parameters: model.named_parameters(); names identify the buckets'
        contents across ranks and appear in error messages. Checked at
        construction: a model that differs across ranks raises MismatchError on
        every rank.
    compression: a codec from hpcdl.compression (None: dense). Bucket operations
        are named "{name}.bucket.{i}", so error feedback follows each bucket.
        PowerSGD(rank, warmup_steps) sends low-rank factors of the gradient
        matrices (hpcdl.torch.powersgd; op must be "average"); its Q and
        residuals are part of state_dict().
    bucket_bytes: a bucket is closed once it holds this many bytes.
    op: "average" (default) or "sum".
    backward_passes_per_step: gradients accumulate locally over this many
        backward passes; the allreduce starts on the last one.
    comm: the mpi4py communicator (default COMM_WORLD).
    name: prefix of the bucket names (which key error-feedback residuals). Left
        unset, each wrapped optimizer on a communicator gets its own: "torch",
        "torch.1", ... in construction order. A name a live wrapped optimizer on
        the same communicator holds raises ValueError on every rank.
    sparse_as_dense: densify sparse gradients (torch.nn.Embedding(sparse=True))
        and reduce them with the others. Otherwise (Horovod's sparse path) a
        sparse COO gradient's indices and values are allgathered (named
        "{name}.sparse.{parameter}.indices/values") and .grad becomes the
        uncoalesced sparse sum (average: values / size); every rank must
        produce that gradient each step. Other sparse layouts raise TypeError.
    gradient_as_bucket_view: as DDP's: after each reduction a CPU parameter's
        .grad is its slot of the bucket (a view), so the reduced gradient is not
        copied back, and a .grad that backward accumulates into (zero_grad(
        set_to_none=False)) is not copied in either. zero_grad(set_to_none=True)
        (torch's default) drops the view: that step's gradient is copied in and
        .grad is the view again after the reduction. The gradients are the
        same bits as without it. TopK's float32 CPU buckets copy neither way
        with or without it (each .grad is reduced in place). CUDA (staged)
        buckets keep their copies, and
        PowerSGD's low-rank matrices get their approximation written into
        .grad anyway; only the fused dense bucket takes the view there.

    CUDA parameters: each bucket is gathered on the device, encoded there
    (FP16, BF16, Int8 with nearest rounding, TopK: hpcdl.torch.device_codecs)
    and copied to pinned host memory on a side stream once its gradients are
    complete; the ring starts when that copy landed, and the result is copied
    back asynchronously before the step. With one rank the gradients stay on
    the device untouched. A parameter that no rank produced a gradient for in a
    step (a frozen layer) keeps .grad None, as in DDP.
    """
    mixin = dict(_DistributedOptimizerMixin.__dict__)
    for key in ("__dict__", "__weakref__"):
        mixin.pop(key, None)
    cls = type(f"Distributed{type(optimizer).__name__}", (type(optimizer),), mixin)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # shares param_groups, state and hooks
    wrapped.optimizer = optimizer
    wrapped._base_class = type(optimizer)
    wrapped._hpcdl_setup(
        named_parameters,
        compression,
        bucket_bytes,
        op,
        backward_passes_per_step,
        comm,
        name,
        sparse_as_dense,
        gradient_as_bucket_view,
    )
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
    check_same_on_all_ranks(
        comm, [(n, t.shape, t.dtype) for n, t in named], "the tensors to broadcast", {"root_rank": int(root_rank)}
    )
    pending = []
    for name, tensor in named:
        target = tensor.detach()
        # hpcdl works in place: a non-contiguous tensor goes through a contiguous copy
        buf = target if target.is_contiguous() else target.contiguous()
        if buf.dtype not in _BROADCASTABLE:
            raise TypeError(
                f"parameter {name!r} has dtype {buf.dtype}, which hpcdl does not broadcast "
                f"(it takes {', '.join(hpcdl.DTYPES)})"
            )
        # CPU zero-copy, CUDA staged (hpcdl._tensors)
        pending.append(
            (target, buf, hpcdl.broadcast_async(buf, root=root_rank, comm=comm, name=f"torch.broadcast.{name}"))
        )
    for target, buf, handle in pending:
        handle.wait()
        if buf is not target:
            with torch.no_grad():
                target.copy_(buf)


def broadcast_optimizer_state(optimizer, root_rank=0, comm=None):
    """Give every rank rank ``root_rank``'s optimizer state and hyperparameters.

    The root's state_dict() goes out as a small pickled skeleton, and each of its
    tensors beyond a page by hpcdl's broadcast into a tensor the other ranks
    allocate on their own device (a CUDA tensor on its parameter's GPU), then
    load_state_dict() on the others (hpcdl/torch/_state_broadcast.py). With
    PowerSGD the step count and Q are the root's, but every rank keeps its own
    residuals: error feedback is per rank (the root's on every rank would be
    applied once per rank); so it does with the other codecs' residuals.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    mine = optimizer.state_dict() if comm.Get_rank() == root_rank else None
    if mine is not None:
        mine.pop(_RESIDUALS_KEY, None)  # the root's error feedback: every rank keeps its own
    what = f"broadcast_optimizer_state from rank {root_rank}"
    state = broadcast_state(optimizer, mine, root_rank, comm, _BROADCASTABLE, what)

    def load():
        if comm.Get_rank() == root_rank:
            return
        low_rank = getattr(optimizer, "_low_rank", None)
        if low_rank is not None and "hpcdl_powersgd" in state:
            state["hpcdl_powersgd"] = low_rank.with_own_residuals(state["hpcdl_powersgd"])
        optimizer.load_state_dict(state)

    # a rank whose optimizer does not take the root's state (other parameter groups) fails every rank
    call_on_every_rank(comm, load)


_ddp_waiter = {"pool": None}
# The residuals of "{name}.bucket.{i}" belong to one DDP model: the hook's state dict carries a token
# under this key. A state that starts using a name takes it over (the residuals are freed: the new model
# starts from zero, as a new DistributedOptimizer does); an earlier one stepping again after that means
# two live models compress under one name, and it raises on every rank before anything is sent.
_DDP_OWNER_KEY = "hpcdl_owner"
_ddp_names = {}  # (communicator, name) -> _DDPName


class _DDPOwner:
    """A hook state's identity (a dict cannot be weakly referenced)."""


class _DDPName:
    def __init__(self):
        self.owner = None
        self.retired = weakref.WeakSet()
        self.buckets = set()


def _claim_ddp_name(state, comm, name, bucket_index):
    owner = state.setdefault(_DDP_OWNER_KEY, _DDPOwner())
    use = _ddp_names.setdefault((_comm_key(comm), name), _DDPName())
    if use.owner is not owner:
        if owner in use.retired:
            raise ValueError(
                f"two DistributedDataParallel models use ddp_comm_hook with a codec under the name {name!r} "
                f"on one communicator: they would share error-feedback residuals; give each model its own "
                f'state dict with its own "name"'
            )
        if use.owner is not None:
            use.retired.add(use.owner)
        for index in use.buckets:
            hpcdl.compression.free_residual(f"{name}.bucket.{index}", comm)
        use.owner, use.buckets = owner, set()
    use.buckets.add(bucket_index)


def ddp_comm_hook(state, bucket):
    """DistributedDataParallel communication hook: DDP's gradient buckets go through hpcdl.

        model = DistributedDataParallel(model)           # any process group (gloo)
        model.register_comm_hook({"compression": None}, hpcdl.torch.ddp_comm_hook)

    state: None or a dict with optional "compression" (an hpcdl.compression
    codec), "comm" (mpi4py communicator) and "name" (default "ddp": bucket i is
    the operation "{name}.bucket.{i}", whose name keys a codec's error feedback,
    so two DDP models compressed in one process need a state dict and a name
    each: a model whose name another has since used raises ValueError, and a
    new model under a name starts from zero residuals). Gradients are averaged.
    """
    state = {} if state is None else state
    buffer = bucket.buffer()
    codec, comm, name = state.get("compression"), state.get("comm") or MPI.COMM_WORLD, state.get("name", "ddp")
    if codec is not None:
        _claim_ddp_name(state, comm, name, bucket.index())
    handle = hpcdl.allreduce_async(
        buffer,
        op="average",
        comm=comm,
        name=f"{name}.bucket.{bucket.index()}",
        **({} if codec is None else {"compression": codec}),
    )
    future = torch.futures.Future(devices=[buffer.device] if buffer.is_cuda else None)

    def finish():
        try:
            if buffer.is_cuda:
                torch.cuda.set_device(buffer.device)
            # the copy back is ordered before this thread's stream, which the future's devices follow
            future.set_result(handle.wait())
        except Exception as exc:  # noqa: BLE001 - handed to DDP through the future
            future.set_exception(exc)

    if _ddp_waiter["pool"] is None:
        _ddp_waiter["pool"] = ThreadPoolExecutor(1, thread_name_prefix="hpcdl-ddp")
    _ddp_waiter["pool"].submit(finish)
    return future
