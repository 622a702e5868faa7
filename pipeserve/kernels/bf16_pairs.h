// What the DeepSeek-V3.2 kernels' bfloat16 forms share on CPUs with AVX512-BF16 (vdpbf16ps:
// pairs of bfloat16 multiplied exactly, both products added into a float32 lane): widths in
// chunks of 32 values, the last one masked, and the channel order that interleaving two rows
// of values (vpunpck{l,h}wd, to add both by one vdpbf16ps) leaves in an accumulator.
// PIPESERVE_BF16_PAIRS is defined where the compiler targets AVX512-BF16 with the AVX512 parts
// these forms use besides F (BW's 16-bit masked loads and unpacks, DQ's 256-bit extracts; every
// CPU with AVX512-BF16 has them).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#define PIPESERVE_BF16_PAIRS 1

namespace bf16_pairs {

inline int64_t chunks(int64_t width) { return (width + 31) / 32; }

inline __mmask32 chunk_mask(int64_t width, int64_t j) {  // chunk j's lanes below width
  const int64_t left = width - 32 * j;
  return left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
}

// Where channel ch of a row sits in an accumulator of interleaved pairs of rows: chunk j's 32
// channels 8k + 4s + i (k the 128-bit lane, s its low or high half) at vector 2j + s, lane
// 4k + i (vpunpcklwd takes the low four 16-bit values of each 128-bit lane, vpunpckhwd the
// high four). An accumulator holds 32 floats a chunk.
inline int64_t lane_of(int64_t ch) {
  const int64_t j = ch / 32, k = ch % 32 / 8, s = ch % 8 / 4, i = ch % 4;
  return (2 * j + s) * 16 + 4 * k + i;
}

// Chunk j (lanes `m`) of two rows interleaved for vdpbf16ps: each 32-bit lane a pair (x0's
// value, x1's), the low halves of the 128-bit lanes in lo and the high ones in hi (vectors
// 2j and 2j + 1 of lane_of's order). x1 null: zeros, for a lone last row.
inline void interleave(const c10::BFloat16* x0, const c10::BFloat16* x1, int64_t j, __mmask32 m,
                       __m512i& lo, __m512i& hi) {
  const __m512i a = _mm512_maskz_loadu_epi16(m, x0 + 32 * j);
  const __m512i b = x1 ? _mm512_maskz_loadu_epi16(m, x1 + 32 * j) : _mm512_setzero_si512();
  lo = _mm512_unpacklo_epi16(a, b);
  hi = _mm512_unpackhi_epi16(a, b);
}

}  // namespace bf16_pairs
#endif
