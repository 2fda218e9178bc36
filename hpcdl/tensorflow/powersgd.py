"""PowerSGD (hpcdl.compression.PowerSGD) in DistributedGradientTape and the Keras
DistributedOptimizer: low-rank factors of the gradient matrices, averaged with the
tape's dense allreduce.

The semantics are the torch path's (docs/compression.md): each float32 gradient the
codec compresses (PowerSGD.compresses), viewed as n x m, is per step after the warm-up

    M = grad + residual;  P = mean over ranks of M Q;  P <- orthogonalize(P) (Gram-Schmidt);
    Q = mean over ranks of M^T P;  approx = P Q^T;  residual = M - approx (0 where not finite);
    Q's dead (all-zero or non-finite) columns restart from the seeded Q

with TensorFlow's matmul, the P's of all matrices in one fused allreduce ("{name}.P.float32")
and the Q's in another ("{name}.Q.float32"); every other gradient is averaged densely
("{name}.{dtype}"). During the warm-up and on a one-rank communicator every gradient is
averaged densely. The state (steps, Q and the residual per matrix) lives in a tf.Module,
one per operation name, that tf.train.Checkpoint saves: powersgd_state(name). Under
hpcdl.join a joined rank contributes zero P and Q and its state stays; at the first step
after the join every rank takes the step count and Q of the rank that joined last, as in
torch (hpcdl.torch.powersgd.Schedule.share), each keeping its own residuals.
"""

import numpy as np
import tensorflow as tf

import hpcdl
from hpcdl._agree import check_same_on_all_ranks
from hpcdl.collectives import _joins_completed
from hpcdl.compression import PowerSGD

__all__ = ["PowerSGDState", "powersgd_state"]

_STATES = {}  # operation name -> PowerSGDState: a tape made every step finds its state again


def powersgd_state(name):
    """The PowerSGD state of the DistributedGradientTape or DistributedOptimizer named ``name``
    (a tf.Module: ``tf.train.Checkpoint(powersgd=powersgd_state("tf"))`` saves and restores it)."""
    try:
        return _STATES[name]
    except KeyError:
        raise KeyError(f"no PowerSGD state named {name!r} (known: {sorted(_STATES)})") from None


def _start_afresh(name):
    """A new optimizer named ``name``: its PowerSGD state starts anew, not an earlier one's."""
    _STATES.pop(name, None)


def _state_for(codec, name, comm):
    state = _STATES.get(name)
    if state is None:
        state = _STATES[name] = PowerSGDState(codec, name, _joins_completed(comm)[0])
    elif state.codec != codec:
        raise ValueError(
            f"the PowerSGD state named {name!r} is for {state.codec!r}, not {codec!r}: "
            f"give this tape or optimizer another name"
        )
    return state


def orthogonalize(p):
    """Gram-Schmidt on the columns of the n x r matrix p: each column minus its projection on
    the earlier ones, then divided by its norm (at least PowerSGD.MIN_NORM: zero stays zero)."""
    cols = []
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        if cols:
            done = tf.concat(cols, axis=1)
            col = col - tf.matmul(done, tf.matmul(done, col, transpose_a=True))
        cols.append(col / tf.maximum(tf.norm(col), PowerSGD.MIN_NORM))
    return tf.concat(cols, axis=1)


class PowerSGDState(tf.Module):
    """steps (the steps reduced so far, the warm-up counts them) and per compressed variable,
    keyed by its path, q (m x rank, the same on every rank) and residual (n x m, this rank's)."""

    def __init__(self, codec, name, joins_seen=0):
        super().__init__()
        self.codec = codec
        self._name = name
        self._joins_seen = joins_seen  # the joins after which the ranks took the shared state
        self.steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="steps")
        self.q = {}
        self.residual = {}

    def _ensure(self, keys, shapes, comm):
        """The variables of the matrices not seen before (made outside any tf.function); the
        matrices' names and shapes are checked across ranks first (MismatchError on every rank)."""
        new = [(k, s) for k, s in zip(keys, shapes) if k not in self.q]
        if not new:
            return
        check_same_on_all_ranks(
            comm, [(k, s, "float32") for k, s in new], "the matrices PowerSGD compresses", {"codec": repr(self.codec)}
        )
        with tf.init_scope():
            for key, (n, m) in new:
                self.q[key] = tf.Variable(self.codec.initial_q(key, m), trainable=False, name="q")
                self.residual[key] = tf.Variable(tf.zeros((n, m), tf.float32), trainable=False, name="residual")

    def _share_after_join(self, comm):
        """At the first step after a join (collective): the ranks that joined early stepped
        less, so every rank takes the step count and every Q from the rank that joined last;
        each keeps its own residuals. A host function, so that it runs in a tf.function too."""
        keys = sorted(self.q)

        def share(steps, *qs):
            seen, last = _joins_completed(comm)
            if seen == self._joins_seen:
                return (steps, *qs)
            self._joins_seen = seen
            steps = np.array(steps, np.int64).reshape(1)
            flat = np.concatenate([np.asarray(q, np.float32).ravel() for q in qs])
            handles = [
                hpcdl.broadcast_async(steps, root=last, comm=comm, name=f"{self._name}.join.steps"),
                hpcdl.broadcast_async(flat, root=last, comm=comm, name=f"{self._name}.join.Q"),
            ]
            for handle in handles:
                handle.wait()
            ends = np.cumsum([q.size for q in qs])[:-1]
            return (steps.reshape(()), *[f.reshape(q.shape) for f, q in zip(np.split(flat, ends), qs)])

        variables = [self.steps] + [self.q[k] for k in keys]
        shared = tf.numpy_function(share, variables, [v.dtype for v in variables], stateful=True)
        for v, value in zip(variables, shared):
            v.assign(tf.reshape(value, v.shape))

    def reduce(self, grads, keys, comm, dense, allreduce_p, allreduce_q):
        """The averaged gradients: low-rank approximations for the compressed ones (after the
        warm-up), dense averages (``dense``, a list -> list allreduce) for the others."""
        low = [
            i
            for i, g in enumerate(grads)
            if g.dtype == tf.float32 and g.shape.is_fully_defined() and self.codec.compresses(g.shape)
        ]
        if comm.Get_size() == 1 or not low:
            return dense(grads)
        shapes = [self.codec.matrix_shape(grads[i].shape) for i in low]
        names = [keys[i] for i in low]
        self._ensure(names, shapes, comm)
        rest = [i for i in range(len(grads)) if i not in set(low)]
        self._share_after_join(comm)

        def compressed():
            out = list(grads)
            for i, g in zip(rest, dense([grads[i] for i in rest])):
                out[i] = g
            ms = [tf.reshape(grads[i], s) + self.residual[k] for i, s, k in zip(low, shapes, names)]
            ps = allreduce_p([tf.matmul(mat, self.q[k]) for mat, k in zip(ms, names)])
            ps = [orthogonalize(p) for p in ps]
            qs = allreduce_q([tf.matmul(mat, p, transpose_a=True) for mat, p in zip(ms, ps)])
            for i, mat, p, q, k in zip(low, ms, ps, qs, names):
                approx = tf.matmul(p, q, transpose_b=True)
                missed = mat - approx
                self.residual[k].assign(tf.where(tf.math.is_finite(missed), missed, tf.zeros_like(missed)))
                dead = tf.logical_or(
                    tf.logical_not(tf.reduce_all(tf.math.is_finite(q), axis=0)), tf.reduce_all(tf.equal(q, 0.0), axis=0)
                )
                self.q[k].assign(tf.where(dead[tf.newaxis, :], self.codec.initial_q(k, q.shape[0]), q))
                out[i] = tf.reshape(approx, grads[i].shape)
            return out

        out = tf.cond(self.steps >= self.codec.warmup_steps, compressed, lambda: dense(grads))
        self.steps.assign_add(1)
        return out
