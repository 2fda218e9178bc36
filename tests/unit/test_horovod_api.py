"""hpcdl.horovod in one process: Horovod's names and signatures, its error types,
and clear errors for what hpcdl cannot honour (tests/mpi/test_horovod_*_mpi.py
run the collectives on 4 ranks)."""

import inspect

import numpy as np
import pytest
import tensorflow as tf
import torch

import hpcdl.horovod.keras as hvd_keras_alias
import hpcdl.horovod.tensorflow as hvd_tf
import hpcdl.horovod.tensorflow.keras as hvd_keras
import hpcdl.horovod.torch as hvd
from hpcdl.errors import HpcdlError, MismatchError
from hpcdl.horovod import common

from conftest import outcome

# Horovod's parameters, in Horovod's order (0.28's process_set included).
TORCH_SIGNATURES = {
    "init": ["comm", "process_sets"],
    "join": ["device"],
    "allreduce": [
        "tensor",
        "average",
        "name",
        "compression",
        "op",
        "prescale_factor",
        "postscale_factor",
        "process_set",
    ],
    "allreduce_": ["tensor", "average", "name", "op", "prescale_factor", "postscale_factor", "process_set"],
    "allreduce_async": ["tensor", "average", "name", "op", "prescale_factor", "postscale_factor", "process_set"],
    "allreduce_async_": ["tensor", "average", "name", "op", "prescale_factor", "postscale_factor", "process_set"],
    "grouped_allreduce": [
        "tensors",
        "average",
        "name",
        "compression",
        "op",
        "prescale_factor",
        "postscale_factor",
        "process_set",
    ],
    "grouped_allreduce_": ["tensors", "average", "name", "op", "prescale_factor", "postscale_factor", "process_set"],
    "grouped_allreduce_async": [
        "tensors",
        "average",
        "name",
        "op",
        "prescale_factor",
        "postscale_factor",
        "process_set",
    ],
    "grouped_allreduce_async_": [
        "tensors",
        "average",
        "name",
        "op",
        "prescale_factor",
        "postscale_factor",
        "process_set",
    ],
    "broadcast": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_async": ["tensor", "root_rank", "name", "process_set"],
    "broadcast_async_": ["tensor", "root_rank", "name", "process_set"],
    "poll": ["handle"],
    "synchronize": ["handle"],
    "barrier": ["process_set"],
    "add_process_set": ["process_set"],
    "remove_process_set": ["process_set"],
    "broadcast_object": ["obj", "root_rank", "name", "process_set"],
    # process_set last: hpcdl's addition (Horovod 0.28 broadcasts these over every rank)
    "broadcast_parameters": ["params", "root_rank", "prefix", "process_set"],
    "broadcast_optimizer_state": ["optimizer", "root_rank", "model", "process_set"],
    "DistributedOptimizer": [
        "optimizer",
        "named_parameters",
        "compression",
        "backward_passes_per_step",
        "op",
        "gradient_predivide_factor",
        "num_groups",
        "groups",
        "sparse_as_dense",
        "process_set",
    ],
    "start_timeline": ["file_path", "mark_cycles"],
    "allgather": ["tensor", "name", "process_set"],
    "allgather_async": ["tensor", "name", "process_set"],
    "grouped_allgather": ["tensors", "name", "process_set"],
    "grouped_allgather_async": ["tensors", "name", "process_set"],
    "allgather_object": ["obj", "name", "process_set"],
    "reducescatter": ["tensor", "name", "compression", "op", "process_set", "prescale_factor", "postscale_factor"],
    "reducescatter_async": ["tensor", "name", "op", "process_set", "prescale_factor", "postscale_factor"],
    "grouped_reducescatter": [
        "tensors",
        "name",
        "compression",
        "op",
        "process_set",
        "prescale_factor",
        "postscale_factor",
    ],
    "grouped_reducescatter_async": ["tensors", "name", "op", "process_set", "prescale_factor", "postscale_factor"],
    "alltoall": ["tensor", "splits", "name", "process_set"],
    "alltoall_async": ["tensor", "splits", "name", "process_set"],
    "SyncBatchNorm": ["num_features", "eps", "momentum", "affine", "track_running_stats"],
}
TF_SIGNATURES = {
    "join": [],
    "allreduce": [
        "tensor",
        "average",
        "device_dense",
        "device_sparse",
        "compression",
        "op",
        "prescale_factor",
        "postscale_factor",
        "name",
        "process_set",
        "ignore_name_scope",
    ],
    "broadcast": ["tensor", "root_rank", "name", "process_set", "ignore_name_scope"],
    "grouped_allreduce": [
        "tensors",
        "average",
        "device_dense",
        "device_sparse",
        "compression",
        "op",
        "prescale_factor",
        "postscale_factor",
        "process_set",
    ],
    "broadcast_variables": ["variables", "root_rank", "process_set", "inplace"],
    "broadcast_object": ["obj", "root_rank", "session", "name", "process_set"],
    "DistributedGradientTape": [
        "gradtape",
        "device_dense",
        "device_sparse",
        "compression",
        "sparse_as_dense",
        "op",
        "gradient_predivide_factor",
        "num_groups",
        "groups",
        "process_set",
        "scale_local_gradients",
    ],
    "allgather": ["tensor", "name", "ignore_name_scope", "process_set"],
    "grouped_allgather": ["tensors", "name", "ignore_name_scope", "process_set"],
    "allgather_object": ["obj", "session", "name", "process_set"],
    "reducescatter": [
        "tensor",
        "device_dense",
        "compression",
        "op",
        "name",
        "process_set",
        "ignore_name_scope",
        "prescale_factor",
        "postscale_factor",
    ],
    "grouped_reducescatter": [
        "tensors",
        "device_dense",
        "compression",
        "op",
        "process_set",
        "prescale_factor",
        "postscale_factor",
    ],
    "alltoall": ["tensor", "splits", "name", "ignore_name_scope", "process_set"],
}
KERAS_SIGNATURES = {
    "DistributedOptimizer": [
        "optimizer",
        "name",
        "device_dense",
        "device_sparse",
        "compression",
        "sparse_as_dense",
        "gradient_predivide_factor",
        "op",
        "backward_passes_per_step",
        "average_aggregated_gradients",
        "num_groups",
        "groups",
        "process_set",
        "scale_local_gradients",
    ],
    "allreduce": ["value", "name", "average", "prescale_factor", "postscale_factor", "op", "compression"],
    "broadcast": ["value", "root_rank", "name"],
    "load_model": ["filepath", "custom_optimizers", "custom_objects", "compression"],
    "broadcast_global_variables": ["root_rank"],
    "allgather": ["value", "name"],
    "reducescatter": ["value", "name", "op"],
}
BASICS = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "start_timeline",
    "stop_timeline",
    "barrier",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "Compression",
    "HorovodInternalError",
    "ProcessSet",
    "add_process_set",
    "remove_process_set",
]


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield


def _parameters(fn):
    return list(inspect.signature(fn).parameters)


@pytest.mark.parametrize(
    "module,signatures", [(hvd, TORCH_SIGNATURES), (hvd_tf, TF_SIGNATURES), (hvd_keras, KERAS_SIGNATURES)]
)
def test_names_have_horovods_signatures(module, signatures):
    for name, parameters in signatures.items():
        assert _parameters(getattr(module, name)) == parameters, name
    for name in BASICS:
        assert callable(getattr(module, name)) or isinstance(getattr(module, name), int), name
    assert sorted(module.__all__) == sorted(set(module.__all__)) and all(hasattr(module, n) for n in module.__all__)


def test_keras_alias_and_callbacks():
    assert hvd_keras_alias.DistributedOptimizer is hvd_keras.DistributedOptimizer
    assert hvd_keras_alias.callbacks.MetricAverageCallback is hvd_keras.callbacks.MetricAverageCallback
    assert hvd_keras_alias.callbacks.BestModelCheckpoint is hvd_keras.callbacks.BestModelCheckpoint
    # Horovod's, with process_set last (hpcdl's addition)
    assert _parameters(hvd_keras.callbacks.BroadcastGlobalVariablesCallback) == ["root_rank", "device", "process_set"]
    assert _parameters(hvd_keras.callbacks.MetricAverageCallback) == ["device", "process_set"]
    assert _parameters(hvd_keras.callbacks.BestModelCheckpoint) == [
        "monitor",
        "verbose",
        "save_weights_only",
        "mode",
        "save_freq",
    ]


def test_best_model_checkpoint_needs_a_filepath_and_saves_the_best(tmp_path):
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05)), loss="mse")
    x = np.arange(48, dtype=np.float32).reshape(16, 3) / 48
    checkpoint = hvd_keras.callbacks.BestModelCheckpoint(monitor="loss", mode="min")
    with pytest.raises(ValueError, match="filepath"):
        model.fit(x, x[:, :1], epochs=1, verbose=0, callbacks=[checkpoint])
    checkpoint.filepath = str(tmp_path / "best.keras")
    history = model.fit(x, x[:, :1], batch_size=4, epochs=3, verbose=0, callbacks=[checkpoint])
    assert checkpoint.best == min(history.history["loss"]) and (tmp_path / "best.keras").exists()
    weights = hvd_keras.callbacks.BestModelCheckpoint(save_weights_only=True)
    assert weights.save_weights_only and weights.save_best_only and weights.filepath is None


def test_local_sources_keep_their_own_gradient_in_one_process():
    w, b = tf.Variable([1.0, 2.0]), tf.Variable([3.0])
    for scale in (True, False):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * 2.0) + tf.reduce_sum(b * 5.0)
        tape = hvd_tf.DistributedGradientTape(tape, scale_local_gradients=scale)
        tape.register_local_source(b)
        grad_w, grad_b = tape.gradient(loss, [w, b])
        assert grad_w.numpy().tolist() == [2.0, 2.0] and grad_b.numpy().tolist() == [5.0]  # size 1: / 1
    optimizer = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(1.0), scale_local_gradients=False)
    optimizer.register_local_var(b)
    optimizer.apply([tf.constant([1.0, 1.0]), tf.constant([0.5])], [w, b])
    assert w.numpy().tolist() == [0.0, 1.0] and b.numpy().tolist() == [2.5]


def test_basics_in_one_process():
    assert hvd.is_initialized() and (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)
    assert hvd.mpi_threads_supported() and hvd.mpi_enabled() and hvd.mpi_built()
    assert not (hvd.nccl_built() or hvd.gloo_enabled() or hvd.gloo_built() or hvd.cuda_built())
    ops = ("Average", "Sum", "Adasum", "Min", "Max", "Product")
    assert [getattr(hvd, op) for op in ops] == [getattr(hvd_tf, op) for op in ops] == [0, 1, 2, 3, 4, 5]


def test_before_init_and_after_shutdown_basics_raise():
    hvd.shutdown()
    try:
        assert not hvd.is_initialized()
        with pytest.raises(ValueError, match="hvd.init"):
            hvd.rank()
        with pytest.raises(ValueError, match="hvd.init"):
            hvd.allreduce(torch.ones(2))
    finally:
        hvd.init()
    assert hvd.rank() == 0


def test_hpcdl_errors_are_also_horovod_internal_errors():
    def mismatch():
        raise MismatchError("ranks disagree")

    with pytest.raises(hvd.HorovodInternalError) as caught:
        common.call(mismatch)
    assert isinstance(caught.value, MismatchError) and isinstance(caught.value, HpcdlError)
    assert "ranks disagree" in str(caught.value)
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_adasum_and_unknown_ops_raise_clearly():
    for call in (
        lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum),
        lambda: hvd.allreduce_async_(torch.ones(3), op=hvd.Adasum),
        lambda: hvd.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), op=hvd.Adasum),
        lambda: hvd_tf.allreduce(tf.ones(3), op=hvd_tf.Adasum),
        lambda: hvd_tf.DistributedGradientTape(tf.GradientTape(), op=hvd_tf.Adasum),
    ):
        with pytest.raises(NotImplementedError, match="Adasum"):
            call()
    with pytest.raises(ValueError, match="hvd.Min, hvd.Max or hvd.Product"):
        hvd.allreduce(torch.ones(3), op=7)
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(torch.ones(3), average=True, op=hvd.Sum)


def test_parameters_hpcdl_cannot_honour_raise_naming_them():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    cases = [
        (lambda: hvd.DistributedOptimizer(sgd, num_groups=2), "num_groups"),
        (lambda: hvd.DistributedOptimizer(sgd, groups=[[0]]), "groups"),
        (lambda: hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0), "gradient_predivide_factor"),
        (lambda: hvd.start_timeline("/tmp/unused.json", mark_cycles=True), "mark_cycles"),
        (lambda: hvd_tf.allreduce(tf.ones(2), device_dense="/gpu:0"), "device_dense"),
        (lambda: hvd_tf.broadcast_object(1, session=object()), "session"),
        (
            lambda: hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), backward_passes_per_step=2),
            "backward_passes_per_step",
        ),
        (lambda: hvd_keras.callbacks.MetricAverageCallback(device="/gpu:0"), "device"),
        (lambda: hvd.DistributedOptimizer(sgd, compression=object()), "compression"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd_keras.broadcast_global_variables(0)
    with pytest.raises(TypeError, match="floating-point"):
        hvd.allreduce(torch.ones(2, dtype=torch.int32), prescale_factor=2.0)


def test_one_rank_collectives_forms_and_handles():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    before = x.clone()
    out = hvd.allreduce(x.t(), op=hvd.Sum)  # out of place takes any layout
    assert torch.equal(out, before.t()) and torch.equal(x, before) and out.data_ptr() != x.data_ptr()
    handle = hvd.allreduce_async_(x, prescale_factor=2.0, postscale_factor=0.5)
    assert isinstance(handle, int)
    assert hvd.synchronize(handle) is x and torch.equal(x, before)
    with pytest.raises(ValueError, match="unknown or was already synchronized"):
        hvd.poll(handle)
    with pytest.raises(ValueError, match="contiguous"):
        hvd.allreduce_(torch.ones(3, 2).t())
    assert hvd.broadcast_object({"a": np.arange(3)}, root_rank=0)["a"].tolist() == [0, 1, 2]
    half, ctx = hvd.Compression.fp16.compress(torch.ones(2))
    assert half.dtype == torch.float16 and hvd.Compression.fp16.decompress(half, ctx).dtype == torch.float32
    assert hvd_keras.allreduce(np.array([1.5], np.float32)).tolist() == [1.5]


class RecordLearningRate(tf.keras.callbacks.Callback):
    """Placed after the schedule: the learning rate each batch trains with."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(float(self.model.optimizer.learning_rate.numpy()))


def fit_with(callbacks, optimizer, epochs=3, batches=4):
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=hvd_keras.DistributedOptimizer(optimizer), loss="mse")
    x = np.ones((8 * batches, 3), np.float32)
    return model.fit(x, x[:, :1], batch_size=8, epochs=epochs, verbose=0, callbacks=callbacks)


def test_learning_rate_schedule_callbacks():
    staircase, record = hvd_keras.callbacks.LearningRateScheduleCallback(0.4, lambda e: 0.5**e), RecordLearningRate()
    history = fit_with([staircase, record], tf.keras.optimizers.Adam(0.1))
    assert np.allclose(history.history["lr"], [0.4, 0.2, 0.1])
    assert np.allclose(record.seen, np.repeat([0.4, 0.2, 0.1], 4))
    smooth, record = (
        hvd_keras.callbacks.LearningRateScheduleCallback(1.0, lambda e: e, start_epoch=1, end_epoch=2, staircase=False),
        RecordLearningRate(),
    )
    fit_with([smooth, record], tf.keras.optimizers.Adam(0.1))
    assert np.allclose(record.seen, [0.1] * 4 + [1.0, 1.25, 1.5, 1.75] + [1.75] * 4)
    warmup, record = hvd_keras.callbacks.LearningRateWarmupCallback(0.3, warmup_epochs=2), RecordLearningRate()
    fit_with([warmup, record], tf.keras.optimizers.Adam(0.1))
    assert np.allclose(record.seen, 0.3)  # one rank: initial_lr / size() is initial_lr
    with pytest.raises(ValueError, match="momentum_correction"):
        fit_with([hvd_keras.callbacks.LearningRateWarmupCallback(0.3)], tf.keras.optimizers.SGD(0.1, momentum=0.9))


def test_process_sets_in_one_process():
    assert hvd.global_process_set.ranks == [0] and hvd.global_process_set.process_set_id == 0
    mine = hvd.add_process_set([0])
    _, again = outcome(hvd.add_process_set, mine)
    _, outside = outcome(hvd.add_process_set, [0, 1])
    assert mine.process_set_id == 1 and (mine.size(), mine.rank(), mine.included()) == (1, 0, True)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=mine).tolist() == [1.0, 1.0]
    params = {"w": torch.ones(2)}
    hvd.broadcast_parameters(params, root_rank=0, process_set=mine)
    hvd.broadcast_optimizer_state(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1), 0, process_set=mine)
    with pytest.raises(ValueError, match="root_rank 1 is not in"):
        hvd.broadcast_parameters(params, root_rank=1, process_set=mine)
    assert params["w"].tolist() == [1.0, 1.0]
    assert isinstance(again, ValueError) and "already registered" in str(again)
    assert isinstance(outside, ValueError) and "some of 0..0" in str(outside)
    assert hvd.remove_process_set(mine) and not hvd.remove_process_set(mine)
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(2), process_set=mine)
