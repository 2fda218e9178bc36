# The core's status codes (include/hpcdl/status.hpp) by name, for hpcdl.errors.

from libhpcdl.status cimport CStatusCode

STATUS_CODES = {
    "invalid_argument": <int>CStatusCode.kInvalidArgument,
    "mismatch": <int>CStatusCode.kMismatch,
    "mpi_error": <int>CStatusCode.kMpiError,
    "io_error": <int>CStatusCode.kIOError,
    "cancelled": <int>CStatusCode.kCancelled,
    "corrupt": <int>CStatusCode.kCorrupt,
    "timeout": <int>CStatusCode.kTimeout,
    "internal": <int>CStatusCode.kInternal,
}
