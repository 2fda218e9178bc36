"""Exceptions raised by hpcdl. Core failures arrive as a status code and a message."""


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


_BY_CODE = {
    1: ValueError,
    2: MismatchError,
    3: MPIError,
    4: OSError,
    5: CancelledError,
    6: CorruptDataError,
    7: StallTimeoutError,
    8: HpcdlError,
}


def from_status(code, message):
    """The exception for a core Status (see include/hpcdl/status.hpp)."""
    return _BY_CODE.get(code, HpcdlError)(message)
