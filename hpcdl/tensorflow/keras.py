"""Keras model.fit over the ranks: DistributedOptimizer and the two callbacks.

    model.compile(optimizer=hpcdl.tensorflow.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=...)
    model.fit(dataset, callbacks=[hpcdl.tensorflow.BroadcastGlobalVariablesCallback(0),
                                  hpcdl.tensorflow.MetricAverageCallback()])

The gradient path is DistributedGradientTape's (hpcdl.tensorflow.tape).
"""

import numpy as np
import tensorflow as tf
from mpi4py import MPI

import hpcdl
from hpcdl._agree import check_same_on_all_ranks
from hpcdl.compression import PowerSGD
from hpcdl.tensorflow import powersgd, residuals
from hpcdl.tensorflow.powersgd import powersgd_state
from hpcdl.tensorflow.tape import _GradientAllreduce, _identity, broadcast_variables

__all__ = ["DistributedOptimizer", "BroadcastGlobalVariablesCallback", "MetricAverageCallback", "load_model"]


class _DistributedOptimizerMixin:
    """Keras 3 optimizer whose apply() first averages the gradients over all ranks.

    Keras routes every update through apply(): apply_gradients() and
    model.fit's train_step call it, eagerly or inside the train function's
    tf.function. Reducing there, before Keras filters empty gradients, unscales
    a loss-scaled step, accumulates or clips, keeps the step identical to a
    single process on the global batch.
    """

    def register_local_var(self, var):
        """``var`` is this rank's own (Horovod's local variable): its gradient is not reduced
        (divided by the ranks' count unless scale_local_gradients=False)."""
        self._hpcdl_allreduce.register_local(var)

    def apply(self, grads, trainable_variables=None):
        sources = self._trainable_variables if trainable_variables is None and self.built else trainable_variables
        if sources is not None:
            grads = self._hpcdl_allreduce.reduce_gradients(list(grads), list(sources))
        return super().apply(grads, trainable_variables)


def DistributedOptimizer(
    optimizer,
    compression=None,
    op="average",
    comm=None,
    name="keras",
    sparse_as_dense=False,
    scale_local_gradients=True,
):
    """A copy of a Keras optimizer whose updates use gradients reduced over all ranks (for model.fit).

        model.compile(optimizer=hpcdl.tensorflow.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=...)
        model.fit(dataset, callbacks=[hpcdl.tensorflow.BroadcastGlobalVariablesCallback(0),
                                      hpcdl.tensorflow.MetricAverageCallback()])

    Returns an instance of a subclass of the optimizer's class (``DistributedSGD``
    for ``SGD``) made from its config, so isinstance and learning-rate schedules
    work as before. Wrap the optimizer before it is built (before training).
    Under a mixed_float16 policy wrap the LossScaleOptimizer (Keras adds one
    around the DistributedOptimizer otherwise, and its finiteness check would
    see each rank's own gradients): DistributedOptimizer(LossScaleOptimizer(opt)).
    The gradient path is DistributedGradientTape's: one fused allreduce per
    dtype named "{name}.{dtype}", compression a codec from hpcdl.compression,
    op "average" or "sum", shapes checked across ranks on the first step;
    IndexedSlices gradients allgathered, or made dense with sparse_as_dense=True.
    With compression=PowerSGD(...) its state (Q and the residuals) is the
    optimizer's attribute ``powersgd_state``; with another codec this rank's
    error-feedback residuals are ``residual_state``: tf.train.Checkpoint(optimizer=...)
    saves and restores either.
    ``register_local_var(var)`` keeps a variable's gradient this rank's own (Horovod's
    local variables), divided by the ranks' count when scale_local_gradients.
    """
    if not isinstance(optimizer, tf.keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, not {type(optimizer).__name__}")
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("the optimizer is already a hpcdl DistributedOptimizer")
    if optimizer.built:
        raise ValueError("wrap the optimizer before it is built: its variables would not be carried over")
    cls = type(f"Distributed{type(optimizer).__name__}", (_DistributedOptimizerMixin, type(optimizer)), {})
    distributed = cls.from_config(optimizer.get_config())
    powersgd._start_afresh(name)  # a tape reuses its name's state step after step; a new optimizer does not
    residuals._start_afresh(name, MPI.COMM_WORLD if comm is None else comm)
    distributed._hpcdl_allreduce = _GradientAllreduce(
        compression, op, comm, name, "the gradients of DistributedOptimizer", sparse_as_dense, scale_local_gradients
    )
    # tracked: tf.train.Checkpoint(optimizer=...) saves them with the optimizer's variables
    if isinstance(compression, PowerSGD):
        distributed.powersgd_state = powersgd_state(name)
    elif distributed._hpcdl_allreduce.residuals is not None:
        distributed.residual_state = distributed._hpcdl_allreduce.residuals
    return distributed


def _keras_optimizer_classes(base=tf.keras.optimizers.Optimizer):
    for cls in base.__subclasses__():
        if not issubclass(cls, _DistributedOptimizerMixin):
            yield cls
            yield from _keras_optimizer_classes(cls)


def load_model(
    filepath,
    compression=None,
    op="average",
    comm=None,
    name="keras",
    custom_objects=None,
    sparse_as_dense=False,
    **kwargs,
):
    """keras.models.load_model for a model saved while training with DistributedOptimizer.

    The file names the optimizer class "Distributed<Class>", which only exists
    in a process that wrapped such an optimizer: this rebuilds the saved optimizer
    (its state included) wrapped again with the given settings, so training goes
    on over the ranks. A model for inference alone loads anywhere with
    keras.models.load_model(filepath, compile=False).
    """

    def rewrap(base):
        return classmethod(
            lambda cls, config, custom_objects=None: DistributedOptimizer(
                base.from_config(config),
                compression=compression,
                op=op,
                comm=comm,
                name=name,
                sparse_as_dense=sparse_as_dense,
            )
        )

    rebuild = {
        f"Distributed{base.__name__}": type(f"Distributed{base.__name__}", (base,), {"from_config": rewrap(base)})
        for base in set(_keras_optimizer_classes())
    }
    rebuild.update(custom_objects or {})
    return tf.keras.models.load_model(filepath, custom_objects=rebuild, **kwargs)


class BroadcastGlobalVariablesCallback(tf.keras.callbacks.Callback):
    """Keras callback: every rank starts from rank ``root``'s weights and optimizer state.

    Broadcasts the model's variables when training begins, and the model's and
    the optimizer's variables after the first batch (Keras creates optimizer
    state lazily, on the first update). Gradients are averaged by
    DistributedOptimizer (model.fit), or by DistributedGradientTape in a custom
    train_step (see docs/frameworks.md). Variables registered with
    register_local_var() keep each rank's values, and so does the optimizer
    state Keras makes for them.
    """

    def __init__(self, root=0, comm=None):
        super().__init__()
        self.root = root
        self.comm = comm
        self._after_first_batch = False
        self._local = {}  # the local variables, by _identity

    def register_local_var(self, var):
        """``var`` is this rank's own (Horovod's local variable): not broadcast."""
        self._local[_identity(var)] = var

    def _shared(self, variables):
        """``variables`` less the local ones and the optimizer variables Keras made for them
        (add_variable_from_reference names those after the variable's path)."""
        local_paths = tuple(v.path.replace("/", "_") + "_" for v in self._local.values() if hasattr(v, "path"))
        return [
            v
            for v in variables
            if _identity(v) not in self._local and not (local_paths and str(v.name).startswith(local_paths))
        ]

    def on_train_begin(self, logs=None):
        optimizer = self.model.optimizer
        if isinstance(optimizer, tf.keras.optimizers.LossScaleOptimizer) and isinstance(
            optimizer.inner_optimizer, _DistributedOptimizerMixin
        ):
            # its finiteness check would run on each rank's own gradients: ranks could disagree on the step
            raise ValueError(
                "a LossScaleOptimizer (Keras adds one for mixed_float16) wraps hpcdl's "
                "DistributedOptimizer: wrap it instead, DistributedOptimizer(LossScaleOptimizer(opt))"
            )
        broadcast_variables(self._shared(self.model.variables), root=self.root, comm=self.comm)

    def on_train_batch_end(self, batch, logs=None):
        if self._after_first_batch:
            return
        self._after_first_batch = True
        optimizer_variables = list(getattr(self.model.optimizer, "variables", []) or [])
        broadcast_variables(
            self._shared(list(self.model.variables) + optimizer_variables), root=self.root, comm=self.comm
        )


class MetricAverageCallback(tf.keras.callbacks.Callback):
    """Keras callback: the epoch's logs (loss, metrics, val_*) become their average over the ranks.

    Put it before callbacks that read the logs (ModelCheckpoint, EarlyStopping,
    ...): Keras passes one logs dict to the callbacks in order, and its History
    and progress bar come last. One allreduce of the numeric values per epoch;
    ranks whose logs name other metrics raise MismatchError on every rank.
    """

    def __init__(self, comm=None):
        super().__init__()
        self.comm = MPI.COMM_WORLD if comm is None else comm

    def on_epoch_end(self, epoch, logs=None):
        logs = {} if logs is None else logs
        names = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.number)))
        check_same_on_all_ranks(self.comm, [(k, (), "float64") for k in names], "the metrics to average")
        values = np.array([logs[k] for k in names], dtype=np.float64)
        if names:
            hpcdl.allreduce(values, op="average", comm=self.comm, name="keras.metrics")
        logs.update(zip(names, values.tolist()))
