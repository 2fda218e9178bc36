// Top-k sparsification: the selection and the (index, value) pairs. Its
// allreduces are in algorithms/sparse_allreduce.hpp; the first, the sparse
// allgather:
//
// Each rank keeps its k = max(1, ceil(ratio * n)) largest magnitudes (NaN
// counts as the largest, so it propagates), sends them as (index, value)
// pairs with one MPI_Allgather, and every rank sums the p contributions in
// rank order into the cleared buffer, so all ranks compute bitwise identical
// results. Cost per rank: (p - 1) * 8k bytes received, against
// 2 (p - 1) / p * 4n for the dense ring: worth it while ratio < 1 / p.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "hpcdl/util/dtype.hpp"
#include "hpcdl/util/scratch.hpp"
#include "hpcdl/util/segments.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

inline std::size_t topk_count(std::size_t n, double ratio) {
  if (n == 0) return 0;
  const double k = std::ceil(ratio * static_cast<double>(n));
  return std::min(n, std::max<std::size_t>(1, static_cast<std::size_t>(k)));
}

inline std::size_t topk_encoded_bytes(std::size_t k) { return k * (sizeof(std::uint32_t) + sizeof(float)); }

// One encoded contribution. Wire: k x uint32 index (ascending), then k x
// float32 value.
inline std::uint32_t* topk_indices(std::uint8_t* msg) { return reinterpret_cast<std::uint32_t*>(msg); }
inline const std::uint32_t* topk_indices(const std::uint8_t* msg) {
  return reinterpret_cast<const std::uint32_t*>(msg);
}
inline float* topk_values(std::uint8_t* msg, std::size_t k) {
  return reinterpret_cast<float*>(msg + k * sizeof(std::uint32_t));
}
inline const float* topk_values(const std::uint8_t* msg, std::size_t k) {
  return reinterpret_cast<const float*>(msg + k * sizeof(std::uint32_t));
}

namespace detail {

// Magnitude used for ranking: the bits of |x|, whose integer order is the
// float order with NaN above +Inf.
inline std::uint32_t topk_magnitude(float v) { return float_to_bits(v) & 0x7fffffffu; }

// The rank-th largest (0-based) of count magnitudes, reordering v: a histogram
// of their top 11 bits (exponent and 3 mantissa bits) finds its bin, and
// nth_element runs only among that bin's values, moved to the front (about a
// third of the time of nth_element over all of them).
inline std::uint32_t nth_largest_magnitude(std::uint32_t* v, std::size_t count, std::size_t rank) {
  constexpr unsigned kShift = 20, kBins = 1u << 11;  // magnitudes have 31 bits
  std::uint32_t hist[kBins] = {};
  for (std::size_t i = 0; i < count; ++i) ++hist[v[i] >> kShift];
  std::uint32_t bin = kBins - 1;
  for (; bin > 0 && hist[bin] <= rank; --bin) rank -= hist[bin];
  std::size_t m = 0;
  for (std::size_t i = 0; i < count; ++i)
    if ((v[i] >> kShift) == bin) v[m++] = v[i];
  std::nth_element(v, v + rank, v + m, std::greater<std::uint32_t>());
  return v[rank];
}

}  // namespace detail

// Working memory of one selection, reused from call to call by the engine.
struct TopkScratch {
  Scratch above, above_x, at, at_x, mags, all_indices, mine, all, cursors, pairs;
};

// Threshold reuse (Ok-Topk, Li & Hoefler PPoPP'22), kept per named tensor next
// to its residual: the magnitude of the k-th largest |x| at the last exact
// selection, which the next `uses_left` calls send everything at or above
// (in one scan: no sample, no nth_element).
struct TopkThreshold {
  std::uint32_t magnitude = 0;  // topk_magnitude bits; 0: none (a zero threshold would send every zero)
  std::size_t k = 0;            // the k it was selected for: another k selects exactly
  std::uint32_t uses_left = 0;
  // Where the next exact selection's scan starts (TopkSelector::next_cut); 0: none (a sample).
  std::uint32_t scan_cut = 0;
  std::size_t scan_cut_k = 0;  // the k it was found for
};

// A reused threshold's count c is sent while k/2 <= c <= 2k; outside, that
// call selects exactly and takes the new threshold (bounds on traffic and on
// how far below k the threshold may drift).
inline std::size_t topk_reuse_cap(std::size_t k) { return 2 * k; }
inline std::size_t topk_reuse_floor(std::size_t k) { return (k + 1) / 2; }

// Selects the k largest magnitudes of x = data (+ residual): their indices,
// ascending, and values; among equal magnitudes at the cut, lower indices
// win. O(n), one pass over memory (as Deep Gradient Compression does, made
// exact):
//   1. a fixed-size strided sample of x guesses a threshold t a little below
//      the k-th largest magnitude (about 1.5k values at or above it); for a
//      named tensor (a TopkThreshold given), the last call's t instead,
//      kept while it leaves between 3k/2 and 4k above it and otherwise moved
//      toward 2k (next_cut): x changes little from step to step, and the
//      sample's strided reads, a cache miss each, cost about a fifth of the
//      selection; a t that misses (fewer than k at or above it, or over
//      8k + 64 above) costs one more scan, from a sample, over x as the
//      first left it;
//   2. one scan collects, in index order, the indices and values with
//      magnitude > t and the first k with magnitude == t (so ties on t cost
//      nothing);
//   3. if at least k lie above t, the k-th largest magnitude m among them is
//      found with nth_element on a copy of their magnitudes, and one walk
//      over the collected pairs keeps those above m and the lowest-index ones
//      equal to m; otherwise t itself is the k-th largest and the first
//      k - |above| equal to t join.
//   If the sample guessed too high (fewer than k at or above t) or too low
//   (over 8k + 64 above t), an exact selection over all n values runs instead.
// With a residual (error feedback) the scan also leaves x in the residual
// and notes whether any x is NaN or Inf; if so, those residual entries are
// cleared after the selection (a NaN or Inf is sent this step if it is among
// the k, and never added back at later steps). data is only read (the caller
// overwrites it with the sum). With a residual, data may lie in segments
// (util/segments.hpp): the scan reads each in turn, and nothing else reads it.
class TopkSelector {
 public:
  TopkSelector(std::size_t n, std::size_t k, TopkScratch& scratch) : n_(n), k_(k), scratch_(scratch) {}

  // Fills idx_out[0, k) and val_out[0, k) from x, which is only read.
  void select(const float* x, std::uint32_t* idx_out, float* val_out) {
    const FloatSegment whole{const_cast<float*>(x), n_};  // only read
    run<false>(FloatSegments(&whole, 1), nullptr, idx_out, val_out);
  }

  // x = data + residual; on return the residual holds x, with NaN and Inf
  // replaced by 0. data is only read, or with `clear` (data itself) zeroed in
  // the same pass: the caller writes a result into it, and a separate memset
  // would be one more pass over memory.
  void select_with_residual(const float* data, float* residual, std::uint32_t* idx_out, float* val_out,
                            float* clear = nullptr) {
    const FloatSegment whole{clear ? clear : const_cast<float*>(data), n_};  // written only with `clear`
    select_with_residual(FloatSegments(&whole, 1), residual, idx_out, val_out, clear != nullptr);
  }

  // The same over data in segments (n_ values in all); `clear` zeroes them.
  // `cut` (a named tensor's): the scan starts from its scan_cut and leaves the next one there.
  void select_with_residual(const FloatSegments& data, float* residual, std::uint32_t* idx_out, float* val_out,
                            bool clear, TopkThreshold* cut = nullptr) {
    clear_ = clear;
    cut_ = cut;
    run<true>(data, residual, idx_out, val_out);
    clear_ = false;
    cut_ = nullptr;
    clear_non_finite(residual);
  }

  // Threshold reuse: every index whose magnitude of x = data + residual is
  // >= t, ascending, with its value (the first `room` of them written);
  // returns how many there are. The residual is left holding x, NaN and Inf
  // included: then either clear_non_finite, or select_folded for the exact k.
  std::size_t select_at_least(const FloatSegments& data, float* residual, std::uint32_t t, std::size_t room,
                              std::uint32_t* idx_out, float* val_out) {
    std::size_t count = 0, base = 0;
    std::uint32_t non_finite = 0;
    for (const FloatSegment& seg : data) {
      for (std::size_t lo = 0; lo < seg.count; lo += kGroup) {
        const std::size_t len = std::min(kGroup, seg.count - lo);
        std::uint32_t a, e, f;
        if (len == kGroup) {
          group_masks<true>(seg.data + lo, residual + base + lo, t, &a, &e, &f);
        } else {
          group_masks_scalar<true>(seg.data + lo, residual + base + lo, len, t, &a, &e, &f);
        }
        non_finite |= f;
        for (std::uint32_t m = a | e; m; m &= m - 1, ++count) {
          if (count >= room) continue;
          const std::size_t i = base + lo + __builtin_ctz(m);
          idx_out[count] = static_cast<std::uint32_t>(i);
          val_out[count] = residual[i];
        }
      }
      base += seg.count;
    }
    any_non_finite_ = non_finite != 0;
    return count;
  }

  // The exact k of x after select_at_least left x in the residual.
  void select_folded(float* residual, std::uint32_t* idx_out, float* val_out) {
    const bool non_finite = any_non_finite_;
    const FloatSegment x{residual, n_};
    run<false>(FloatSegments(&x, 1), nullptr, idx_out, val_out);
    any_non_finite_ = non_finite;
    clear_non_finite(residual);
  }

  // The residual's NaN and Inf (x's, after a scan that folded it) become 0.
  void clear_non_finite(float* residual) {
    if (!any_non_finite_) return;
    for (std::size_t i = 0; i < n_; ++i)
      if (!std::isfinite(residual[i])) residual[i] = 0.0f;
  }

 private:
  // Without a residual, `in` is one segment (x itself).
  template <bool kResidual>
  void run(const FloatSegments& in, float* residual, std::uint32_t* idx_out, float* val_out) {
    if (k_ == 0) return;
    const float* x = kResidual ? residual : in[0].data;  // where x lies after the scan
    if (k_ == n_) {
      std::size_t base = 0;
      for (const FloatSegment& seg : in) {
        for (std::size_t i = 0; kResidual && i < seg.count; ++i) residual[base + i] += seg.data[i];
        base += seg.count;
      }
      if (clear_) in.zero();
      for (std::size_t i = 0; i < n_; ++i) idx_out[i] = static_cast<std::uint32_t>(i);
      std::memcpy(val_out, x, n_ * sizeof(float));
      return;
    }
    const bool from_last = cut_ != nullptr && cut_->scan_cut > 0 && cut_->scan_cut_k == k_;
    const std::uint32_t t = from_last ? cut_->scan_cut : sample_threshold(in, residual);
    scan<kResidual>(in, residual, t);
    const bool missed = n_above_ > cap_ || n_above_ + n_at_ < k_;
    if (cut_ != nullptr) {
      cut_->scan_cut = 0;  // unless this scan's t is worth keeping (below)
      cut_->scan_cut_k = k_;
    }
    if (from_last && missed) {
      // x moved away from the last cut: select it from a sample, where the scan left it.
      const bool non_finite = any_non_finite_;
      const FloatSegment folded{const_cast<float*>(x), n_};
      run<false>(FloatSegments(&folded, 1), nullptr, idx_out, val_out);
      any_non_finite_ = non_finite;
    } else if (missed) {
      select_exact(x, idx_out, val_out);
    } else if (n_above_ >= k_) {
      const std::uint32_t m = cut_above(idx_out, val_out);
      if (cut_ != nullptr) cut_->scan_cut = next_cut(t, m);
    } else {
      // Both lists ascend and share no index: merge them with their values.
      std::size_t a = 0, e = 0;
      const std::size_t ties = k_ - n_above_;
      for (std::size_t out = 0; out < k_; ++out) {
        const bool take_above = e == ties || (a < n_above_ && above_[a] < at_[e]);
        idx_out[out] = take_above ? above_[a] : at_[e];
        val_out[out] = take_above ? above_x_[a++] : at_x_[e++];
      }
    }
  }

  std::uint32_t sample_threshold(const FloatSegments& data, const float* residual) {
    const std::size_t samples = std::min<std::size_t>(n_, 16384), stride = n_ / samples;
    std::uint32_t* sample = scratch_.mags.get<std::uint32_t>(samples);
    AscendingCursor at(data);
    for (std::size_t s = 0; s < samples; ++s) {
      const std::size_t i = s * stride;
      const float v = at.at(i);
      sample[s] = detail::topk_magnitude(residual ? v + residual[i] : v);
    }
    // Aim for about 1.5k candidates: the (1.5k/n)-quantile from the top of
    // the sample (16384 samples put the k-th largest within a few percent
    // for the ratios top-k is for, so falling short of k is rare).
    const std::size_t want = std::min(samples - 1, (3 * k_ * samples) / (2 * n_));
    return detail::nth_largest_magnitude(sample, samples, want);
  }

  // Groups of 16 values: x (+ the residual fold) and bit masks, lanes with
  // magnitude > t, == t and (with the residual) NaN or Inf, from vector compares (magnitudes have the
  // sign bit clear, so signed 32-bit compares order them). Only set bits are
  // visited, so the scan costs about one pass over memory however many ties
  // the data has.
  static constexpr std::size_t kGroup = 16;

  static constexpr std::uint32_t kLargestFinite = 0x7f7fffffu;  // magnitudes above: Inf, NaN

  // With `clear` (kResidual only), the group's 16 values of `in` are zeroed after their read.
  template <bool kResidual>
  static void group_masks(const float* in, float* residual, std::uint32_t t, std::uint32_t* above, std::uint32_t* at,
                          std::uint32_t* non_finite, float* clear = nullptr) {
#if defined(__SSE2__)
    const __m128i tv = _mm_set1_epi32(static_cast<int>(t)), abs_mask = _mm_set1_epi32(0x7fffffff);
    const __m128i finite_max = _mm_set1_epi32(static_cast<int>(kLargestFinite));
    std::uint32_t a = 0, e = 0, f = 0;
    for (int j = 0; j < 4; ++j) {
      __m128 v;
      if (kResidual) {
        v = _mm_add_ps(_mm_loadu_ps(in + 4 * j), _mm_loadu_ps(residual + 4 * j));
        _mm_storeu_ps(residual + 4 * j, v);
        if (clear) _mm_storeu_ps(clear + 4 * j, _mm_setzero_ps());
      } else {
        v = _mm_loadu_ps(in + 4 * j);
      }
      const __m128i m = _mm_and_si128(_mm_castps_si128(v), abs_mask);
      a |= static_cast<std::uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(m, tv)))) << (4 * j);
      e |= static_cast<std::uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(m, tv)))) << (4 * j);
      if (kResidual) f |= static_cast<std::uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(m, finite_max))));
    }
    *above = a;
    *at = e;
    *non_finite = f;
#else
    group_masks_scalar<kResidual>(in, residual, kGroup, t, above, at, non_finite, clear);
#endif
  }

  template <bool kResidual>
  static void group_masks_scalar(const float* in, float* residual, std::size_t len, std::uint32_t t,
                                 std::uint32_t* above, std::uint32_t* at, std::uint32_t* non_finite,
                                 float* clear = nullptr) {
    std::uint32_t a = 0, e = 0, f = 0;
    for (std::size_t j = 0; j < len; ++j) {
      float v;
      if (kResidual) {
        v = in[j] + residual[j];
        residual[j] = v;
        if (clear) clear[j] = 0.0f;
      } else {
        v = in[j];
      }
      const std::uint32_t m = detail::topk_magnitude(v);
      a |= static_cast<std::uint32_t>(m > t) << j;
      e |= static_cast<std::uint32_t>(m == t) << j;
      f |= static_cast<std::uint32_t>(m > kLargestFinite);
    }
    *above = a;
    *at = e;
    *non_finite = f;
  }

  // With kResidual, x ends up in residual; else x = in. Candidates are kept
  // with their values, so the cut never reads x again.
  template <bool kResidual>
  void scan(const FloatSegments& in, float* residual, std::uint32_t t) {
    cap_ = 8 * k_ + 64;
    above_ = scratch_.above.get<std::uint32_t>(cap_);
    above_x_ = scratch_.above_x.get<float>(cap_);
    at_ = scratch_.at.get<std::uint32_t>(k_);
    at_x_ = scratch_.at_x.get<float>(k_);
    std::size_t na = 0, ne = 0, base = 0;
    std::uint32_t non_finite = 0;
    for (const FloatSegment& seg : in) {
      // x of this segment: its fold in the residual, or the segment itself
      const float* x = kResidual ? residual + base : seg.data;
      for (std::size_t lo = 0; lo < seg.count; lo += kGroup) {
        const std::size_t len = std::min(kGroup, seg.count - lo);
        std::uint32_t a, e, f;
        float* r = kResidual ? residual + base + lo : nullptr;
        float* z = kResidual && clear_ ? seg.data + lo : nullptr;
        if (len == kGroup) {
          group_masks<kResidual>(seg.data + lo, r, t, &a, &e, &f, z);
        } else {
          group_masks_scalar<kResidual>(seg.data + lo, r, len, t, &a, &e, &f, z);
        }
        non_finite |= f;
        for (; a; a &= a - 1, ++na) {
          if (na >= cap_) continue;
          const std::size_t j = lo + __builtin_ctz(a);
          above_[na] = static_cast<std::uint32_t>(base + j);
          above_x_[na] = x[j];
        }
        for (; e && ne < k_; e &= e - 1, ++ne) {
          const std::size_t j = lo + __builtin_ctz(e);
          at_[ne] = static_cast<std::uint32_t>(base + j);
          at_x_[ne] = x[j];
        }
      }
      base += seg.count;
    }
    n_above_ = na;
    n_at_ = ne;
    any_non_finite_ = non_finite != 0;
  }

  // Returns the k-th largest magnitude.
  std::uint32_t cut_above(std::uint32_t* idx_out, float* val_out) {
    std::uint32_t* mags = scratch_.mags.get<std::uint32_t>(n_above_);
    for (std::size_t j = 0; j < n_above_; ++j) mags[j] = detail::topk_magnitude(above_x_[j]);
    const std::uint32_t m = detail::nth_largest_magnitude(mags, n_above_, k_ - 1);
    std::size_t over = 0;
    for (std::size_t j = 0; j < n_above_; ++j) over += detail::topk_magnitude(above_x_[j]) > m;
    std::size_t equal_left = k_ - over, out = 0;
    for (std::size_t j = 0; j < n_above_; ++j) {
      const std::uint32_t mj = detail::topk_magnitude(above_x_[j]);
      if (mj > m || (mj == m && equal_left > 0)) {
        if (mj == m) --equal_left;
        idx_out[out] = above_[j];
        val_out[out++] = above_x_[j];
      }
    }
    return m;
  }

  // After cut_above (m: the k-th largest magnitude), the cut the next call's
  // scan starts from: t while it left between 3k/2 and 4k above it, else the
  // magnitude where about 2k would lie if they spread evenly between t and
  // m as the n_above - k there did (a guess: no second nth_element); 0 (a
  // sample next time) when none lay between them or x is not finite there.
  std::uint32_t next_cut(std::uint32_t t, std::uint32_t m) const {
    if (2 * n_above_ >= 3 * k_ && n_above_ <= 4 * k_) return t;
    if (n_above_ <= k_ || m > kLargestFinite) return 0;
    const float top = bits_to_float(m), low = bits_to_float(t);
    const float aim = top - (top - low) * static_cast<float>(k_) / static_cast<float>(n_above_ - k_);
    return aim > 0.0f ? detail::topk_magnitude(aim) : 0;
  }

  void select_exact(const float* x, std::uint32_t* idx_out, float* val_out) {
    std::uint32_t* all = scratch_.all_indices.get<std::uint32_t>(n_);
    for (std::size_t i = 0; i < n_; ++i) all[i] = static_cast<std::uint32_t>(i);
    auto larger = [x](std::uint32_t a, std::uint32_t b) {
      const std::uint32_t ma = detail::topk_magnitude(x[a]), mb = detail::topk_magnitude(x[b]);
      return ma > mb || (ma == mb && a < b);
    };
    std::nth_element(all, all + (k_ - 1), all + n_, larger);
    std::sort(all, all + k_);
    std::memcpy(idx_out, all, k_ * sizeof(std::uint32_t));
    for (std::size_t j = 0; j < k_; ++j) val_out[j] = x[idx_out[j]];
  }

  std::size_t n_, k_;
  TopkScratch& scratch_;
  std::uint32_t *above_ = nullptr, *at_ = nullptr;
  float *above_x_ = nullptr, *at_x_ = nullptr;
  std::size_t cap_ = 0, n_above_ = 0, n_at_ = 0;
  bool any_non_finite_ = false;
  bool clear_ = false;            // select_with_residual's `clear`, for its scan
  TopkThreshold* cut_ = nullptr;  // select_with_residual's `cut`
};

inline void topk_encode(const float* x, std::size_t n, std::size_t k, std::uint8_t* out, TopkScratch& scratch) {
  TopkSelector(n, k, scratch).select(x, topk_indices(out), topk_values(out, k));
}

// One rank's pairs in a sum: `count` ascending indices and their values.
struct TopkPairs {
  const std::uint32_t* idx;
  const float* val;
  std::size_t count;
};

// data[0, n) = the sum of p ranks' pairs, added in rank order (so every rank
// computes the same bits). Written a block at a time: the block is cleared,
// then each rank's pairs that fall in it are added, a cursor per rank walking
// its ascending indices. Memory is written once, in order, instead of p
// passes of scattered read-modify-writes over the whole buffer.
// In segments, each is written so a block at a time.
inline void topk_sum_into(const TopkPairs* ranks, int p, const FloatSegments& data, TopkScratch& scratch) {
  constexpr std::size_t kBlock = 4096;  // floats: 16 KiB, stays in L1 while the adds land
  std::size_t* cursor = scratch.cursors.get<std::size_t>(static_cast<std::size_t>(p));
  std::fill(cursor, cursor + p, std::size_t(0));
  std::size_t base = 0;
  for (const FloatSegment& seg : data) {
    float* out = seg.data - base;  // indexed by the global index
    const std::size_t end = base + seg.count;
    for (std::size_t lo = base; lo < end; lo += kBlock) {
      const std::size_t hi = std::min(end, lo + kBlock);
      std::memset(out + lo, 0, (hi - lo) * sizeof(float));
      for (int r = 0; r < p; ++r) {
        const TopkPairs& in = ranks[r];
        std::size_t j = cursor[r];
        for (; j < in.count && in.idx[j] < hi; ++j) out[in.idx[j]] += in.val[j];
        cursor[r] = j;
      }
    }
    base = end;
  }
}

inline void topk_sum_into(const TopkPairs* ranks, int p, float* data, std::size_t n, TopkScratch& scratch) {
  const FloatSegment whole{data, n};
  topk_sum_into(ranks, p, FloatSegments(&whole, 1), scratch);
}

// The same for p encoded messages of k pairs each, back to back.
inline void topk_sum_into(const std::uint8_t* all, int p, std::size_t k, float* data, std::size_t n,
                          TopkScratch& scratch) {
  const std::size_t bytes = topk_encoded_bytes(k);
  TopkPairs* ranks = scratch.pairs.get<TopkPairs>(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    const std::uint8_t* in = all + static_cast<std::size_t>(r) * bytes;
    ranks[r] = TopkPairs{topk_indices(in), topk_values(in, k), k};
  }
  topk_sum_into(ranks, p, data, n, scratch);
}

// Threshold reuse for one named tensor: while its threshold has uses left
// (and was selected for this k), every value of x at or above it is sent, if
// their count c lies in [topk_reuse_floor(k), topk_reuse_cap(k)]; otherwise
// (and every reuse_steps + 1 calls) the exact k are, and their smallest
// magnitude is the threshold for the next reuse_steps calls. Writes x =
// data + residual into the residual (NaN and Inf as 0); idx and val need
// room for topk_reuse_cap(k) pairs. Returns the pairs' count.
inline std::size_t topk_select_reusing(const FloatSegments& data, float* residual, std::size_t n, std::size_t k,
                                       std::uint32_t reuse_steps, TopkThreshold* threshold, TopkScratch& scratch,
                                       std::uint32_t* idx, float* val) {
  TopkSelector selector(n, k, scratch);
  if (threshold->uses_left > 0 && threshold->k == k && threshold->magnitude > 0) {
    --threshold->uses_left;
    const std::size_t count =
        selector.select_at_least(data, residual, threshold->magnitude, topk_reuse_cap(k), idx, val);
    if (count >= topk_reuse_floor(k) && count <= topk_reuse_cap(k)) {
      selector.clear_non_finite(residual);
      return count;
    }
    selector.select_folded(residual, idx, val);
  } else {
    selector.select_with_residual(data, residual, idx, val, false, threshold);
  }
  std::uint32_t smallest = ~0u;
  for (std::size_t j = 0; j < k; ++j) smallest = std::min(smallest, detail::topk_magnitude(val[j]));
  threshold->magnitude = k > 0 ? smallest : 0;
  threshold->k = k;
  threshold->uses_left = reuse_steps;
  return k;
}

// This rank's contribution to a top-k allreduce: the pairs of data (+ residual,
// which keeps what is not selected), each value scaled before it is sent
// (average: 1/p), so that the sum of the contributions is the result. With a
// threshold (a named tensor, reuse_steps > 0) as topk_select_reusing says,
// otherwise the exact k (with a threshold, scanned from its scan_cut).
// Returns the pairs' count. `clear` (data itself): data is zeroed on return,
// in the selection's pass where there is a residual and no threshold reuse.
// data in segments needs a residual (the scan folds x into it).
inline std::size_t topk_contribution(const FloatSegments& data, float* residual, std::size_t n, std::size_t k,
                                     double final_scale, TopkScratch& scratch, std::uint32_t* idx, float* val,
                                     std::uint32_t reuse_steps = 0, TopkThreshold* threshold = nullptr,
                                     bool clear = false) {
  std::size_t count = k;
  if (residual && threshold && reuse_steps > 0) {
    count = topk_select_reusing(data, residual, n, k, reuse_steps, threshold, scratch, idx, val);
  } else if (residual) {
    TopkSelector(n, k, scratch).select_with_residual(data, residual, idx, val, clear, threshold);
    clear = false;
  } else {
    TopkSelector(n, k, scratch).select(data[0].data, idx, val);
  }
  if (clear) data.zero();
  if (final_scale != 1.0)
    for (std::size_t j = 0; j < count; ++j) val[j] *= static_cast<float>(final_scale);
  return count;
}

inline std::size_t topk_contribution(const float* data, float* residual, std::size_t n, std::size_t k,
                                     double final_scale, TopkScratch& scratch, std::uint32_t* idx, float* val,
                                     std::uint32_t reuse_steps = 0, TopkThreshold* threshold = nullptr) {
  const FloatSegment whole{const_cast<float*>(data), n};  // only read
  return topk_contribution(FloatSegments(&whole, 1), residual, n, k, final_scale, scratch, idx, val, reuse_steps,
                           threshold);
}

}  // namespace hpcdl
