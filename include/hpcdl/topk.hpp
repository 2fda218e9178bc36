// Top-k sparsification and its allreduce: a sparse allgather.
//
// Each rank keeps its k = max(1, ceil(ratio * n)) largest magnitudes (NaN
// counts as the largest, so it propagates), sends them as (index, value)
// pairs with one MPI_Allgather, and every rank sums the p contributions in
// rank order into a zeroed buffer, so all ranks compute bitwise identical
// results. Cost per rank: (p - 1) * 8k bytes received, against
// 2 (p - 1) / p * 4n for the dense ring: worth it while ratio < 1 / p.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "hpcdl/dtype.hpp"
#include "hpcdl/mpi_util.hpp"
#include "hpcdl/ring.hpp"
#include "hpcdl/status.hpp"

namespace hpcdl {

inline std::size_t topk_count(std::size_t n, double ratio) {
  if (n == 0) return 0;
  const double k = std::ceil(ratio * static_cast<double>(n));
  return std::min(n, std::max<std::size_t>(1, static_cast<std::size_t>(k)));
}

inline std::size_t topk_encoded_bytes(std::size_t k) { return k * (sizeof(std::uint32_t) + sizeof(float)); }

namespace detail {

// Magnitude used for ranking: the bits of |x|, whose integer order is the
// float order with NaN above +Inf.
inline std::uint32_t topk_magnitude(float v) { return float_to_bits(v) & 0x7fffffffu; }

}  // namespace detail

// Indices of the k largest magnitudes of x[0, n), ascending. O(n): a
// deterministic sample guesses a threshold a little below the k-th largest
// magnitude (as Deep Gradient Compression does), one scan collects the
// candidates at or above it, and an exact selection runs on the candidates
// only; when the guess keeps too few, the selection runs on everything.
// Among equal magnitudes at the cut, lower indices win.
inline void topk_select(const float* x, std::size_t n, std::size_t k, std::uint32_t* idx_out) {
  if (k == 0) return;
  std::vector<std::uint32_t> cand;
  if (k < n / 8 && n >= 4096) {
    const std::size_t stride = 64, samples = n / stride;
    std::vector<std::uint32_t> sample(samples);
    for (std::size_t s = 0; s < samples; ++s) sample[s] = detail::topk_magnitude(x[s * stride]);
    // Aim for about 2k candidates: the (2k/n)-quantile from the top of the sample.
    const std::size_t want = std::min(samples - 1, (2 * k * samples) / n + 1);
    std::nth_element(sample.begin(), sample.begin() + want, sample.end(), std::greater<std::uint32_t>());
    const std::uint32_t threshold = sample[want];
    cand.reserve(3 * k);
    for (std::size_t i = 0; i < n; ++i)
      if (!(detail::topk_magnitude(x[i]) < threshold)) cand.push_back(static_cast<std::uint32_t>(i));
  }
  if (cand.size() < k) {
    cand.resize(n);
    for (std::size_t i = 0; i < n; ++i) cand[i] = static_cast<std::uint32_t>(i);
  }
  auto larger = [x](std::uint32_t a, std::uint32_t b) {
    const std::uint32_t ma = detail::topk_magnitude(x[a]), mb = detail::topk_magnitude(x[b]);
    return ma > mb || (ma == mb && a < b);
  };
  std::nth_element(cand.begin(), cand.begin() + (k - 1), cand.end(), larger);
  std::sort(cand.begin(), cand.begin() + k);
  std::memcpy(idx_out, cand.data(), k * sizeof(std::uint32_t));
}

// Wire: k x uint32 index (ascending), then k x float32 value.
inline void topk_encode(const float* x, std::size_t n, std::size_t k, std::uint8_t* out) {
  std::uint32_t* idx = reinterpret_cast<std::uint32_t*>(out);
  float* val = reinterpret_cast<float*>(out + k * sizeof(std::uint32_t));
  topk_select(x, n, k, idx);
  for (std::size_t j = 0; j < k; ++j) val[j] = x[idx[j]];
}

// dst[index] += value for each pair of one encoded contribution.
inline void topk_decode_add(const std::uint8_t* in, std::size_t k, float* dst) {
  const std::uint32_t* idx = reinterpret_cast<const std::uint32_t*>(in);
  const float* val = reinterpret_cast<const float*>(in + k * sizeof(std::uint32_t));
  for (std::size_t j = 0; j < k; ++j) dst[idx[j]] += val[j];
}

// Allreduce of data[0, n) through top-k on every rank. residual (optional,
// n values): on return, what this rank's contribution dropped, in sum units.
inline Status topk_allreduce(MPI_Comm comm, int size, float* data, std::size_t n, double ratio, double final_scale,
                             float* residual, RingTraffic* traffic) {
  const std::size_t k = topk_count(n, ratio);
  const std::size_t bytes = topk_encoded_bytes(k);
  if (bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    return Status::Invalid("top-k message of " + std::to_string(bytes) + " bytes exceeds one MPI message");
  std::vector<std::uint8_t> mine(bytes), all(bytes * static_cast<std::size_t>(size));
  topk_encode(data, n, k, mine.data());
  if (residual) {
    std::memcpy(residual, data, n * sizeof(float));
    const std::uint32_t* idx = reinterpret_cast<const std::uint32_t*>(mine.data());
    for (std::size_t j = 0; j < k; ++j) residual[idx[j]] = 0;
  }
  MPI_Request request;
  int rc = MPI_Iallgather(mine.data(), static_cast<int>(bytes), MPI_BYTE, all.data(), static_cast<int>(bytes),
                          MPI_BYTE, comm, &request);
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Iallgather(top-k)"));
  HPCDL_RETURN_NOT_OK(mpi_status(wait_politely(&request, MPI_STATUS_IGNORE), "MPI_Wait(top-k allgather)"));
  // The logical volume of an allgather: every other rank's pairs in, ours out to each.
  traffic->bytes_sent += static_cast<std::uint64_t>(size - 1) * bytes;
  traffic->bytes_received += static_cast<std::uint64_t>(size - 1) * bytes;
  std::memset(data, 0, n * sizeof(float));
  for (int r = 0; r < size; ++r) topk_decode_add(all.data() + static_cast<std::size_t>(r) * bytes, k, data);
  if (final_scale != 1.0) {
    const float s = static_cast<float>(final_scale);
    for (std::size_t i = 0; i < n; ++i) data[i] *= s;
  }
  return Status::OK();
}

}  // namespace hpcdl
