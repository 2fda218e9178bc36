"""TensorFlow gradients reduced over the ranks: DistributedGradientTape and broadcast_variables.

    import hpcdl.tensorflow as hvd_tf
    hvd_tf.broadcast_variables(model.variables, root=0)   # once, after the model is built
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x))
    tape = hvd_tf.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)  # averaged over all ranks
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

Eager and tf.function: gradients reach the core as numpy arrays. Eagerly the
allreduce is a direct call (hpcdl's own exceptions surface); inside a
tf.function it runs through ``tf.numpy_function``, a stateful op of the graph
(so the function cannot be XLA-compiled with ``jit_compile=True``, and an hpcdl
error arrives as a ``tf.errors`` exception carrying hpcdl's message).

Nothing is compiled against TensorFlow; ``import tensorflow`` binds the real
TensorFlow (absolute import), not the package hpcdl.tensorflow.
"""

import numpy as np
import tensorflow as tf
from mpi4py import MPI
from tensorflow.python.ops import control_flow_util  # XLA context check (no public API)

import hpcdl
from hpcdl._agree import check_same_on_all_ranks, check_same_through_engine
from hpcdl.compression import PowerSGD, canonical
from hpcdl.tensorflow.powersgd import _state_for
from hpcdl.tensorflow.residuals import _residual_state_for

__all__ = ["DistributedGradientTape", "broadcast_variables"]


def _core_view(array):
    """A C-contiguous array for the core and its dtype argument (bfloat16 travels as uint16 bits)."""
    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return array.view(np.uint16), "bfloat16"
    return array, None


def _identity(source):
    """What names a variable or tensor in a set: its ref(); a Keras 3 variable has none, so its id
    (the set keeps the object, so the id is not reused)."""
    return source.ref() if hasattr(source, "ref") else id(source)


def _state_keys(sources):
    """Each source's name for its PowerSGD state and seeded Q: the Keras variable's path, else the
    tf.Variable's name; two sources of one name raise ValueError."""
    keys = [getattr(s, "path", None) or getattr(s, "name", None) or f"source.{i}" for i, s in enumerate(sources)]
    if len(set(keys)) != len(keys):
        raise ValueError(
            f"PowerSGD keys its state by variable path, and these repeat: "
            f"{sorted(k for k in set(keys) if keys.count(k) > 1)}"
        )
    return keys


class _GradientAllreduce:
    """The gradient path shared by DistributedGradientTape and DistributedOptimizer.

    Dense gradients of one dtype are fused into one buffer and reduced by one
    named operation ("{name}.{dtype}"), so a compression codec keeps its error
    feedback per dtype group. IndexedSlices gradients (tf.gather, Embedding)
    take Horovod's sparse path unless ``sparse_as_dense``: their indices and
    values are allgathered ("{name}.sparse.{i}.indices/values", uncompressed)
    and the result is the IndexedSlices of every rank's rows (average: values /
    size), identical on every rank. The gradients' kinds, shapes and dtypes
    (a gathered gradient's rows excepted) are checked across ranks the first
    time a set of them is seen (``what`` names them in the MismatchError every
    rank raises when they differ). Sources registered as local (``register_local``)
    keep this rank's own gradient, divided by the ranks' count when
    ``scale_local_gradients`` (Horovod's local variables): they take no part in
    the reduction or its checks, so they may differ across ranks.
    """

    def __init__(self, compression, op, comm, name, what, sparse_as_dense=False, scale_local_gradients=True):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local = {}  # the local sources, by _identity
        self._powersgd = None
        if isinstance(compression, PowerSGD):
            if op != "average":
                raise ValueError(f"PowerSGD averages its factors: op must be 'average', not {op!r}")
            self._powersgd = _state_for(compression, name, self.comm)
            self._factors = [
                _GradientAllreduce(None, op, comm, f"{name}.{f}", f"the PowerSGD factors {f} of {what}")
                for f in ("P", "Q")
            ]
            compression = None  # the gradients PowerSGD leaves alone are averaged densely
        self.compression = compression
        # error feedback (every codec but none and PowerSGD): its residuals go into checkpoints
        self.residuals = _residual_state_for(name, self.comm) if canonical(compression) else None
        self.op = op
        self.name = name
        self.sparse_as_dense = bool(sparse_as_dense)
        self._what = what
        self._verified = set()

    def register_local(self, source):
        """``source`` (a variable or watched tensor) keeps this rank's own gradient."""
        self._local[_identity(source)] = source

    def reduce_gradients(self, grads, sources):
        """Reduced ``grads`` in their structure: None (no gradient) as zeros, IndexedSlices
        gathered (or made dense with sparse_as_dense); a local source's gradient is this
        rank's (None stays None)."""
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        local = [_identity(s) in self._local for s in flat_sources]
        shared = iter(
            self._reduce_shared(
                [g for g, mine in zip(flat_grads, local) if not mine],
                [s for s, mine in zip(flat_sources, local) if not mine],
            )
        )
        out = [self._local_gradient(g) if mine else next(shared) for g, mine in zip(flat_grads, local)]
        return tf.nest.pack_sequence_as(grads, out)

    def _local_gradient(self, grad):
        if grad is None or not self.scale_local_gradients:
            return grad
        size = self.comm.Get_size()
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values / size, grad.indices, dense_shape=grad.dense_shape)
        return grad / size

    def _reduce_shared(self, flat_grads, flat_sources):
        """The reduced gradients of the sources that are not local, as a flat list."""
        if not flat_sources:
            return []
        grads_in = [tf.zeros_like(s) if g is None else g for s, g in zip(flat_sources, flat_grads)]
        if self._powersgd is not None:  # PowerSGD factors dense matrices: IndexedSlices go dense
            dense = [tf.convert_to_tensor(g) for g in grads_in]
            reduced = self._powersgd.reduce(
                dense,
                _state_keys(flat_sources),
                self.comm,
                self.allreduce,
                self._factors[0].allreduce,
                self._factors[1].allreduce,
            )
            return list(reduced)
        gathered = [isinstance(g, tf.IndexedSlices) and not self.sparse_as_dense for g in grads_in]
        if any(gathered) and self.op not in ("average", "sum"):
            raise ValueError(
                f"IndexedSlices gradients are allgathered, which sums or averages them, not "
                f"op={self.op!r}: pass sparse_as_dense=True"
            )
        tensors = []
        for g, sparse in zip(grads_in, gathered):
            tensors.extend([g.indices, g.values] if sparse else [tf.convert_to_tensor(g)])
        reduced = iter(self._reduce(tensors, tuple(gathered)))
        out = []
        for g, sparse in zip(grads_in, gathered):
            if sparse:
                indices, values = next(reduced), next(reduced)
                out.append(tf.IndexedSlices(values, indices, dense_shape=g.dense_shape))
            else:
                out.append(next(reduced))
        return out

    def allreduce(self, tensors):
        """Reduce a list of dense tensors over all ranks (eagerly or inside a tf.function)."""
        return self._reduce([tf.convert_to_tensor(t) for t in tensors], (False,) * len(tensors))

    def _reduce(self, tensors, gathered):
        """tensors: one dense tensor per gradient, (indices, values) for each gathered one."""
        if not tensors:
            return []
        if tf.executing_eagerly():
            return [tf.convert_to_tensor(a) for a in self._reduce_arrays(gathered, *[t.numpy() for t in tensors])]
        if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            raise ValueError(
                "hpcdl's allreduce cannot run inside an XLA-compiled function: use "
                "tf.function(jit_compile=False), or model.compile(..., jit_compile=False) for Keras"
            )
        reduced = tf.numpy_function(
            lambda *arrays: self._reduce_arrays(gathered, *arrays),
            tensors,
            [t.dtype for t in tensors],
            stateful=True,
            name="hpcdl_allreduce",
        )
        for out, t in zip(reduced, tensors):
            out.set_shape(t.shape)
        position = 0
        for sparse in gathered:  # a gathered gradient's rows are known only after the run
            if sparse:
                reduced[position].set_shape([None])
                reduced[position + 1].set_shape([None] + tensors[position + 1].shape.as_list()[1:])
            position += 2 if sparse else 1
        return reduced

    def _check(self, gathered, arrays):
        entries, position = [], 0
        for i, sparse in enumerate(gathered):
            if sparse:
                indices, values = arrays[position : position + 2]
                entries += [
                    (f"gradient.{i}.indices", (), indices.dtype.name),
                    (f"gradient.{i}.values", values.shape[1:], values.dtype.name),
                ]
            else:
                entries.append((f"gradient.{i}", arrays[position].shape, arrays[position].dtype.name))
            position += 2 if sparse else 1
        signature = tuple(entries)
        if signature not in self._verified:
            check_same_through_engine(  # joined ranks take part: a tape made each step checks each step
                self.comm,
                entries,
                self._what,
                {
                    "op": self.op,
                    "name": self.name,
                    "compression": None if self.compression is None else repr(self.compression),
                },
                self.name,
                hpcdl.allgather,
            )
            self._verified.add(signature)

    def _reduce_arrays(self, gathered, *arrays):
        self._check(gathered, arrays)
        dense, sparse_handles, position = [], [], 0
        for i, sparse in enumerate(gathered):
            if sparse:
                name = f"{self.name}.sparse.{i}"
                sparse_handles.append(
                    (
                        position,
                        [
                            self._allgather(a, f"{name}.{part}")
                            for a, part in zip(arrays[position : position + 2], ("indices", "values"))
                        ],
                    )
                )
                position += 2
            else:
                dense.append(position)
                position += 1
        out = [None] * len(arrays)
        for i, array in zip(dense, self._reduce_dense([arrays[i] for i in dense])):
            out[i] = array
        for position, handles in sparse_handles:
            indices, values = (h.wait().view(a.dtype) for h, a in zip(handles, arrays[position : position + 2]))
            if self.op == "average":
                values = values / values.dtype.type(self.comm.Get_size())
            out[position], out[position + 1] = indices, values
        return out

    def _allgather(self, array, name):
        buffer, core_dtype = _core_view(array)
        return hpcdl.allgather_async(buffer, self.comm, name, core_dtype)

    def _reduce_dense(self, arrays):
        groups = {}
        for i, a in enumerate(arrays):
            groups.setdefault(a.dtype.name, []).append(i)
        extra = {} if self.compression is None else {"compression": self.compression}
        if self.residuals is not None:  # every group's restored residual fits before any is sent
            for dtype_name, members in groups.items():
                self.residuals.before_reduction(dtype_name, [arrays[i].shape for i in members])
        pending = []
        for dtype_name, members in groups.items():
            fused = np.concatenate([np.ravel(arrays[i]) for i in members])
            buffer, core_dtype = _core_view(fused)
            handle = hpcdl.allreduce_async(
                buffer, op=self.op, comm=self.comm, name=f"{self.name}.{dtype_name}", dtype=core_dtype, **extra
            )
            pending.append((handle, fused, members))
        out = [None] * len(arrays)
        for handle, fused, members in pending:
            handle.wait()
            offset = 0
            for i in members:
                n = arrays[i].size
                out[i] = fused[offset : offset + n].reshape(arrays[i].shape)
                offset += n
        return out


class DistributedGradientTape:
    """Wraps a tf.GradientTape: gradient() returns gradients reduced over all ranks.

    Gradients of one dtype are fused into one buffer and reduced by one named
    operation ("{name}.{dtype}"), so a compression codec keeps its error
    feedback per dtype group. A source with no gradient (None, the same on
    every rank for the same model) is reduced as zeros and returned as the
    reduced tensor. DistributedOptimizer (for Keras model.fit) reduces through
    the same path.

    compression: a codec from hpcdl.compression (None: dense); PowerSGD factors
    the float32 matrices (hpcdl.tensorflow.powersgd; its state, which
    outlives the tape, is powersgd_state(name)).
    op: "average" (default) or "sum" (PowerSGD: "average" only).
    comm: mpi4py communicator (default COMM_WORLD).
    sparse_as_dense: make IndexedSlices gradients (tf.gather, Embedding) dense
        and reduce them with the others. Otherwise (Horovod's sparse path) their
        indices and values are allgathered, uncompressed ("{name}.sparse.{i}.indices"
        and ".values") and the gradient is the IndexedSlices of every rank's
        rows (average: values / size); every rank must produce it each step.
        With PowerSGD, IndexedSlices gradients are always made dense.
    scale_local_gradients: the gradient of a source registered with
        register_local_source() is divided by the ranks' count (Horovod's default).
    The gradients' shapes and dtypes are checked across ranks the first time a
    set of them is seen: a model that differs raises MismatchError on every rank.
    """

    def __init__(
        self,
        tape,
        compression=None,
        op="average",
        comm=None,
        name="tf",
        sparse_as_dense=False,
        scale_local_gradients=True,
    ):
        self._tape = tape
        self._reduce = _GradientAllreduce(
            compression,
            op,
            comm,
            name,
            "the gradients of DistributedGradientTape",
            sparse_as_dense,
            scale_local_gradients,
        )

    def __getattr__(self, attr):  # watch(), stop_recording(), ... of the wrapped tape
        return getattr(self._tape, attr)

    def gradient(self, target, sources, output_gradients=None):
        return self._reduce.reduce_gradients(self._tape.gradient(target, sources, output_gradients), sources)

    def register_local_source(self, source):
        """``source`` is this rank's own (Horovod's local variable): gradient() returns its
        local gradient (scaled, see scale_local_gradients), not reduced nor checked across ranks."""
        self._reduce.register_local(source)

    def allreduce(self, tensors):
        """Reduce a list of tensors over all ranks (eagerly or inside a tf.function)."""
        return self._reduce.allreduce(tensors)


def broadcast_variables(variables, root=0, comm=None):
    """Assign rank ``root``'s values to every rank's variables (eagerly; call it outside tf.function).

    Shapes and dtypes are checked across ranks first (MismatchError on every
    rank when a variable is missing or differs).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    variables = list(variables)
    values = [np.array(v.numpy()) for v in variables]
    check_same_on_all_ranks(
        comm,
        [(f"variable.{i}", a.shape, a.dtype.name) for i, a in enumerate(values)],
        "the variables to broadcast",
        {"root": int(root)},
    )
    pending = []
    for i, value in enumerate(values):
        if value.dtype.name in hpcdl.DTYPES:
            buffer, core_dtype = _core_view(value)
            pending.append(
                hpcdl.broadcast_async(buffer, root=root, comm=comm, name=f"tf.broadcast.{i}", dtype=core_dtype)
            )
        else:
            raise TypeError(
                f"variable {i} ({getattr(variables[i], 'path', variables[i].name)}) has dtype "
                f"{value.dtype}, which hpcdl does not broadcast"
            )
    for handle in pending:
        handle.wait()
    for variable, value in zip(variables, values):
        variable.assign(value)
