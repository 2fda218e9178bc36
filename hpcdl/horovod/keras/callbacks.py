"""Horovod's horovod.keras.callbacks: the same callbacks as hpcdl.horovod.tensorflow.keras.callbacks."""

from hpcdl.horovod.tensorflow.keras.callbacks import *  # noqa: F401,F403
from hpcdl.horovod.tensorflow.keras.callbacks import __all__  # noqa: F401
