"""PowerSGD (hpcdl.compression.PowerSGD) inside DistributedOptimizer: low-rank factors
of the gradient matrices, summed with hpcdl's dense ring.

Every float32 parameter the codec compresses (PowerSGD.compresses: 2+ dimensions,
viewed as n x m with n its first dimension, rank (n + m) < n m) goes into a
low-rank bucket (closed once its P and Q reach bucket_bytes: buckets are sized by
what they send, so a model's factors usually travel in one P and one Q
allreduce); every other parameter goes densely into one fused bucket per dtype
and device. Per low-rank bucket and step after the
warm-up, with r the rank and each matrix on its parameter's device:

    put         (each gradient, as backward produces it) M = grad + residual, into the
                bucket's work buffer (the residual is left as it is until result)
    launch      (its last gradient is in, during backward)
                P = M Q (Q: last step's); P's allreduce may start
    exchange_q  (bucket after bucket: during backward, when a bucket is launched, for the
                earlier ones whose P is summed; the rest at its end, while later P's move)
                P <- orthogonalize(P) (Gram-Schmidt, float32); Q = M^T P; Q's allreduce starts
    result      approx = P Q^T written straight into the parameter's .grad (no copy back
                from the bucket) where .grad is a dense float32 tensor; residual = M - P Q^T
                in place over M, whose buffer then holds the residual (the old residual's
                takes the next step's M)

P and Q are averaged. Every rank orthogonalizes the same P with the same code
and multiplies by the same Q, so every rank ends with the same bits. Under
hpcdl.join a joined rank's engine contributes zero P and Q (it has no M) and
its Q, residuals and step count stay as they were; at the first step after the
join every rank takes the step count and Q of the rank that joined last
(Schedule.share), so the ranks agree on the warm-up and on Q again. During
the warm-up (the first warmup_steps steps) and on a one-rank communicator a
low-rank bucket is a plain dense bucket (nothing compressed). On the staged
path (CUDA) the matrix products run on the device and only P and Q travel
through pinned host memory.
"""

import numpy as np
import torch

import hpcdl
from hpcdl import _tensors
from hpcdl.compression import PowerSGD
from hpcdl.torch._buckets import Bucket, make_buckets

MIN_NORM = PowerSGD.MIN_NORM
_DENSE_BUCKET = float("inf")  # the dense parameters share one bucket per dtype and device


def orthogonalize(p):
    """Gram-Schmidt on the columns of the n x r matrix p, in place: each column minus its
    projection on the earlier ones, then divided by its norm (unless below MIN_NORM)."""
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        if i:
            done = p[:, :i]
            col -= done @ (done.T @ col)
        col /= torch.linalg.vector_norm(col).clamp_min(MIN_NORM)
    return p


def restart_columns(q, q0):
    """Columns of Q that are all zero (a zero M) or not finite would stay so from step to
    step; they start again from the seeded Q. Same Q on every rank, same decision. A host Q
    is checked through numpy (~0.05 ms per matrix on CPU, torch's small reductions ~0.1 ms);
    a device Q with torch.where (no wait for the device)."""
    if q.device.type != "cpu":
        dead = ~torch.isfinite(q).all(dim=0) | (q == 0).all(dim=0)
        q.copy_(torch.where(dead, q0, q))
        return
    values = q.numpy()
    dead = ~np.isfinite(values).all(axis=0) | ~values.any(axis=0)
    if dead.any():
        values[:, dead] = q0.numpy()[:, dead]


def take(mat, grad):
    """A gradient arrives (None: zeros): M = grad + residual, in one pass into the matrix's work
    buffer (the residual stays as it is until the step's result replaces it)."""
    if grad is None:
        mat.m.copy_(mat.residual)
    else:
        torch.add(grad.reshape(mat.m.shape), mat.residual, out=mat.m)


def project(mat):
    """First half, before P's allreduce, once the bucket's M are in: P = M Q."""
    torch.matmul(mat.m, mat.q, out=mat.p)


def project_back(mat):
    """Second half, on the summed P, before Q's allreduce: P orthogonalized; Q = M^T P."""
    orthogonalize(mat.p)
    torch.matmul(mat.m.T, mat.p, out=mat.q)


def finish(mat, approx):
    """On the summed Q: approx = P Q^T into `approx` (n x m: a view of the parameter's .grad,
    which then needs no copy back, or of the bucket); the residual M - P Q^T computed in place
    over M (0 where not finite: an overflow never reaches later steps), whose buffer then holds
    the residual while the old residual's takes the next M; Q's dead columns restart."""
    torch.matmul(mat.p, mat.q.T, out=approx)
    mat.m.addmm_(mat.p, mat.q.T, alpha=-1)  # in place: one pass (an out= addmm copies M first)
    mat.m.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # one pass (isfinite + where: ~30x slower on CPU)
    mat.m, mat.residual = mat.residual, mat.m
    restart_columns(mat.q, mat.q0)


class Schedule:
    """The codec, the steps reduced so far (the warm-up counts them) and the low-rank buckets."""

    def __init__(self, codec):
        self.codec = codec
        self.steps = 0
        self.buckets = []

    def compressing(self):
        return self.steps >= self.codec.warmup_steps

    def advance(self):
        """During backward: buckets whose P is already summed start their Q, in bucket order
        (host buckets only: a staged P is waited for after all launches landed)."""
        for bucket in self.buckets:
            if not bucket.compressing or bucket.q_submitted:
                continue
            if bucket.staged or bucket.handle is None or not bucket.handle.done():
                return
            bucket.exchange_q()

    def matrices(self):
        return {m.name: m for b in self.buckets for m in b.matrices}

    def share(self, comm, root, name):
        """After a join (collective): the ranks that joined early stepped less, so every rank
        takes the step count and each Q (equal on the ranks that step together) from `root`,
        the rank that joined last; each keeps its own residuals (a joined rank had no gradient)."""
        steps = np.array([self.steps], np.int64)
        handles = [hpcdl.broadcast_async(steps, root=root, comm=comm, name=f"{name}.join.steps")]
        for bucket in self.buckets:
            if bucket.staged:
                bucket.q_host.copy_(bucket.q_dev)
            handles.append(hpcdl.broadcast_async(bucket.q_array, root=root, comm=comm, name=f"{bucket.name}.join.Q"))
        for handle in handles:
            handle.wait()
        for bucket in self.buckets:
            if bucket.staged:
                bucket.q_dev.copy_(bucket.q_host)
        self.steps = int(steps[0])

    def state_dict(self):
        """This rank's state: steps, and per compressed matrix its Q (the same on every rank) and
        its residual (this rank's own)."""
        return {
            "codec": self.codec.get_config(),
            "steps": self.steps,
            "matrices": {
                name: {"q": m.q.detach().clone(), "residual": m.residual.detach().clone()}
                for name, m in self.matrices().items()
            },
        }

    def with_own_residuals(self, state):
        """``state`` (another rank's state_dict()) with this rank's residuals in place of its
        own: the step count and Q are shared, the residuals (error feedback) are per rank."""
        mine = self.matrices()
        matrices = {
            name: dict(saved, residual=mine[name].residual.detach().clone()) if name in mine else saved
            for name, saved in state["matrices"].items()
        }
        return dict(state, matrices=matrices)

    def load_state_dict(self, state):
        if state.get("codec") != self.codec.get_config():
            raise ValueError(
                f"the PowerSGD state is for {state.get('codec')!r}, this optimizer runs {self.codec.get_config()!r}"
            )
        saved = state["matrices"]
        mine = self.matrices()
        missing = sorted(set(mine) - set(saved))
        if missing:
            raise ValueError(f"the PowerSGD state has no Q and residual for {missing}")
        for name, m in mine.items():
            for key, tensor in (("q", m.q), ("residual", m.residual)):
                if tuple(saved[name][key].shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"the PowerSGD state's {key} of '{name}' has shape "
                        f"{tuple(saved[name][key].shape)}, not {tuple(tensor.shape)}"
                    )
        with torch.no_grad():
            for name, m in mine.items():
                m.q.copy_(saved[name]["q"])
                m.residual.copy_(saved[name]["residual"])
        self.steps = int(state["steps"])


class Matrix:
    """One compressed parameter: n x m views of its residual and of its work buffer (M during a
    step), which trade places at each result; n x r of P, m x r of Q and of the seeded Q (views
    into its bucket's buffers)."""

    def __init__(self, name, n, m, work, residual, p, q, q0):
        self.name = name
        self.m, self.residual = work.view(n, m), residual.view(n, m)
        self.p, self.q, self.q0 = p.view(n, -1), q.view(m, -1), q0.view(m, -1)


class LowRankBucket(Bucket):
    def __init__(self, index, name, slots, staged, schedule, size, names, grad_as_view):
        # grad_as_view: the riders' .grad (and all of them in the dense warm-up) become slots of the bucket
        super().__init__(index, name, torch.float32, slots, staged, None, size, grad_as_view)
        self.schedule = schedule
        self.can_compress = not self.local and size > 1  # one rank: the gradients stay exact
        self.compressing = False  # this step's mode, fixed when its allreduce is submitted
        self.q_submitted = False
        self.matrices, self.p_timings, self.matrix_of = [], None, {}
        self.in_grad = set()  # parameters whose approximation result() wrote into .grad
        if not self.can_compress:
            return
        rank, device = schedule.codec.rank, self.device
        factored = [slot for slot in slots if schedule.codec.compresses(slot[0].shape)]
        # the riders: parameters the codec does not factor (biases, norms), averaged as they are in
        # P's allreduce, after the matrices' P (one allreduce fewer than a dense bucket of their own)
        self.riders = [slot for slot in slots if not schedule.codec.compresses(slot[0].shape)]
        shapes = [schedule.codec.matrix_shape(p.shape) for p, _, _ in factored]
        host = device if staged else torch.device("cpu")
        p_numel = rank * sum(n for n, _ in shapes) + sum(numel for _, _, numel in self.riders)
        self.p_host = _tensors.host_buffer(p_numel, torch.float32, host)
        self.q_host = _tensors.host_buffer(rank * sum(m for _, m in shapes), torch.float32, host)
        self.p_array, self.q_array = self.p_host.numpy(), self.q_host.numpy()
        self.p_dev = torch.empty_like(self.p_host, device=device) if staged else self.p_host
        self.q_dev = torch.empty_like(self.q_host, device=device) if staged else self.q_host
        self.q0 = torch.cat(
            [
                torch.from_numpy(schedule.codec.initial_q(names[p], m)).view(-1)
                for (p, _, _), (_, m) in zip(factored, shapes)
            ]
        ).to(device)
        self.q_dev.copy_(self.q0)
        # the residuals and the work buffer of M: a separate pair, so that M never overwrites the
        # residual before the step's result (a step abandoned midway leaves it as it was) and the
        # bucket stays free for the dense warm-up and the approximations that cannot go into .grad
        self.residual = torch.zeros(self.gather.numel(), dtype=torch.float32, device=device)
        self.work = torch.empty_like(self.residual)
        p_at = q_at = 0
        for (param, offset, numel), (n, m) in zip(factored, shapes):
            self.matrices.append(
                Matrix(
                    names[param],
                    n,
                    m,
                    self.work[offset : offset + numel],
                    self.residual[offset : offset + numel],
                    self.p_dev[p_at : p_at + n * rank],
                    self.q_dev[q_at : q_at + m * rank],
                    self.q0[q_at : q_at + m * rank],
                )
            )
            self.matrix_of[param] = self.matrices[-1]
            p_at, q_at = p_at + n * rank, q_at + m * rank
        self.factored_slots = factored
        self.rider_of = {}  # param: (its values in P's buffer, its slot in the bucket)
        for param, offset, numel in self.riders:
            self.rider_of[param] = (self.p_dev[p_at : p_at + numel], self.gather[offset : offset + numel])
            p_at += numel
        schedule.buckets.append(self)

    def submit(self, op, comm, deferred):
        self.compressing = self.can_compress and self.schedule.compressing()
        self.q_submitted = False
        self.in_grad = set()
        if not self.compressing:
            return super().submit(op, comm, deferred)
        self.handle = hpcdl.allreduce_async(
            self.p_array, op="average", comm=comm, name=f"{self.name}.P", deferred=deferred
        )
        self.comm = comm
        return self.handle

    def put(self, offset, numel, param, grad):
        if not self.compressing:
            return super().put(offset, numel, param, grad)
        if param in self.matrix_of:
            take(self.matrix_of[param], grad)
        elif grad is None:
            self.rider_of[param][0].zero_()
        else:
            self.rider_of[param][0].copy_(grad.reshape(-1))

    def launch(self):
        if not self.compressing:
            return super().launch()
        with torch.no_grad():
            for mat in self.matrices:
                project(mat)
        if not self.staged:
            self.handle.mark_ready()
            return
        with _tensors.SideWork(self.device) as work:
            self.p_host.copy_(self.p_dev, non_blocking=True)
            work.keep(self.p_dev)
        self.launched = _tensors.launcher().submit(self._land, work)

    def exchange_q(self):
        """P is summed: orthogonalize it, compute this rank's Q and start Q's allreduce."""
        if not self.compressing or self.q_submitted:
            return
        self.q_submitted = True
        self.handle.wait()
        self.p_timings = self.handle.timings()
        if self.staged:
            _tensors.copy_async(self.p_dev, self.p_host, self.device).order_current_stream()
        with torch.no_grad():
            for mat in self.matrices:
                project_back(mat)
        if self.staged:  # Q is small: this thread waits for its copy (a deferred Q not yet marked
            # ready would stop the wait for the next bucket's P)
            _tensors.copy_async(self.q_host, self.q_dev, self.device).wait_host()
        self.handle = hpcdl.allreduce_async(self.q_array, op="average", comm=self.comm, name=f"{self.name}.Q")

    def timings(self):
        if not self.compressing:
            return super().timings()
        return [dict(self.p_timings, name=f"{self.name}.P"), dict(self.handle.timings(), name=f"{self.name}.Q")]

    def result(self):
        if not self.compressing:
            return super().result()
        if self.staged:
            _tensors.copy_async(self.q_dev, self.q_host, self.device).order_current_stream()
        with torch.no_grad():
            for (param, offset, numel), mat in zip(self.factored_slots, self.matrices):
                grad = self._grad_in_place(param)
                finish(mat, (self.gather[offset : offset + numel] if grad is None else grad).view(mat.m.shape))
                if grad is not None:
                    self.in_grad.add(param)
            for summed, slot in self.rider_of.values():  # delivered from the bucket like a dense one's
                slot.copy_(summed)
        return self.gather

    def _grad_in_place(self, param):
        """param.grad when this step's approximation can be written into it (its gradient was
        taken this step, a dense contiguous float32 tensor on the bucket's device), else None."""
        grad = param.grad
        if (
            param in self.filled
            and grad is not None
            and grad.layout == torch.strided
            and grad.is_contiguous()
            and grad.dtype == torch.float32
            and grad.device == self.device
        ):
            return grad
        return None

    def deliver(self, param, reduced):
        if param not in self.in_grad:
            super().deliver(param, reduced)


def build_buckets(named, bucket_bytes, name, first_index, reducible, staged_of, schedule, size, grad_as_view):
    """Low-rank buckets of the matrices the codec compresses, the float32 parameters it does not
    compress riding in the last one's P (on its device: their gradients are complete last, as its
    matrices' are), then one dense bucket per dtype and device of the others."""
    names = {p: n for n, p in named}
    factored = {p for _, p in named if p.dtype == torch.float32 and schedule.codec.compresses(p.shape)}
    groups = make_buckets(
        [(n, p) for n, p in named if p in factored],
        bucket_bytes,
        name,
        first_index,
        reducible,
        lambda i, bname, dtype, slots: (i, bname, slots),
        weigh=lambda p: schedule.codec.factor_bytes(p.shape),
    )
    riders = set()
    if groups:
        device = groups[-1][2][0][0].device
        slots = groups[-1][2]
        for _, p in reversed(named):  # backward order, as make_buckets lays out slots
            if p not in factored and p.dtype == torch.float32 and p.device == device:
                riders.add(p)
                slots.append((p, sum(numel for _, _, numel in slots), p.numel()))
    buckets = [
        LowRankBucket(i, bname, slots, staged_of(slots[0][0]), schedule, size, names, grad_as_view)
        for i, bname, slots in groups
    ]
    return buckets + make_buckets(
        [(n, p) for n, p in named if p not in factored and p not in riders],
        _DENSE_BUCKET,
        name,
        first_index + len(buckets),
        reducible,
        lambda i, bname, dtype, slots: Bucket(i, bname, dtype, slots, staged_of(slots[0][0]), None, size, grad_as_view),
    )
