// Little-endian byte writer/reader for control messages between ranks.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace hpcdl {

class WireWriter {
 public:
  template <typename T>
  void put(T v) {
    const char* p = reinterpret_cast<const char*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  void put_string(const std::string& s) {
    put<std::uint32_t>(static_cast<std::uint32_t>(s.size()));
    buf_.insert(buf_.end(), s.begin(), s.end());
  }
  std::vector<char>& buffer() { return buf_; }

 private:
  std::vector<char> buf_;
};

class WireReader {
 public:
  WireReader(const char* data, std::size_t size) : p_(data), end_(data + size) {}
  template <typename T>
  bool get(T* v) {
    if (static_cast<std::size_t>(end_ - p_) < sizeof(T)) return false;
    std::memcpy(v, p_, sizeof(T));
    p_ += sizeof(T);
    return true;
  }
  bool get_string(std::string* s) {
    std::uint32_t n;
    if (!get(&n) || static_cast<std::size_t>(end_ - p_) < n) return false;
    s->assign(p_, n);
    p_ += n;
    return true;
  }
  bool at_end() const { return p_ == end_; }

 private:
  const char* p_;
  const char* end_;
};

}  // namespace hpcdl
