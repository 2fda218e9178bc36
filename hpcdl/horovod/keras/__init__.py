"""``import hpcdl.horovod.keras as hvd``: Horovod's horovod.keras, the same API as
hpcdl.horovod.tensorflow.keras (Keras 3 runs on TensorFlow here)."""

from hpcdl.horovod.keras import callbacks  # noqa: F401
from hpcdl.horovod.tensorflow.keras import *  # noqa: F401,F403 - the same names
from hpcdl.horovod.tensorflow.keras import __all__  # noqa: F401
