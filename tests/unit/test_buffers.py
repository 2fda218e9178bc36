"""Single-process checks: bad input is refused before any communication, and a
one-rank communicator behaves."""

import os
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

import hpcdl
from hpcdl import _core
from hpcdl.errors import MismatchError


def test_non_contiguous_buffer_is_refused():
    a = np.ones((10, 10), dtype=np.float32)[:, ::2]
    with pytest.raises(ValueError, match="not C-contiguous"):
        hpcdl.allreduce(a)


def test_fortran_order_buffer_is_refused():
    with pytest.raises(ValueError, match="not C-contiguous"):
        hpcdl.allreduce(np.ones((4, 5), dtype=np.float32, order="F"))


def test_read_only_buffer_is_refused():
    a = np.ones(10, dtype=np.float32)
    a.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        hpcdl.allreduce(a)
    with pytest.raises(ValueError, match="read-only"):
        hpcdl.allreduce(b"\x00" * 16, dtype="float32")


@pytest.mark.parametrize("dtype", [np.complex64, np.float128, "datetime64[s]"])
def test_unsupported_dtype_is_refused(dtype):
    with pytest.raises(TypeError, match="unsupported dtype"):
        hpcdl.allreduce(np.zeros(8, dtype=dtype))
    with pytest.raises(TypeError, match="unsupported dtype"):
        hpcdl.broadcast(np.zeros(8, dtype=dtype))


def test_dtype_names_cached_by_the_intake_keep_byte_order_and_metadata_apart():
    native = np.ones(8, np.float32)
    _core.Buffer(native)  # the native float32 dtype's name is now cached
    swapped = native.astype(native.dtype.newbyteorder())
    assert swapped.dtype == native.dtype.newbyteorder() and swapped.dtype != native.dtype
    with pytest.raises(TypeError, match="unsupported dtype >f4"):
        _core.Buffer(swapped)
    tagged = np.ones(8, np.dtype(np.float32, metadata={"unit": "m"}))
    assert tagged.dtype == native.dtype and tagged.dtype is not native.dtype
    assert _core.Buffer(tagged).dtype == "float32" and _core.Buffer(native).dtype == "float32"


def test_buffer_with_an_unhashable_dtype_attribute_is_named_unsupported():
    class Wrapped(bytearray):  # exports the buffer protocol (bytes), carries a dtype that is not one
        dtype = ["float32"]  # unhashable: the intake's name cache must not see it

    with pytest.raises(TypeError, match=r"unsupported dtype \['float32'\]"):
        _core.Buffer(Wrapped(16))


def test_object_without_buffer_protocol_is_refused():
    with pytest.raises(TypeError, match="buffer protocol"):
        hpcdl.allreduce([1.0, 2.0])


def test_explicit_dtype_must_match_item_size():
    with pytest.raises(TypeError, match="2-byte elements"):
        hpcdl.allreduce(np.zeros(8, dtype=np.float32), dtype="bfloat16")


def test_bad_op_a_sum_of_bools_and_compression_with_min():
    for op in ("maximum", None, ["sum"]):
        with pytest.raises(ValueError, match="op must be one of 'sum', 'average', 'min', 'max', 'product'"):
            hpcdl.allreduce(np.zeros(4, dtype=np.float32), op=op)
    for op in ("sum", "average"):
        with pytest.raises(ValueError, match=f"op='{op}' does not reduce bool"):
            hpcdl.allreduce(np.zeros(4, dtype=bool), op=op)
    for op in ("min", "max", "product"):
        with pytest.raises(ValueError, match=f"compression reduces sums: op='{op}' takes none"):
            hpcdl.allreduce(np.zeros(4, dtype=np.float32), op=op, compression=hpcdl.compression.Int8())


@pytest.mark.parametrize("op", ["sum", "average", "min", "max", "product"])
def test_every_op_on_one_rank_leaves_the_data(op):
    for dtype in hpcdl.DTYPES:
        if dtype == "bool" and op in ("sum", "average"):
            continue
        a = np.arange(-3, 5).astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
        expected = a.copy()
        hpcdl.allreduce(a, op=op, comm=MPI.COMM_SELF)
        assert a.tobytes() == expected.tobytes(), (dtype, a, expected)


@pytest.mark.parametrize("name", [123, b"grad", 1.5])
def test_a_name_that_is_not_text_is_named_in_the_error(name):
    for call in (hpcdl.allreduce, hpcdl.allreduce_async, hpcdl.broadcast):
        with pytest.raises(TypeError, match=r"name must be a str or None, got"):
            call(np.zeros(4, dtype=np.float32), name=name)


def test_bad_communicator_and_configuration():
    with pytest.raises(TypeError, match="mpi4py.MPI.Comm"):
        hpcdl.allreduce(np.zeros(4, dtype=np.float32), comm="world")
    with pytest.raises(ValueError, match="COMM_NULL"):
        hpcdl.allreduce(np.zeros(4, dtype=np.float32), comm=MPI.COMM_NULL)
    with pytest.raises(ValueError, match="chunk_bytes"):
        hpcdl.configure(chunk_bytes=8)
    with pytest.raises(ValueError, match=">= 0"):
        hpcdl.configure(stall_warning_seconds=-1)
    with pytest.raises(ValueError, match="stall_error_seconds"):
        hpcdl.configure(stall_error_seconds=float("nan"))


def test_by_default_a_stall_fails_within_half_an_hour_instead_of_waiting_forever():
    """A rank that never submits must not keep the others waiting forever unless the
    user asks for it (0), as torch.distributed's default timeout bounds its waits."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPCDL_STALL_")}
    code = "import hpcdl; print(hpcdl.configure()['stall_error_seconds'])"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert 0 < float(run.stdout) <= 1800, run.stdout


def test_python_reads_the_core_rules():
    """Limits, status codes and dtypes come from the C++ core, not retyped in Python."""
    from hpcdl import _core, collectives, errors

    default = hpcdl.configure()["chunk_bytes"]
    try:
        for bad in (_core.MIN_CHUNK_BYTES - 1, _core.MAX_CHUNK_BYTES + 1):
            with pytest.raises(ValueError, match=f"between {_core.MIN_CHUNK_BYTES} and {_core.MAX_CHUNK_BYTES}"):
                hpcdl.configure(chunk_bytes=bad)
        hpcdl.configure(chunk_bytes=_core.MIN_CHUNK_BYTES)
        x = np.arange(100, dtype=np.float32)
        hpcdl.allreduce(x)  # the engine takes the smallest chunk Python lets through
        assert x[99] == 99
    finally:
        hpcdl.configure(chunk_bytes=default)
    assert sorted(errors._BY_CODE) == sorted(_core.STATUS_CODES.values()) and 0 not in errors._BY_CODE
    assert errors.from_status(_core.STATUS_CODES["mismatch"], "m").__class__ is hpcdl.MismatchError
    assert hpcdl.DTYPES == (
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "int32",
        "int64",
        "bool",
        "uint8",
        "int8",
        "int16",
        "uint16",
        "uint32",
        "uint64",
    )
    assert collectives.OPS == ("sum", "average", "min", "max", "product")
    for name, (_, size, _) in _core.DTYPES.items():
        assert np.dtype(ml_dtypes.bfloat16 if name == "bfloat16" else name).itemsize == size


@pytest.mark.parametrize(
    "variable, value",
    [
        ("HPCDL_CHUNK_BYTES", "4MiB"),
        ("HPCDL_CHUNK_BYTES", "8"),
        ("HPCDL_STALL_ERROR_SECONDS", "-1"),
        ("HPCDL_WAIT_SLEEP_US", "2OO"),
        ("HPCDL_ENGINE_SLICE_US", "-5"),
        ("HPCDL_ENGINE_SLICE_US", "1000000"),
        # digits only: C++ (env.hpp) reads these by the same rule
        ("HPCDL_WAIT_SLEEP_US", "1_000"),
        ("HPCDL_WAIT_SLEEP_US", " 50"),
        ("HPCDL_ENGINE_SLICE_US", "+100"),
        ("HPCDL_CHUNK_BYTES", "65_536"),
        ("HPCDL_AGREEMENT_FLAT", "2"),
        ("HPCDL_AGREEMENT_FLAT", "yes"),
        ("HPCDL_AGREEMENT_RADIX", "1"),
        ("HPCDL_AGREEMENT_RADIX", "65537"),
    ],
)
def test_bad_environment_setting_fails_at_import_naming_it(variable, value):
    env = dict(os.environ, **{variable: value})
    out = subprocess.run([sys.executable, "-c", "import hpcdl"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"environment variable {variable}={value!r}" in out.stderr, out.stderr


def test_good_environment_settings_are_taken():
    env = dict(
        os.environ,
        HPCDL_CHUNK_BYTES="65536",
        HPCDL_STALL_WARNING_SECONDS="2.5",
        HPCDL_WAIT_SLEEP_US="0",
        HPCDL_ENGINE_SLICE_US="0",
        HPCDL_AGREEMENT_FLAT="1",
        HPCDL_AGREEMENT_RADIX="8",
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import hpcdl; c = hpcdl.configure(); print(c['chunk_bytes'], c['stall_warning_seconds'])",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["65536", "2.5"]


def test_waiting_on_a_deferred_operation_before_mark_ready_is_refused():
    """The engine runs a deferred operation only once it is marked ready, and operations
    in the agreed order: a wait that could never end raises instead."""
    a = np.ones(8, dtype=np.float32)
    deferred = hpcdl.allreduce_async(a, comm=MPI.COMM_SELF, name="deferred.self", op="average", deferred=True)
    with pytest.raises(RuntimeError, match="submitted with deferred=True"):
        deferred.wait()
    other = hpcdl.allreduce_async(np.ones(4, dtype=np.float32), comm=MPI.COMM_SELF, name="deferred.other")
    with pytest.raises(RuntimeError, match="'deferred.self' is not marked ready"):
        other.wait()
    assert not deferred.ready()
    a[:] = 3.0
    deferred.mark_ready()
    deferred.mark_ready()  # idempotent
    assert deferred.ready() and deferred.wait() is a and np.all(a == 3.0)
    assert np.all(other.wait() == 1.0)
    plain = hpcdl.allreduce_async(np.ones(2, dtype=np.float32), comm=MPI.COMM_SELF)
    assert plain.ready()
    plain.mark_ready()  # nothing to do
    plain.wait()


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64"])
def test_one_rank_sum_and_average_leave_data_unchanged(dtype):
    a = (np.arange(101) - 50).astype(dtype)
    expected = a.copy()
    hpcdl.allreduce(a, comm=MPI.COMM_SELF)
    assert a.tobytes() == expected.tobytes()
    if not dtype.startswith("int"):
        hpcdl.allreduce(a, op="average", comm=MPI.COMM_SELF)
        assert a.tobytes() == expected.tobytes()


def test_bfloat16_through_ml_dtypes_on_one_rank():
    a = np.linspace(-3, 3, 50).astype(ml_dtypes.bfloat16)
    expected = a.copy()
    hpcdl.allreduce(a, comm=MPI.COMM_SELF, name="bf16.self")
    assert a.tobytes() == expected.tobytes()


def test_broadcast_and_barrier_on_one_rank():
    a = np.arange(5, dtype=np.int64)
    assert hpcdl.broadcast(a, root=0, comm=MPI.COMM_SELF) is a
    hpcdl.barrier(MPI.COMM_SELF)
    with pytest.raises(ValueError, match="root 1"):
        hpcdl.broadcast(a, root=1, comm=MPI.COMM_SELF)


def test_stats_shape():
    hpcdl.stats(reset=True)
    hpcdl.allreduce(np.ones(10, dtype=np.float32), comm=MPI.COMM_SELF)
    s = hpcdl.stats()
    row = s["allreduce"]["none"]
    assert row["ops"] == 1 and row["bytes_sent"] == 0 and row["seconds"] >= 0


def self_transfer(send, array, comm, tag):
    return _core.transfer(send, _core.Buffer(array, None, not send, True), comm, 0, tag)


def test_transfer_stats_count_every_completed_transfer():
    """Transfers to this rank itself: stats()["transfer"] counts each completed send
    and receive with its bytes; a receive that fails (wrong size) adds nothing."""
    comm = MPI.COMM_SELF.Dup()
    hpcdl.stats(reset=True)
    sizes = [0, 1, 4096 + 3, 1 << 20]
    for tag, nbytes in enumerate(sizes):
        got = np.zeros(nbytes, np.uint8)
        r = self_transfer(False, got, comm, tag)
        self_transfer(True, np.full(nbytes, tag, np.uint8), comm, tag).wait(60)
        r.wait(60)
        assert np.all(got == tag)
    r = self_transfer(False, np.zeros(16, np.uint8), comm, 99)
    self_transfer(True, np.ones(12, np.uint8), comm, 99).wait(60)
    with pytest.raises(MismatchError):
        r.wait(60)
    s = hpcdl.stats(reset=True)["transfer"]
    comm.Free()
    assert s["send"]["ops"] == len(sizes) + 1 and s["send"]["bytes_sent"] == sum(sizes) + 12
    assert s["send"]["bytes_received"] == 0 and s["send"]["dense_bytes"] == sum(sizes) + 12
    assert s["receive"]["ops"] == len(sizes) and s["receive"]["bytes_received"] == sum(sizes)
    assert s["receive"]["bytes_sent"] == 0 and s["receive"]["seconds"] >= 0
    assert "transfer" not in hpcdl.stats()  # reset


def test_receive_posted_long_before_its_send_completes():
    """A receive that waits 3 s for its message (the engine polls it less and less
    often meanwhile) still completes, with the bytes sent."""
    comm = MPI.COMM_SELF.Dup()
    data = np.random.default_rng(5).integers(0, 256, 8 << 20, dtype=np.uint8)
    got = np.zeros_like(data)
    r = self_transfer(False, got, comm, 7)
    time.sleep(3.0)
    assert not r.done()
    self_transfer(True, data, comm, 7).wait(120)
    r.wait(120)
    comm.Free()
    assert np.array_equal(got, data)
