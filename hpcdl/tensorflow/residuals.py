"""The error-feedback residuals of DistributedGradientTape and the Keras DistributedOptimizer
in a tf.train.Checkpoint.

With a codec that keeps error feedback (Int8, FP16, BF16, TopK) the engine holds one
float32 residual per fused operation "{name}.{dtype}", per rank. residual_state(name) (the
Keras optimizer's attribute ``residual_state``) is a trackable object that
tf.train.Checkpoint saves and restores: saving reads this rank's residuals from the engine
with the shapes of their gradients; restoring checks them against the gradients (at once
when a step has shown them, else at the next step, before anything is sent) and sets them
for the next reduction, or raises ValueError. A dtype group the checkpoint has no residual
for starts from zero, as the torch optimizer's load_state_dict() does.
"""

import io
import json
import zipfile

import numpy as np
import tensorflow as tf
from mpi4py import MPI
from tensorflow.python.trackable import base  # custom tensors in a checkpoint (no public API)

import hpcdl
import hpcdl.compression

__all__ = ["ResidualState", "residual_state"]

_STATES = {}  # (operation name, communicator handle) -> ResidualState: a tape made every step finds it again
_KEY = "residuals"


def residual_state(name, comm=None):
    """The residual state of the DistributedGradientTape or DistributedOptimizer named ``name``
    on ``comm`` (default COMM_WORLD): ``tf.train.Checkpoint(residuals=residual_state("tf"))``
    saves and restores it."""
    comm = MPI.COMM_WORLD if comm is None else comm
    try:
        return _STATES[name, comm.py2f()]
    except KeyError:
        known = sorted(n for n, _ in _STATES)
        raise KeyError(
            f"no error-feedback residual state named {name!r} on this communicator (known: {known})"
        ) from None


def _residual_state_for(name, comm):
    key = (name, comm.py2f())
    if key not in _STATES or _STATES[key].comm != comm:  # a freed communicator's handle may be reused
        _STATES[key] = ResidualState(name, comm)
    return _STATES[key]


def _count(shapes):
    """Elements of a fused group of gradients of these shapes."""
    return sum(int(np.prod(shape)) for shape in shapes)


def _start_afresh(name, comm):
    """A new optimizer named ``name`` on ``comm``: nothing of an earlier one of that name is added."""
    _STATES.pop((name, comm.py2f()), None)
    for dtype_name in hpcdl.DTYPES:
        hpcdl.compression.free_residual(f"{name}.{dtype_name}", comm)


class ResidualState(base.Trackable):
    """This rank's error-feedback residuals of the fused operations "{name}.{dtype}" on ``comm``."""

    def __init__(self, name, comm):
        self.name, self.comm = name, comm
        self._shapes = {}  # dtype name -> its gradients' shapes, in fused order, as last reduced
        self._pending = {}  # dtype name -> (shapes, residual) restored, for its next reduction
        self._since_restore = None  # after a restore: the groups set since (the others start from zero)

    def _operation(self, dtype_name):
        return f"{self.name}.{dtype_name}"

    def _serialize_to_tensors(self):
        saved = {}
        for dtype_name in hpcdl.DTYPES:
            if dtype_name in self._pending:
                saved[dtype_name] = self._pending[dtype_name]
                continue
            values = hpcdl.compression.residual(self._operation(dtype_name), self.comm)
            if values is not None and dtype_name in self._shapes:
                saved[dtype_name] = (self._shapes[dtype_name], values)
        shapes = {dtype_name: [list(s) for s in group] for dtype_name, (group, _) in saved.items()}
        blob = io.BytesIO()
        np.savez(blob, shapes=np.array(json.dumps(shapes)), **{d: values for d, (_, values) in saved.items()})
        return {_KEY: tf.constant(blob.getvalue())}

    def _restore_from_tensors(self, restored_tensors):
        try:
            with np.load(io.BytesIO(restored_tensors[_KEY].numpy()), allow_pickle=False) as saved:
                shapes = json.loads(str(saved["shapes"]))
                pending = {d: ([tuple(s) for s in shapes[d]], saved[d]) for d in shapes}
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
            raise ValueError(
                f"the checkpoint's error-feedback residuals of '{self.name}' cannot be read "
                f"({type(exc).__name__}: {exc}): the file is damaged or not one residual_state() saved"
            ) from exc
        for dtype_name, (group, values) in pending.items():
            if values.dtype != np.float32 or values.ndim != 1 or values.size != _count(group):
                raise ValueError(
                    f"the checkpoint's residual of '{self._operation(dtype_name)}' is {values.ndim}-D "
                    f"{values.dtype} of {values.size} values, not float32 for gradients of shapes {group}"
                )
            if dtype_name in self._shapes:
                self._check_fits(dtype_name, group, self._shapes[dtype_name])
        self._pending, self._since_restore = pending, set()
        return tf.no_op()

    def _check_fits(self, dtype_name, saved, shapes):
        if list(saved) != list(shapes):
            raise ValueError(
                f"the checkpoint's residual of '{self._operation(dtype_name)}' is for gradients of shapes "
                f"{list(saved)}, this rank reduces {list(shapes)}: the model (and its variables' order) "
                f"must be the saver's"
            )

    def before_reduction(self, dtype_name, shapes):
        """Called before the group ``dtype_name`` (its gradients' ``shapes``) is submitted: sets
        the residual restored for it (ValueError, nothing sent, if it does not fit), or zero
        when a restore had none for it."""
        shapes = [tuple(s) for s in shapes]
        self._shapes[dtype_name] = shapes
        if self._since_restore is None or dtype_name in self._since_restore:
            return
        restored = self._pending.get(dtype_name)
        if restored is None:
            values = np.zeros(_count(shapes), np.float32)
        else:
            self._check_fits(dtype_name, restored[0], shapes)
            values = restored[1]
        hpcdl.compression.set_residual(self._operation(dtype_name), values, self.comm)
        self._pending.pop(dtype_name, None)
        self._since_restore.add(dtype_name)
