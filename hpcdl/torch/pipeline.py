"""PyTorch pipeline parallelism: an nn.Sequential cut into stages, one stage per rank.

    import hpcdl.torch
    pipe = hpcdl.torch.Pipeline(model, torch.nn.functional.cross_entropy, micro_batches=8,
                                schedule="1f1b")               # every rank of COMM_WORLD a stage
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)           # this stage's parameters
    for x, y in batches:
        opt.zero_grad()
        loss = pipe.train_step(x, y)    # x read on the first stage, y on the last; loss there
        opt.step()

With stages < ranks the ranks form a grid of stages x replicas; wrap the
optimizer with pipe.distributed_optimizer(opt) to average each stage's
gradients over its replicas. docs/pipeline.md describes the design and costs.
"""

import collections
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

from hpcdl._agree import call_on_every_rank, check_same_on_all_ranks, waited_allreduce, waited_gather, waited_scatter
from hpcdl.errors import MismatchError
from hpcdl.pipeline import (
    BACKWARD,
    FORWARD,
    Link,
    PipelineError,
    balanced_split,
    data_tag,
    max_micro_batches,
    pipeline_grid,
    stage_actions,
)

__all__ = ["Pipeline", "PipeSplit", "PipelineError"]

_RECEIVE_AHEAD = 2  # actions whose receives are posted before the current one runs


class PipeSplit(torch.nn.Identity):
    """A marker in an nn.Sequential: a new stage starts after it (balance="marks")."""


def _bytes(tensor):
    """A flat uint8 numpy view of a contiguous CPU tensor (what MPI sends)."""
    return tensor.view(-1).view(torch.uint8).numpy()


def _message_name(kind, mb):
    return f"micro-batch {mb}'s {'activation' if kind == FORWARD else 'gradient'}"


def _describe(shape, dtype):
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"


class _Saved:
    """A tensor autograd saved for backward; its release tells the counter."""

    __slots__ = ("tensor", "counter", "micro_batch", "key")

    def __init__(self, tensor, counter, micro_batch, key):
        self.tensor, self.counter, self.micro_batch, self.key = tensor, counter, micro_batch, key

    def __del__(self):
        self.counter._release(self.micro_batch, self.key)


class _ActivationCounter:
    """Counts the activations autograd saves for backward, per micro-batch, while they live.

    Parameters saved by an op (a Linear's weight) are not activations and are
    not counted; a tensor saved by two ops counts once.
    """

    def __init__(self, params):
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}
        self._live = collections.defaultdict(dict)  # micro-batch -> {tensor: [saves, bytes]}
        self._live_bytes = 0
        self.peak_micro_batches = 0
        self.peak_bytes = 0

    def hooks(self, micro_batch):
        def pack(tensor):
            if tensor.untyped_storage().data_ptr() in self._param_storages:
                return tensor
            key = (tensor.data_ptr(), tensor.numel())
            entry = self._live[micro_batch].get(key)
            if entry is None:
                entry = self._live[micro_batch][key] = [0, tensor.numel() * tensor.element_size()]
                self._live_bytes += entry[1]
                self.peak_bytes = max(self.peak_bytes, self._live_bytes)
                self.peak_micro_batches = max(self.peak_micro_batches, len(self._live))
            entry[0] += 1
            return _Saved(tensor, self, micro_batch, key)

        def unpack(saved):
            return saved.tensor if isinstance(saved, _Saved) else saved

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _release(self, micro_batch, key):
        storages = self._live.get(micro_batch)
        if storages is None or key not in storages:
            return
        storages[key][0] -= 1
        if storages[key][0] == 0:
            self._live_bytes -= storages.pop(key)[1]
        if not storages:
            del self._live[micro_batch]

    def live_micro_batches(self):
        return len(self._live)


def _on_cpu(state):
    """state (a state_dict) with its tensors on the CPU: pickled, a GPU tensor would be
    unpickled onto the same GPU number on the receiving rank, another rank's GPU there."""
    return collections.OrderedDict(
        (key, value.detach().cpu() if isinstance(value, torch.Tensor) else value) for key, value in state.items()
    )


class Pipeline:
    """Train an nn.Sequential cut into ``stages`` stages over the ranks of ``comm``.

    model: the whole nn.Sequential, built the same way on every rank (same
        seed); each rank keeps its stage's layers. Parameter and buffer names
        stay the model's own ("3.weight"), so checkpoints load into the model.
    loss_fn: loss_fn(output, targets) -> a mean over the micro-batch (runs on
        the last stage); the step's gradient is that of the mini-batch mean.
    micro_batches: M, each mini-batch is cut into M equal micro-batches.
    schedule: "1f1b" (at most stages - s micro-batches of activations on
        stage s) or "gpipe" (all M).
    stages: P, default every rank of comm is a stage. Fewer: a grid of P
        stages x size/P replicas (pipeline_comm, data_comm; see
        distributed_optimizer()).
    balance: "params" (equal parameter counts), "time" (equal measured
        forward+backward time per stage; needs ``sample``, one micro-batch of
        input), "marks" (cut after each PipeSplit in the model), or a list of
        P start indices of the stages, e.g. [0, 4] (layer 0-3 and 4-).
    comm: mpi4py communicator (default COMM_WORLD).

    Construction is collective over comm: every rank must pass the same model
    layout and settings, else MismatchError on every rank.
    """

    def __init__(
        self, model, loss_fn, micro_batches, schedule="1f1b", stages=None, balance="params", sample=None, comm=None
    ):
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(model, torch.nn.Sequential):
            raise TypeError(f"Pipeline takes an nn.Sequential, got {type(model).__name__}")
        stages = comm.Get_size() if stages is None else int(stages)
        check_same_on_all_ranks(
            comm,
            [(n, t.shape, t.dtype) for n, t in model.state_dict().items()],
            "the pipelined models",
            {
                "stages": stages,
                "micro_batches": int(micro_batches),
                "schedule": schedule,
                "balance": balance if isinstance(balance, str) else [int(i) for i in balance],
                "layers": [type(m).__name__ for m in model],
            },
        )
        _check_settings(schedule, micro_batches)
        self.pipeline_comm, self.data_comm = pipeline_grid(comm, stages)
        self.stages, self.stage = stages, self.pipeline_comm.Get_rank()
        self.micro_batches, self.schedule = int(micro_batches), schedule
        self.layer_names = [name for name, _ in model.named_children()]
        self.starts = _stage_starts(model, balance, stages, sample, comm)
        self.module = torch.nn.Sequential(
            collections.OrderedDict(list(model.named_children())[slice(*self._layers_of(self.stage))])
        )
        self.loss_fn = loss_fn
        self._actions = stage_actions(schedule, stages, self.stage, self.micro_batches)
        self._link = Link(self.pipeline_comm)
        self._counter = _ActivationCounter(list(self.module.parameters()))
        self._input_layout = None  # (shape, dtype) of a micro-batch entering this stage
        self._output_layout = None  # ... and leaving it
        self._failed = None
        self._step_device = None  # the stage's device, as train_step found it
        self._closed = False
        self._action_cpu = {FORWARD: [], BACKWARD: []}  # this step's CPU per action (last_step_times)
        self._last_step = {
            "step_s": 0.0,
            "waited_s": 0.0,
            "forward_cpu_s": [],
            "backward_cpu_s": [],
            "other_cpu_s": 0.0,
        }

    def _layers_of(self, stage):
        """(first, end) layer indices of ``stage``."""
        ends = self.starts[1:] + [len(self.layer_names)]
        return self.starts[stage], ends[stage]

    # ------------------------------------------------------------------ the user's view

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    @property
    def is_first(self):
        return self.stage == 0

    @property
    def is_last(self):
        return self.stage == self.stages - 1

    def distributed_optimizer(self, optimizer, **kwargs):
        """hpcdl.torch.DistributedOptimizer averaging this stage's gradients over its
        replicas (data_comm); its allreduce starts during the last micro-batch's
        backward. kwargs (compression=, bucket_bytes=...) go to DistributedOptimizer."""
        from hpcdl.torch.optimizer import DistributedOptimizer

        return DistributedOptimizer(
            optimizer,
            self.named_parameters(),
            comm=self.data_comm,
            backward_passes_per_step=self.micro_batches,
            name=f"pipeline.stage{self.stage}",
            **kwargs,
        )

    def activation_stats(self):
        """Measured since construction: the most micro-batches whose saved activations
        were alive at once on this stage, and the most bytes they held."""
        return {
            "peak_micro_batches": self._counter.peak_micro_batches,
            "peak_bytes": self._counter.peak_bytes,
            "live_micro_batches": self._counter.live_micro_batches(),
        }

    def last_step_times(self):
        """The last train_step's wall-clock seconds (step_s), the part of it this stage
        spent waiting for other stages (waited_s; its measured bubble is waited_s /
        step_s), and this thread's CPU seconds of each forward and backward action in
        schedule order (forward_cpu_s, backward_cpu_s: the layers, posting and sending,
        without the CPU spent polling while waiting) and of the rest of train_step
        (other_cpu_s): what the stage's work costs as the pipeline runs it."""
        return {key: list(value) if isinstance(value, list) else value for key, value in self._last_step.items()}

    def full_state_dict(self):
        """The whole model's state_dict on stage 0 (None elsewhere), its tensors on the
        CPU; collective over the pipeline. Its keys are the original nn.Sequential's."""
        mine = _on_cpu(self.module.state_dict())
        parts = waited_gather(self.pipeline_comm, mine, 0, "full_state_dict's gather of the stages")
        if self.stage != 0:
            return None
        merged = collections.OrderedDict()
        for part in parts:
            merged.update(part)
        return merged

    def load_full_state_dict(self, state):
        """Load the whole model's state_dict given on stage 0 (others pass None): each
        stage receives its part on the CPU and loads it onto its own device. Collective;
        an error on any stage raises on all."""
        parts = None
        if self.stage == 0:
            parts = [collections.OrderedDict() for _ in range(self.stages)]
            owner = {name: s for s in range(self.stages) for name in self.layer_names[slice(*self._layers_of(s))]}
            for key, value in _on_cpu(state).items():
                parts[owner.get(key.split(".", 1)[0], 0)][key] = value
        mine = waited_scatter(self.pipeline_comm, parts, 0, "load_full_state_dict's scatter to the stages")
        call_on_every_rank(self.pipeline_comm, self.module.load_state_dict, mine)

    def close(self):
        """Free the pipeline's private communicator (collective over the pipeline); the
        stage's module and parameters stay usable, train_step() no longer."""
        self._closed = True
        self._link.close()

    def __del__(self):
        link = getattr(self, "_link", None)
        if link is not None:
            link.cancel()

    # ------------------------------------------------------------------ one step

    def train_step(self, inputs=None, targets=None):
        """Forward and backward of one mini-batch, micro-batch by micro-batch; gradients
        accumulate in this stage's parameters' .grad (step the optimizer after).

        inputs are read on the first stage, targets on the last (other stages may
        pass None). Returns the mini-batch's mean loss on the last stage, None on
        the others. Any failure raises PipelineError on every stage of the pipeline.
        """
        if self._closed:
            raise PipelineError("this pipeline was closed")
        if self._failed is not None:
            raise PipelineError(f"this pipeline failed in an earlier step ({self._failed}); build a new one")
        start, waited, cpu, waited_cpu = (
            time.perf_counter(),
            self._link.waited_s,
            time.thread_time(),
            self._link.waited_cpu_s,
        )
        try:
            self._action_cpu = {FORWARD: [], BACKWARD: []}
            loss = self._step(inputs, targets)
            work = sum(self._action_cpu[FORWARD]) + sum(self._action_cpu[BACKWARD])
            self._last_step = {
                "step_s": time.perf_counter() - start,
                "waited_s": self._link.waited_s - waited,
                "forward_cpu_s": self._action_cpu[FORWARD],
                "backward_cpu_s": self._action_cpu[BACKWARD],
                "other_cpu_s": max(0.0, time.thread_time() - cpu - work - (self._link.waited_cpu_s - waited_cpu)),
            }
            return loss
        except PipelineError as exc:  # another stage failed and told us
            self._failed = str(exc)
            raise
        except Exception as exc:
            message = f"stage {self.stage} of {self.stages} failed: {type(exc).__name__}: {exc}"
            self._failed = message
            self._link.abort(message)
            raise PipelineError(message) from exc

    def _step(self, inputs, targets):
        x = self._split(inputs, "inputs") if self.is_first else None
        y = self._split(targets, "targets") if self.is_last else None
        if self._output_layout is None and self._input_layout is None:
            self._agree_layouts(x[0] if self.is_first else None)
        if self.is_first:
            for chunk in x:
                if (tuple(chunk.shape), chunk.dtype) != self._input_layout:
                    raise ValueError(
                        f"a micro-batch is {_describe(chunk.shape, chunk.dtype)} but was "
                        f"{_describe(*self._input_layout)} at the first step (the layout is "
                        "agreed once: build a new Pipeline for another batch shape)"
                    )
        self._held, self._receives, self._sends = {}, {}, []
        self._step_device = self._device()  # looked up once: a lookup walks the module tree
        total = None
        for index, (kind, mb) in enumerate(self._actions):
            cpu, waited_cpu = time.thread_time(), self._link.waited_cpu_s
            for kind_ahead, mb_ahead in self._actions[index : index + _RECEIVE_AHEAD + 1]:
                self._post_receive(kind_ahead, mb_ahead)
            if kind == FORWARD:
                loss = self._forward(mb, x[mb] if x else None, y[mb] if y else None)
                if loss is not None:
                    total = loss if total is None else total + loss
            else:
                self._backward(mb)
            self._sends = [send for send in self._sends if not send[0].done()]
            self._action_cpu[kind].append(time.thread_time() - cpu - (self._link.waited_cpu_s - waited_cpu))
        for request, _, dest, what in self._sends:
            self._link.wait(request, dest, f"taking {what}")
        self._sends = []
        return float(total) if self.is_last else None

    def _split(self, batch, what):
        if batch is None:
            raise ValueError(f"stage {self.stage} needs the {what} (the first stage reads inputs, the last targets)")
        if batch.shape[0] % self.micro_batches:
            raise ValueError(f"{self.micro_batches} micro-batches do not divide the {what}' batch of {batch.shape[0]}")
        return batch.chunk(self.micro_batches)

    def _agree_layouts(self, first_micro_batch):
        """First step: each stage learns its input's shape and dtype from the previous one
        and tries its layers on it without computing (meta tensors), in order, so a stage
        that cannot take its predecessor's output is named before any data moves."""
        if self.is_first:
            layout = (tuple(first_micro_batch.shape), first_micro_batch.dtype)
        else:
            layout = self._link.recv_object(self.stage - 1)
        self._input_layout = layout
        try:
            out = self._dry_run(*layout)
        except Exception as exc:
            where = "the input" if self.is_first else f"stage {self.stage - 1}'s output"
            raise ValueError(
                f"stage {self.stage} (layers {self._layer_range()}) cannot take {where} {_describe(*layout)}: {exc}"
            ) from exc
        self._output_layout = (tuple(out.shape), out.dtype)
        if not self.is_last:
            self._link.wait(
                self._link.send_object(self._output_layout, self.stage + 1), self.stage + 1, "taking a layout"
            )

    def _dry_run(self, shape, dtype):
        state = {
            n: torch.empty_like(t, device="meta")
            for n, t in list(self.module.named_parameters()) + list(self.module.named_buffers())
        }
        with torch.no_grad():
            try:
                return torch.func.functional_call(self.module, state, (torch.empty(shape, dtype=dtype, device="meta"),))
            except NotImplementedError:  # an op without a meta kernel: compute once on zeros
                return self.module(torch.zeros(shape, dtype=dtype, device=self._device()))

    def _layer_range(self):
        first, end = self._layers_of(self.stage)
        return f"{self.layer_names[first]}..{self.layer_names[end - 1]}"

    def _device(self):
        first = next(self.module.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    def _post_receive(self, kind, mb):
        """Post the receive that action (kind, mb) needs, once, into a fresh host buffer."""
        if (kind, mb) in self._receives:
            return
        if kind == FORWARD and not self.is_first:
            shape, dtype, source = *self._input_layout, self.stage - 1
        elif kind == BACKWARD and not self.is_last:
            shape, dtype, source = *self._output_layout, self.stage + 1
        else:
            return
        buffer = torch.empty(shape, dtype=dtype)
        request = self._link.recv(_bytes(buffer), source, data_tag(kind, mb))
        self._receives[(kind, mb)] = (request, buffer)

    def _received(self, kind, mb):
        request, buffer = self._receives.pop((kind, mb))
        what = _message_name(kind, mb)
        agreed = f"the {_describe(buffer.shape, buffer.dtype)} agreed at the first step"
        try:
            self._link.wait(request, self.stage - 1 if kind == FORWARD else self.stage + 1, what)
        except MismatchError as exc:
            raise ValueError(f"{what} is not {agreed}: {exc}") from exc
        return buffer.to(self._step_device)

    def _send(self, tensor, kind, mb, dest):
        host = tensor.detach().to("cpu").contiguous()
        what = _message_name(kind, mb)
        self._sends.append((self._link.send(_bytes(host), dest, data_tag(kind, mb)), host, dest, what))

    def _forward(self, mb, inputs, targets):
        if self.is_first:
            inp = inputs.to(self._step_device)
        else:
            inp = self._received(FORWARD, mb).requires_grad_(True)
        with self._counter.hooks(mb):
            out = self.module(inp)
            if self.is_last:
                loss = self.loss_fn(out, targets.to(out.device)) / self.micro_batches
        if self.is_last:
            self._held[mb] = (inp, loss)
            return loss.detach()
        if (tuple(out.shape), out.dtype) != self._output_layout:
            raise ValueError(
                f"stage {self.stage}'s output for micro-batch {mb} is {_describe(out.shape, out.dtype)}, "
                f"not the {_describe(*self._output_layout)} agreed at the first step"
            )
        self._send(out, FORWARD, mb, self.stage + 1)
        self._held[mb] = (inp, out)
        return None

    def _backward(self, mb):
        inp, out = self._held.pop(mb)
        if self.is_last:
            out.backward()
        else:
            torch.autograd.backward(out, self._received(BACKWARD, mb))
        if not self.is_first:
            self._send(inp.grad if inp.grad is not None else torch.zeros_like(inp), BACKWARD, mb, self.stage - 1)


def _check_settings(schedule_name, micro_batches):
    stage_actions(schedule_name, 1, 0, 1)  # raises on an unknown name
    if not 1 <= int(micro_batches) <= max_micro_batches():
        raise ValueError(f"micro_batches must be between 1 and {max_micro_batches()}, got {micro_batches}")


def _stage_starts(model, balance, stages, sample, comm):
    """The first layer index of every stage (the same on every rank)."""
    layers = list(model)
    if isinstance(balance, str):
        if balance == "params":
            return balanced_split([sum(p.numel() for p in layer.parameters()) for layer in layers], stages)
        if balance == "time":
            if sample is None:
                raise ValueError('balance="time" needs sample= (one micro-batch of input) to time the layers')
            # Every rank measures; the sum decides, in integer nanoseconds: exact in whatever
            # order MPI adds them, so every rank gets the same sums and cuts alike.
            times = np.round(np.array(_layer_times(layers, sample)) * 1e9).astype(np.int64)
            waited_allreduce(comm, times, MPI.SUM, 'balance="time"\'s sum of the layer times')
            return balanced_split(times.tolist(), stages)
        if balance == "marks":
            starts = [0] + [i + 1 for i, layer in enumerate(layers) if isinstance(layer, PipeSplit)]
            if len(starts) != stages or starts[-1] >= len(layers):
                raise ValueError(
                    f"the model's {len(starts) - 1} PipeSplit marks make {len(starts)} stages "
                    f"(a mark must not end the model), not {stages}"
                )
            return starts
        raise ValueError(f'balance must be "params", "time", "marks" or a list of stage starts, got {balance!r}')
    starts = [int(i) for i in balance]
    if len(starts) != stages or starts[0] != 0 or sorted(set(starts)) != starts or starts[-1] >= len(layers):
        raise ValueError(
            f"balance={starts} must be {stages} increasing layer indices starting at 0 and below {len(layers)}"
        )
    return starts


def _layer_times(layers, sample, repeats=3):
    """Median forward+backward seconds of each layer on ``sample`` (gradients discarded),
    computed as the pipeline computes it: the model's input needs no gradient, so
    the first layer's backward computes none for it."""
    times, x = [], sample
    for index, layer in enumerate(layers):
        inp = x.detach().requires_grad_(index > 0 and x.is_floating_point())
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            runs.append(time.perf_counter() - start)
        times.append(statistics.median(runs))
        x = out.detach()
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    return times
