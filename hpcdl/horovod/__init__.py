"""Horovod's API on hpcdl's engine, for scripts written for Horovod.

    import hpcdl.horovod.torch as hvd             # was: import horovod.torch as hvd
    import hpcdl.horovod.tensorflow as hvd        # was: import horovod.tensorflow as hvd
    import hpcdl.horovod.tensorflow.keras as hvd  # was: import horovod.tensorflow.keras as hvd (or hpcdl.horovod.keras)

Pure Python over hpcdl's own API; migration guide and differences: docs/horovod.md.
"""
