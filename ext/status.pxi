# The core's status codes (include/hpcdl/util/status.hpp) by name, for hpcdl.errors.

from libhpcdl.status cimport CStatusCode, kLastStatusCode, status_code_name

STATUS_CODES = {status_code_name(<CStatusCode>code).decode(): code for code in range(1, kLastStatusCode + 1)}
