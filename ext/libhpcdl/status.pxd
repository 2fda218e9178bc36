from libcpp.string cimport string

cdef extern from "hpcdl/util/status.hpp" namespace "hpcdl" nogil:
    cdef enum class CStatusCode "hpcdl::StatusCode":
        pass

    cdef cppclass CStatus "hpcdl::Status":
        CStatus()
        bint ok()
        int code_int()
        const string& message()

    const char* status_code_name(CStatusCode code)
    int kLastStatusCode


# The one place a core Status becomes a Python exception (call with the GIL held).
cdef inline int check_status(const CStatus& st) except -1:
    if st.ok():
        return 0
    from hpcdl.errors import from_status
    raise from_status(st.code_int(), st.message().decode("utf-8", "replace"))
