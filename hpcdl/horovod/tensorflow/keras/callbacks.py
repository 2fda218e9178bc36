"""Horovod's Keras callbacks over hpcdl.tensorflow's."""

import hpcdl.tensorflow
from hpcdl.horovod import common


def _check_device(device):
    common.check_default("device", device, "", "hpcdl reduces in host memory")


class BroadcastGlobalVariablesCallback(hpcdl.tensorflow.BroadcastGlobalVariablesCallback):
    """Every rank starts from rank ``root_rank``'s weights and optimizer state."""

    def __init__(self, root_rank, device=""):
        _check_device(device)
        super().__init__(root=root_rank, comm=common.comm())


class MetricAverageCallback(hpcdl.tensorflow.MetricAverageCallback):
    """The epoch's metrics become their average over the ranks (put it before callbacks reading them)."""

    def __init__(self, device=""):
        _check_device(device)
        super().__init__(comm=common.comm())


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback"]
