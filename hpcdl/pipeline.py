"""Pipeline parallelism, the framework-neutral part: schedules, partitioning,
the pipeline x data grid of ranks, and the point-to-point link between stages.

The PyTorch stage runner is hpcdl.torch.pipeline (``hpcdl.torch.Pipeline``);
docs/pipeline.md describes the design and its costs.

The link works on a private duplicate of the pipeline communicator, so
messages of one pipeline can never match anyone else's. Activations and
gradients go through hpcdl's engine (hpcdl._core.transfer): its thread posts
and tests them, so a transfer advances while the stage computes (MPICH moves a
message only inside an MPI call), and a receive fails unless it gets exactly
the bytes it expects. The small layout messages and the abort channel stay on
mpi4py. Waiting for a transfer blocks on the engine's handle, which wakes the
stage as soon as the engine sees the message; waiting for an mpi4py request
polls with a backoff sleep. Both leave the cores to other ranks and watch
for an abort message every few milliseconds: a stage that fails tells
every other stage, which raise too, instead of waiting forever for a message
that will not come. A stage that stops (or dies under a launcher that leaves
the job running) sends nothing: past hpcdl.configure()'s stall limits a wait
for it warns (StallWarning) and then fails (StallTimeoutError), naming it.
"""

import time

from mpi4py import MPI

from hpcdl import _core
from hpcdl.collectives import PoliteWait
from hpcdl.errors import HpcdlError

__all__ = ["PipelineError", "SCHEDULES", "stage_actions", "bubble_fraction", "balanced_split", "pipeline_grid"]

SCHEDULES = ("gpipe", "1f1b")
FORWARD, BACKWARD = "F", "B"

# Tags on the link's private communicator: two reserved, then two per micro-batch.
_ABORT_TAG, _HEADER_TAG, _FIRST_DATA_TAG = 1, 2, 4
_MAX_WAIT_SLEEP_S = 200e-6
_HANDLE_WAIT_SLICE_S = 0.005  # between abort checks while blocked on an engine handle
_ABORT_BYTES = 4096
_HEADER_BYTES = 4096


class PipelineError(HpcdlError):
    """A pipeline step failed on some stage; raised on every stage of the pipeline."""


def max_micro_batches():
    """The most micro-batches the link's tags can tell apart (MPI guarantees tags up to 32767)."""
    tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767
    return (tag_ub - _FIRST_DATA_TAG) // 2


def data_tag(direction, micro_batch):
    """The tag of micro-batch ``micro_batch``'s activation (FORWARD) or its gradient (BACKWARD)."""
    return _FIRST_DATA_TAG + 2 * micro_batch + (direction == BACKWARD)


def stage_actions(name, stages, stage, micro_batches):
    """The ordered actions [(FORWARD|BACKWARD, micro-batch)] of ``stage`` in one step.

    gpipe: every forward, then every backward. 1f1b: stage s runs
    min(stages - s - 1, M) forwards ahead, then alternates one forward and one
    backward, then drains the backwards: it holds at most stages - s
    micro-batches of activations at once instead of M.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    m = micro_batches
    if name == "gpipe":
        return [(FORWARD, i) for i in range(m)] + [(BACKWARD, i) for i in range(m)]
    warmup = min(stages - stage - 1, m)
    actions = [(FORWARD, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [(FORWARD, warmup + i), (BACKWARD, i)]
    return actions + [(BACKWARD, i) for i in range(m - warmup, m)]


def bubble_fraction(stages, micro_batches):
    """The idle share of a step with equal stages and free transfers: (P-1)/(M+P-1)."""
    return (stages - 1) / (micro_batches + stages - 1)


def balanced_split(costs, parts):
    """Start indices of ``parts`` contiguous non-empty groups of ``costs`` whose largest sum is
    the smallest possible (ties: earlier boundaries). O(len(costs)^2 * parts)."""
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} layers into {parts} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][j]: the smallest largest-sum cutting the first j layers into k groups
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n - (parts - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(parts, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return starts[::-1]


def pipeline_grid(comm, stages):
    """Split ``comm`` into a grid of stages x replicas: (pipeline comm, data comm).

    Rank r is stage r % stages of replica r // stages, so a pipeline's stages
    are neighbouring ranks (usually one node); the data communicator joins the
    ranks that hold the same stage. Collective over ``comm``.
    """
    size = comm.Get_size()
    if stages < 1 or size % stages:
        raise ValueError(f"{stages} pipeline stages do not divide the {size} ranks of the communicator")
    rank = comm.Get_rank()
    pipe = comm.Split(color=rank // stages, key=rank % stages)
    data = comm.Split(color=rank % stages, key=rank // stages)
    return pipe, data


class Link:
    """Non-blocking point-to-point between the stages of one pipeline, on a private
    duplicate of ``comm`` (collective over ``comm``), with an abort channel."""

    def __init__(self, comm):
        _core.require_mpi_process("hpcdl.pipeline.Link")
        self.comm = comm.Dup()
        self.rank = self.comm.Get_rank()
        self._abort_buffer = bytearray(_ABORT_BYTES)
        self._abort = self.comm.Irecv([self._abort_buffer, MPI.BYTE], source=MPI.ANY_SOURCE, tag=_ABORT_TAG)
        self._abort_sends = []
        self.aborted = None
        self.waited_s = 0.0  # time blocked waiting for other stages (the bubble, measured)
        self.waited_cpu_s = 0.0  # this thread's CPU while waiting (polling), not the stage's work

    def recv(self, buffer, source, tag):
        """Receive exactly len(buffer) raw bytes into ``buffer`` (a writable contiguous
        array) from ``source``; returns the engine's handle (wait on it with wait())."""
        return _core.transfer(False, _core.Buffer(buffer, None, True, True), self.comm, source, tag)

    def send(self, buffer, dest, tag):
        """Send the raw bytes of ``buffer`` to ``dest``; keep ``buffer`` unchanged until done."""
        return _core.transfer(True, _core.Buffer(buffer, None, False, True), self.comm, dest, tag)

    def send_object(self, obj, dest):
        _core.require_mpi_process("hpcdl.pipeline.Link")
        return self.comm.isend(obj, dest=dest, tag=_HEADER_TAG)

    def recv_object(self, source):
        request = self.comm.irecv(bytearray(_HEADER_BYTES), source=source, tag=_HEADER_TAG)
        return self._poll(request.test, source, "its layout")

    def wait(self, request, peer, what):
        """Wait for a request from send()/recv() (an engine handle) or send_object()
        (mpi4py) that stage ``peer`` (its rank on the link) must match; ``what`` names it in a stall's
        message. Raises its error (a receive of the wrong size: MismatchError),
        PipelineError as soon as another stage aborts, StallTimeoutError past
        stall_error_seconds."""
        if isinstance(request, MPI.Request):
            return self._poll(lambda: (request.Test(), None), peer, what)
        # The engine's handle wakes this thread the moment it finishes: no polling sleep
        # between the message's arrival and the stage's next action.
        return self._poll(lambda: (request.wait_for(_HANDLE_WAIT_SLICE_S), None), peer, what, sleeps=False)

    def _poll(self, test, peer, what, sleeps=True):
        _core.require_mpi_process("hpcdl.pipeline.Link")
        wait, cpu = PoliteWait(_MAX_WAIT_SLEEP_S), time.thread_time()
        while True:
            done, value = test()
            if done:
                self.waited_s += time.perf_counter() - wait.start
                self.waited_cpu_s += time.thread_time() - cpu
                return value
            self.check_abort()
            wait.check(
                lambda waited: (
                    f"stage {self.rank} has waited {waited:.1f} s for stage {peer} ({what}): it may be stopped or dead"
                )
            )
            if sleeps:
                wait.sleep()

    def check_abort(self):
        status = MPI.Status()
        if self.aborted is None and self._abort and self._abort.Test(status):
            self.aborted = self._abort_buffer[: status.Get_count(MPI.BYTE)].decode(errors="replace")
        if self.aborted is not None:
            raise PipelineError(self.aborted)

    def abort(self, message):
        """Tell every other rank of the pipeline that this step failed (never waits)."""
        data = bytearray(message.encode()[:_ABORT_BYTES])
        self.aborted = message
        for rank in range(self.comm.Get_size()):
            if rank != self.rank:
                self._abort_sends.append((self.comm.Isend([data, MPI.BYTE], dest=rank, tag=_ABORT_TAG), data))

    def cancel(self):
        """Withdraw the abort receive (local; the link cannot report aborts afterwards)."""
        if self._abort and not MPI.Is_finalized():
            self._abort.Cancel()
            self._abort.Wait()

    def close(self):
        """Withdraw the abort receive and free the private communicator (collective)."""
        self.cancel()
        self.comm.Free()
