"""Horovod's Keras callbacks: the broadcast and metric-average ones are hpcdl.tensorflow's;
the learning-rate ones change the optimizer's learning-rate variable; BestModelCheckpoint
is Keras' ModelCheckpoint saving on rank 0 only."""

import tensorflow as tf

import hpcdl.tensorflow
from hpcdl.horovod import common
from hpcdl.horovod.common import global_process_set


def _check_device(device):
    common.check_default("device", device, "", "hpcdl reduces in host memory")


class BroadcastGlobalVariablesCallback(hpcdl.tensorflow.BroadcastGlobalVariablesCallback):
    """Every rank starts from rank ``root_rank``'s weights and optimizer state; ``process_set``
    (hpcdl's addition): every rank of the set, ``root_rank`` one of them (a rank of init()'s
    communicator). ``register_local_var(var)`` keeps a variable (and its optimizer state) each
    rank's own, as in Horovod."""

    def __init__(self, root_rank, device="", process_set=global_process_set):
        _check_device(device)
        super().__init__(root=common.root_in(process_set, root_rank), comm=common.comm_of(process_set))


class MetricAverageCallback(hpcdl.tensorflow.MetricAverageCallback):
    """The epoch's metrics become their average over the ranks (of ``process_set``, hpcdl's
    addition); put it before callbacks reading them."""

    def __init__(self, device="", process_set=global_process_set):
        _check_device(device)
        super().__init__(comm=common.comm_of(process_set))


class LearningRateScheduleCallback(tf.keras.callbacks.Callback):
    """Horovod's learning-rate schedule: from ``start_epoch`` until ``end_epoch`` the
    learning rate is ``initial_lr * multiplier(epoch)`` (a number: a constant factor),
    set at each epoch's start (``staircase``) or before each batch with a fractional
    epoch. The learning rate is a variable in Keras 3, so the compiled train step sees
    each change. momentum_correction (Horovod scales SGD's momentum by the change of the
    learning rate for one batch) is not possible here: Keras 3 compiles SGD's momentum
    as a constant, so True raises ValueError for an optimizer with momentum."""

    def __init__(
        self,
        initial_lr,
        multiplier,
        start_epoch=0,
        end_epoch=None,
        staircase=True,
        momentum_correction=True,
        steps_per_epoch=None,
    ):
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None

    def _in_range(self, epoch):
        return self.start_epoch <= epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _optimizer(self):
        optimizer = self.model.optimizer
        return getattr(optimizer, "inner_optimizer", optimizer)

    def _adjust(self, epoch):
        self._optimizer().learning_rate.assign(self.initial_lr * self.multiplier(epoch))

    def on_train_begin(self, logs=None):
        if self.momentum_correction and float(getattr(self._optimizer(), "momentum", 0) or 0) != 0:
            raise ValueError(
                "momentum_correction=True is not supported by hpcdl.horovod (Keras 3 compiles the "
                "optimizer's momentum as a constant): pass momentum_correction=False"
            )
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = (self.params or {}).get("steps")
            if not self.steps_per_epoch:
                raise ValueError(
                    "steps_per_epoch is needed when staircase=False and Keras cannot tell it "
                    "(a dataset of unknown length): pass steps_per_epoch"
                )

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch
        if self.staircase and self._in_range(epoch):
            self._adjust(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        if not self.staircase and self._in_range(self.current_epoch):
            self._adjust(self.current_epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(self._optimizer().learning_rate.numpy())


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod's gradual warm-up: over ``warmup_epochs`` the learning rate rises from
    ``initial_lr / size()`` to ``initial_lr`` (Goyal et al., "Accurate, Large Minibatch
    SGD"), adjusted before every batch."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch  # the learning rate after this batch
            return 1.0 / common.size() * (epoch * (common.size() - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
        )
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and common.rank() == 0:
            print(
                f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                f"{float(self._optimizer().learning_rate.numpy()):g}."
            )


class BestModelCheckpoint(tf.keras.callbacks.ModelCheckpoint):
    """Horovod's BestModelCheckpoint: Keras' ModelCheckpoint with save_best_only=True, saving on
    rank 0 only (the other ranks would write the same file at once). As in Horovod there is no
    filepath parameter (Horovod's Spark estimator sets it): set ``filepath`` before fit() on
    every rank that has the callback; fit() raises ValueError where it is None."""

    def __init__(self, monitor="val_loss", verbose=0, save_weights_only=False, mode="auto", save_freq="epoch"):
        # Keras checks the file's suffix when it is made: a placeholder until filepath is set.
        super().__init__(
            filepath=".weights.h5" if save_weights_only else ".keras",
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )
        self.filepath = None

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint has no filepath: set callback.filepath before fit()")
        super().on_train_begin(logs)

    def on_train_batch_end(self, batch, logs=None):
        if common.rank() == 0:
            super().on_train_batch_end(batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if common.rank() == 0:
            super().on_epoch_end(epoch, logs)


__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "BestModelCheckpoint",
]
