"""Exceptions raised by hpcdl. Core failures arrive as a status code and a message."""

from hpcdl import _core


class HpcdlError(RuntimeError):
    """Base class of hpcdl's own errors."""


class MismatchError(HpcdlError, ValueError):
    """Ranks disagree about an operation (count, dtype, op, codec...)."""


class MPIError(HpcdlError):
    """An MPI call failed."""


class CancelledError(HpcdlError):
    """The operation never ran (the engine shut down)."""


class CorruptDataError(HpcdlError, IOError):
    """Stored data failed a checksum or structure check."""


class StallTimeoutError(HpcdlError, TimeoutError):
    """An operation waited too long for other ranks."""


_BY_NAME = {
    "invalid_argument": ValueError,
    "mismatch": MismatchError,
    "mpi_error": MPIError,
    "io_error": OSError,
    "cancelled": CancelledError,
    "corrupt": CorruptDataError,
    "timeout": StallTimeoutError,
    "internal": HpcdlError,
}
_BY_CODE = {_core.STATUS_CODES[name]: error for name, error in _BY_NAME.items()}  # the numbers are the core's


def from_status(code, message):
    """The exception for a core Status (see include/hpcdl/util/status.hpp)."""
    return _BY_CODE.get(code, HpcdlError)(message)
