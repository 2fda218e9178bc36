// Status: the one way the C++ core reports failure. Cython turns a non-OK
// Status into a Python exception (ext/libhpcdl/status.pxd); no C++ exception
// ever crosses into Python.
#pragma once

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace hpcdl {

// A duration in a message: "0.3 s" (one decimal, so sub-second waits do not read "0 s").
inline std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f s", seconds);
  return text;
}

// Ranks in a message: "rank 3", "ranks 0, 2".
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // bad input caught before any communication
  kMismatch = 2,         // ranks disagree about an operation
  kMpiError = 3,
  kIOError = 4,
  kCancelled = 5,  // engine shut down before the operation ran
  kCorrupt = 6,    // checksum or structure check failed
  kTimeout = 7,
  kInternal = 8,
};

// The code's name as hpcdl.errors spells it ("invalid_argument"); _core.STATUS_CODES is made from these.
inline const char* status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "ok";
    case StatusCode::kInvalidArgument: return "invalid_argument";
    case StatusCode::kMismatch: return "mismatch";
    case StatusCode::kMpiError: return "mpi_error";
    case StatusCode::kIOError: return "io_error";
    case StatusCode::kCancelled: return "cancelled";
    case StatusCode::kCorrupt: return "corrupt";
    case StatusCode::kTimeout: return "timeout";
    case StatusCode::kInternal: return "internal";
  }
  return "";
}
constexpr int kLastStatusCode = static_cast<int>(StatusCode::kInternal);

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  static Status Invalid(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
  static Status Mismatch(std::string m) { return {StatusCode::kMismatch, std::move(m)}; }
  static Status Mpi(std::string m) { return {StatusCode::kMpiError, std::move(m)}; }
  static Status IO(std::string m) { return {StatusCode::kIOError, std::move(m)}; }
  static Status Cancelled(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
  static Status Corrupt(std::string m) { return {StatusCode::kCorrupt, std::move(m)}; }
  static Status Timeout(std::string m) { return {StatusCode::kTimeout, std::move(m)}; }
  static Status Internal(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  int code_int() const { return static_cast<int>(code_); }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

// Propagate a non-OK status to the caller.
#define HPCDL_RETURN_NOT_OK(expr) \
  do {                            \
    ::hpcdl::Status _st = (expr); \
    if (!_st.ok()) return _st;    \
  } while (0)

}  // namespace hpcdl
