// A linear layer's product for a few rows (decode steps): y [m, N] = x [m, K] . w [N, K]^T
// (+ bias [N]), what a step of a handful of requests spends most of its time in. Each weight
// byte is read once per call, and the activations stay in L1. Up to kStreamRows rows of x a
// thread streams one weight row after another (`stream_tile`), what the memory serves
// fastest; above, a register tile of kRows output rows x kPair rows of x keeps its sums in
// registers over all of K, each weight vector loaded once serving both rows of x and each x
// vector four weight rows (so m rows of x cost m / 2 passes over the weights' L1-resident
// tile rows, not m passes from memory). Threads take blocks of output rows, so two threads
// draw on the memory twice. The weight is read in the layout torch keeps ([N, K] row-major):
// nothing is packed.
//
// Arithmetic is float32: x is widened once per call, a bfloat16 weight as it is loaded (a
// bfloat16 is a float32's top half), a float16 weight likewise (F16C's vcvtph2ps where the
// CPU has AVX2), so bfloat16 or float16 weights with float32 activations read half the bytes
// of float32 weights for the same products where the checkpoint is bfloat16 or float16; on
// CPUs with AVX512-BF16, bfloat16 x meets bfloat16 weights in vdpbf16ps (`run_pairs`). The
// output and bias take x's dtype. Each output is one sum in a fixed order (the streamed
// form: four sums of eight lanes over K; the tiles: eight lane sums; vdpbf16ps: four sums of
// sixteen; then the lanes added), so a row's result does not depend on the thread count, nor
// on the other rows of x among calls of up to kStreamRows rows, or among calls of more.
//
// `skinny_linear_blocks` takes a weight kept in GGUF's blocks of 32 values along K: Q4_1 (20
// bytes: fp16 d, fp16 m, 16 bytes holding q_j in the low nibble of byte j and q_(j+16) in its
// high one; v = d * q + m) or Q8_0 (34 bytes: fp16 d, 32 int8 q; v = d * q), its rows grouped
// by eight for the kernel (see "The layout a weight in blocks is kept in" below), and
// multiplies them by integer dot products with x rounded in two 8-bit parts (see "Products on
// weights kept in blocks"): a quarter (Q4_1) or a bit more than a quarter (Q8_0) of the
// float32 weight's bytes. `dequantize_blocks` gives the exact values back, as GGUF's
// reference dequantisation computes them (a float32 product, then the sum).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "bf16_pairs.h"
#include "kernels.h"
#include "vec8.h"

namespace {

using vec8::kLanes;
using vec8::load8;
using vec8::v8;
using vec8::widen;

constexpr int64_t kRows = 4;        // output rows per register tile
constexpr int64_t kPair = 2;        // rows of x per register tile (kRows x kPair sums in registers)
constexpr int64_t kGrainRows = 64;  // output rows per parallel task, at least
constexpr int64_t kMaxRows = 16;    // rows of x one call takes (decode-sized)
constexpr int64_t kStreamRows = 4;  // rows of x up to which a weight row is streamed alone

// A task's weight rows [r0, r1) read as kStreams runs of rows side by side: row i of each run
// in turn, so the L2 prefetcher follows four sequential streams where one stream left the
// memory idle between its requests. The rows' results are the same in any order. Zen 4, one
// thread, a step's products of SmolLM2's weights out of cache, one row of x (`benchmarks/
// skinny_linear.py --step-rows`): bfloat16 on vdpbf16ps 26.8-28.3 GB/s against 20.4-22.2 in
// one stream, with `sum` over the same bytes at 27-29; three streams 26.5-28.2, six 24-25,
// eight 19-20.
constexpr int64_t kStreams = 4;
template <typename Row>
inline void in_streams(int64_t r0, int64_t r1, Row&& row) {
  const int64_t len = (r1 - r0 + kStreams - 1) / kStreams;
  for (int64_t i = 0; i < len; ++i) {
    for (int64_t s = 0; s < kStreams; ++s) {
      const int64_t r = r0 + s * len + i;
      if (r < r1) row(r);
    }
  }
}


// A row of GGUF blocks (see the header): the element type names the format.
struct Q41 {
  uint8_t byte;
};
struct Q80 {
  uint8_t byte;
};
template <typename W>
constexpr int64_t kBlockBytes = 0;  // plain element types: no blocks
template <>
constexpr int64_t kBlockBytes<Q41> = 20;
template <>
constexpr int64_t kBlockBytes<Q80> = 34;
constexpr int64_t kBlock = 32;  // values per block

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

// A weight vector, widened; acc + a * b. With AVX2 and FMA, as the instructions (GCC's own
// lowering of the vector extension here splits the bfloat16 widening in two halves and
// leaves the multiply and add apart, half the speed); elsewhere the portable forms.
inline v8 wload(const float* p) { return load8(p); }
#if defined(__AVX2__) && defined(__FMA__)
inline v8 wload(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (v8)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline v8 fma8(v8 a, v8 b, v8 acc) { return (v8)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc); }
#else
inline v8 wload(const c10::BFloat16* p) { return load8(p); }
inline v8 fma8(v8 a, v8 b, v8 acc) { return a * b + acc; }
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline v8 wload(const c10::Half* p) {
  return (v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#else
inline v8 wload(const c10::Half* p) { return load8(p); }
#endif

// Eight values of a block row from value c on (c a multiple of 8), lane by lane: the form
// for CPUs without AVX2, FMA and F16C (elsewhere `block_values` below rebuilds a whole block
// at once). `volatile` keeps the product rounded before the add, as the dequantised weight.
inline v8 wload(const Q41* row, int64_t c) {
  const uint8_t* b = &row->byte + (c / kBlock) * kBlockBytes<Q41>;
  const int64_t j = c % kBlock;
  const float d = half_at(b), m = half_at(b + 2);
  v8 r;
  for (int64_t l = 0; l < kLanes; ++l) {
    const uint8_t byte = b[4 + (j + l) % 16];
    volatile float prod = d * static_cast<float>(j + l < 16 ? byte & 15 : byte >> 4);
    r[l] = prod + m;
  }
  return r;
}
inline v8 wload(const Q80* row, int64_t c) {
  const uint8_t* b = &row->byte + (c / kBlock) * kBlockBytes<Q80>;
  const float d = half_at(b);
  v8 r;
  for (int64_t l = 0; l < kLanes; ++l)
    r[l] = d * static_cast<float>(static_cast<int8_t>(b[2 + c % kBlock + l]));
  return r;
}

template <typename W>
struct Problem {
  const float* x;  // [m, k], float32 (widened once where the caller's is bfloat16)
  const W* w;      // [n, ld]: float32 or bfloat16 values, k per row
  const float* bias;  // [n] float32, or nullptr
  float* y;        // [m, n]
  int64_t m, n, k;
  int64_t ld;      // a row's length in W (k)
};

// y[i0 .. i0 + MT) x [r0 .. r0 + R): each weight vector loaded once serves the MT rows of x,
// each x vector the R weight rows; R x MT sums stay in registers over all of K.
template <int64_t R, int64_t MT, typename W>
inline void tile(const Problem<W>& p, int64_t r0, int64_t i0) {
  const int64_t k = p.k, kv = k - k % kLanes;
  const W* wr[R];
  const float* xi[MT];
  for (int64_t r = 0; r < R; ++r) wr[r] = p.w + (r0 + r) * p.ld;
  for (int64_t i = 0; i < MT; ++i) xi[i] = p.x + (i0 + i) * k;
  v8 acc[MT][R] = {};
  constexpr int64_t every = 64 / sizeof(W);  // values per cache line
  for (int64_t c = 0; c < kv; c += kLanes) {
    // the next tile's rows (the weight is one contiguous stream): more lines in flight than
    // the hardware prefetchers keep for these four interleaved streams
    if (c % every == 0) {
      for (int64_t r = 0; r < R; ++r) {
        __builtin_prefetch(wr[r] + R * p.ld + c);
      }
    }
    v8 xv[MT];
    for (int64_t i = 0; i < MT; ++i) xv[i] = load8(xi[i] + c);
    for (int64_t r = 0; r < R; ++r) {
      const v8 wv = wload(wr[r] + c);
      for (int64_t i = 0; i < MT; ++i) acc[i][r] = fma8(wv, xv[i], acc[i][r]);
    }
  }
  for (int64_t i = 0; i < MT; ++i) {
    for (int64_t r = 0; r < R; ++r) {
      float s = vec8::lanes_sum(acc[i][r]);
      for (int64_t c = kv; c < k; ++c) s += widen(wr[r][c]) * xi[i][c];
      if (p.bias != nullptr) s += p.bias[r0 + r];
      p.y[(i0 + i) * p.n + r0 + r] = s;
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PIPESERVE_BLOCK_TILES 1
// A whole block's four weight vectors at once (the compiled dequantisation): its scale (and
// minimum) converted and broadcast once, its integers loaded once, where the per-vector
// `wload` above does both per 8 values. The same values, each rounded the same way.
inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return _cvtsh_ss(bits);
}
inline void block_values(const Q41*, const uint8_t* b, v8* w) {
  const __m256 d = _mm256_set1_ps(half(b)), m = _mm256_set1_ps(half(b + 2));
  const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
  const __m128i low = _mm_and_si128(qs, _mm_set1_epi8(15));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(15));
  const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
  for (int j = 0; j < 4; ++j) {
    __m256 prod = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])));
    asm("" : "+x"(prod));  // rounded before the add, as the dequantised weight was
    w[j] = (v8)_mm256_add_ps(prod, m);
  }
}
inline void block_values(const Q80*, const uint8_t* b, v8* w) {
  const __m256 d = _mm256_set1_ps(half(b));
  for (int j = 0; j < 4; ++j) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
    w[j] = (v8)_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
  }
}
#endif

// ---- The layout a weight in blocks is kept in (layers/block_quant.py `group`) ----
//
// Rows in groups of kGroup: a group's blocks b (one per row) lie together as a tile, the
// rows' fp16 d's first (then Q4_1's fp16 m's), then their integers four values at a time,
// row after row: Q4_1's 16 bytes of nibbles as four 4-byte quads, quad u of every row (byte e
// of row j's quad u at 4 j + e holds values 4 u + e and 16 + 4 u + e), Q8_0's 32 bytes as
// eight. A 32-byte load of a tile is then four values of each of eight rows, what an 8-lane
// integer dot product needs to give each lane one row's sum, so the product streams the
// weight once, in order. Rows past the last whole group (N mod kGroup) keep GGUF's own block
// layout after the groups. The tile has as many bytes as its eight GGUF blocks.
constexpr int64_t kGroup = 8;
template <typename W>
constexpr int64_t kHeadBytes = std::is_same_v<W, Q41> ? 4 : 2;  // per row: d (and m)

// Row r's block b in GGUF's layout: in place for a row past the groups, else copied out of
// its group's tile into `buf`.
template <typename W>
inline const uint8_t* gguf_block(const uint8_t* w, int64_t ld, int64_t n, int64_t r, int64_t b,
                                 uint8_t* buf) {
  const int64_t grouped = n - n % kGroup;
  if (r >= grouped) return w + r * ld + b * kBlockBytes<W>;
  const uint8_t* tile = w + (r - r % kGroup) * ld + b * kGroup * kBlockBytes<W>;
  const int64_t j = r % kGroup, head = kHeadBytes<W>;
  for (int64_t h = 0; h < head; h += 2) std::memcpy(buf + h, tile + h * kGroup + 2 * j, 2);
  for (int64_t u = 0; u < (kBlockBytes<W> - head) / 4; ++u) {
    std::memcpy(buf + head + 4 * u, tile + head * kGroup + 32 * u + 4 * j, 4);
  }
  return buf;
}

// Outputs [r0, r0 + R) of every row of x.
template <int64_t R, typename W>
inline void rows(const Problem<W>& p, int64_t r0) {
  int64_t i = 0;
  for (; i + kPair <= p.m; i += kPair) tile<R, kPair>(p, r0, i);
  if (i < p.m) tile<R, 1>(p, r0, i);
}

// Output r of rows [i0, i0 + MT) of x, the weight row streamed once: four sums a row (vector
// c / 8 of K into sum c / 8 mod 4), added in a fixed order. Up to kStreamRows rows of x a
// task reads one weight row after another, one sequential stream per thread, which the
// prefetchers follow at the memory's speed where the tiles' four interleaved rows do not
// (Zen 4, a step's products of SmolLM2's weights out of cache, one row of x, one thread:
// bfloat16 weights 22 GB/s, float32 19, where the tiles drew ~10 and ~13; `benchmarks/
// skinny_linear.py --step-rows`). From 8 rows on the tiles' reuse of each x vector over four
// weight rows wins (two threads, bfloat16 weights: 23 ms a step's products on the tiles
// against 27 streamed, when this was chosen); at 4 rows streaming was ahead (13.6 against
// 15.4 ms).
template <int64_t MT, typename W>
inline void stream_tile(const Problem<W>& p, int64_t r, int64_t i0) {
  constexpr int64_t kChains = 4, kStep = kChains * kLanes;
  const int64_t k = p.k, kv = k - k % kLanes;
  const W* wr = p.w + r * p.ld;
  const float* xi[MT];
  for (int64_t i = 0; i < MT; ++i) xi[i] = p.x + (i0 + i) * k;
  v8 acc[MT][kChains] = {};
  int64_t c = 0;
  for (; c + kStep <= kv; c += kStep) {
    for (int64_t u = 0; u < kChains; ++u) {
      const v8 wv = wload(wr + c + u * kLanes);
      for (int64_t i = 0; i < MT; ++i) acc[i][u] = fma8(wv, load8(xi[i] + c + u * kLanes), acc[i][u]);
    }
  }
  for (int64_t u = 0; c < kv; c += kLanes, ++u) {
    const v8 wv = wload(wr + c);
    for (int64_t i = 0; i < MT; ++i) acc[i][u] = fma8(wv, load8(xi[i] + c), acc[i][u]);
  }
  for (int64_t i = 0; i < MT; ++i) {
    float s = vec8::lanes_sum((acc[i][0] + acc[i][1]) + (acc[i][2] + acc[i][3]));
    for (int64_t t = kv; t < k; ++t) s += widen(wr[t]) * xi[i][t];
    if (p.bias != nullptr) s += p.bias[r];
    p.y[(i0 + i) * p.n + r] = s;
  }
}

template <typename W>
void run(const Problem<W>& p) {
  if (p.m <= kStreamRows) {
    at::parallel_for(0, p.n, kGrainRows, [&](int64_t r0, int64_t r1) {
      in_streams(r0, r1, [&](int64_t r) {
        int64_t i = 0;
        for (; i + 2 <= p.m; i += 2) stream_tile<2>(p, r, i);
        if (i < p.m) stream_tile<1>(p, r, i);
      });
    });
    return;
  }
  const int64_t blocks = (p.n + kRows - 1) / kRows;
  at::parallel_for(0, blocks, kGrainRows / kRows, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kRows;
      if (r0 + kRows <= p.n) {
        rows<kRows>(p, r0);
      } else {
        for (int64_t r = r0; r < p.n; ++r) rows<1>(p, r);
      }
    }
  });
}

// The bias [n] in float32 (undefined without one); it must have x's dtype.
at::Tensor widened_bias(const std::optional<at::Tensor>& bias, at::ScalarType x_dtype, int64_t n) {
  if (!bias.has_value()) return {};
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias [N] expected");
  TORCH_CHECK(bias->scalar_type() == x_dtype, "the bias must have x's dtype");
  return bias->to(at::kFloat).contiguous();
}

inline const float* bias_ptr(const at::Tensor& b) {
  return b.defined() ? b.data_ptr<float>() : nullptr;
}

// What both entry points hand the kernel: x widened once ([m, K], small), the bias widened,
// the float32 output [m, N].
struct Operands {
  at::Tensor xf, bf, y;
  Operands(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t n)
      : xf(x.to(at::kFloat).contiguous()),
        bf(widened_bias(bias, x.scalar_type(), n)),
        y(at::empty({x.size(0), n}, x.options().dtype(at::kFloat))) {}
  const float* bias() const { return bias_ptr(bf); }
};

#ifdef PIPESERVE_BF16_PAIRS
// bfloat16 x and weight on CPUs with AVX512-BF16: vdpbf16ps multiplies 32 values of a row of x
// by 32 of a weight row, exactly, adding each lane's pair of products into a float32 sum, so
// one instruction does the work of four widenings and four 8-lane FMAs. The weight's rows pair
// their own neighbouring values, as x's do: torch's [N, K] layout as it is. A task reads one
// weight row after another for all rows of x (L1-resident), two rows of x at a time: one
// sequential stream per thread, as the streamed FMA form (Zen 4, a step's products of
// SmolLM2's weights out of cache, one row, `benchmarks/skinny_linear.py --step-rows`: 21.7 GB/s
// on one thread and 29.9 on two; tiles of four interleaved weight rows drew ~11 and ~19). The
// streamed FMA form on x widened read 25 and 33.5 there, but in the engine, where widening x
// is one more op per product, the two measured within this machine's noise (SmolLM2 in
// bfloat16, one thread: 48.6-51.1 tok/s against 49.2-55.2), and one form for every row count
// keeps a row's result independent of the others. Each output is one sum in a fixed order
// (chunk j of 32 values into sum j mod 4 of sixteen lanes, then added), so a row's result
// does not depend on the other rows of x or on the thread count.
struct PairsProblem {
  const c10::BFloat16* x;  // [m, k]
  const c10::BFloat16* w;  // [n, k]
  const float* bias;       // [n] float32, or nullptr
  c10::BFloat16* y;        // [m, n]: each float32 sum rounded once, as torch's cast
  int64_t m, n, k;
};

inline __m512bh pairs_load(const c10::BFloat16* row, int64_t j) {  // a whole chunk
  return (__m512bh)_mm512_loadu_si512(row + 32 * j);
}
inline __m512bh pairs_load(const c10::BFloat16* row, int64_t k, int64_t j) {  // the last one
  return (__m512bh)_mm512_maskz_loadu_epi16(bf16_pairs::chunk_mask(k, j), row + 32 * j);
}

// Output r of rows [i0, i0 + MT) of x: each weight chunk loaded once serves the MT rows.
// Chunk j goes into sum j mod kPairChains (independent dependency chains).
constexpr int64_t kPairChains = 4;
template <int64_t MT>
inline void pairs_tile(const PairsProblem& p, int64_t r, int64_t i0) {
  const int64_t k = p.k, whole = k / 32;
  const c10::BFloat16* wr = p.w + r * k;
  const c10::BFloat16* xi[MT];
  for (int64_t i = 0; i < MT; ++i) xi[i] = p.x + (i0 + i) * k;
  __m512 acc[MT][kPairChains];
  for (int64_t i = 0; i < MT; ++i) {
    for (int64_t u = 0; u < kPairChains; ++u) acc[i][u] = _mm512_setzero_ps();
  }
  int64_t j = 0;
  for (; j + kPairChains <= whole; j += kPairChains) {
    for (int64_t u = 0; u < kPairChains; ++u) {
      const __m512bh w = pairs_load(wr, j + u);
      for (int64_t i = 0; i < MT; ++i) {
        acc[i][u] = _mm512_dpbf16_ps(acc[i][u], w, pairs_load(xi[i], j + u));
      }
    }
  }
  for (; j < whole; ++j) {
    const __m512bh w = pairs_load(wr, j);
    for (int64_t i = 0; i < MT; ++i) {
      acc[i][j % kPairChains] = _mm512_dpbf16_ps(acc[i][j % kPairChains], w, pairs_load(xi[i], j));
    }
  }
  if (k % 32 != 0) {  // chunk j = whole, masked, into its chain like a whole one
    const __m512bh w = pairs_load(wr, k, j);
    for (int64_t i = 0; i < MT; ++i) {
      __m512& a = acc[i][j % kPairChains];
      a = _mm512_dpbf16_ps(a, w, pairs_load(xi[i], k, j));
    }
  }
  for (int64_t i = 0; i < MT; ++i) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]),
                                     _mm512_add_ps(acc[i][2], acc[i][3]));
    float s = _mm512_reduce_add_ps(sum);
    if (p.bias != nullptr) s += p.bias[r];
    p.y[(i0 + i) * p.n + r] = c10::BFloat16(s);
  }
}

void run_pairs(const PairsProblem& p) {
  at::parallel_for(0, p.n, kGrainRows, [&](int64_t r0, int64_t r1) {
    in_streams(r0, r1, [&](int64_t r) {
      int64_t i = 0;
      for (; i + 2 <= p.m; i += 2) pairs_tile<2>(p, r, i);
      if (i < p.m) pairs_tile<1>(p, r, i);
    });
  });
}
#endif

}  // namespace

int64_t skinny_linear_max_rows() { return kMaxRows; }

at::Tensor skinny_linear(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x [m, K] and w [N, K] expected");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x.size(0) <= kMaxRows, "skinny_linear takes at most ", kMaxRows, " rows");
  for (const at::Tensor* t : {&x, &w}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16 ||
                    (t == &w && t->scalar_type() == at::kHalf),
                "skinny_linear takes float32 or bfloat16 (and a float16 weight)");
  }
  TORCH_CHECK(w.is_contiguous(), "the weight must be contiguous");
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
#ifdef PIPESERVE_BF16_PAIRS
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    const at::Tensor xc = x.contiguous(), b = widened_bias(bias, x.scalar_type(), n);
    at::Tensor y = at::empty({m, n}, x.options());
    using B = c10::BFloat16;
    run_pairs(PairsProblem{xc.data_ptr<B>(), w.data_ptr<B>(), bias_ptr(b), y.data_ptr<B>(), m, n, k});
    return y;
  }
#endif
  const Operands o(x, bias, n);
  const float *xf = o.xf.data_ptr<float>(), *b = o.bias();
  at::Tensor y = o.y;
  if (w.scalar_type() == at::kFloat) {
    run(Problem<float>{xf, w.data_ptr<float>(), b, y.data_ptr<float>(), m, n, k, k});
  } else if (w.scalar_type() == at::kHalf) {
    using H = c10::Half;
    run(Problem<H>{xf, w.data_ptr<H>(), b, y.data_ptr<float>(), m, n, k, k});
  } else {
    using B = c10::BFloat16;
    run(Problem<B>{xf, w.data_ptr<B>(), b, y.data_ptr<float>(), m, n, k, k});
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

namespace {

template <typename W>
void dequantize_rows(const uint8_t* w, int64_t ld, int64_t n, int64_t k, float* out) {
  at::parallel_for(0, n, kGrainRows, [&](int64_t r0, int64_t r1) {
    uint8_t buf[kBlockBytes<W>];
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < k; c += kBlock) {
        const uint8_t* blk = gguf_block<W>(w, ld, n, r, c / kBlock, buf);
#ifdef PIPESERVE_BLOCK_TILES
        v8 values[4];
        block_values(static_cast<const W*>(nullptr), blk, values);
        for (int64_t j = 0; j < 4; ++j) vec8::store8(out + r * k + c + kLanes * j, values[j]);
#else
        for (int64_t j = 0; j < kBlock; j += kLanes) {
          vec8::store8(out + r * k + c + j, wload(reinterpret_cast<const W*>(blk), j));
        }
#endif
      }
    }
  });
}

int64_t block_bytes_of(int64_t format) {
  TORCH_CHECK(format == 1 || format == 2, "format: 1 (Q4_1) or 2 (Q8_0)");
  return format == 1 ? kBlockBytes<Q41> : kBlockBytes<Q80>;
}

}  // namespace

namespace {

// Whether fp16 scale d16 and offset m16 (0 for Q8_0) with integers in [bottom, top] give every
// value of the block back bitwise with GGUF's arithmetic (a float32 product, then the sum:
// `volatile` keeps the two roundings apart); the integers in q if so.
bool rebuilds(const float* v, uint16_t d16, uint16_t m16, float bottom, float top, int* q) {
  using c10::detail::fp16_ieee_to_fp32_value;
  const float d = fp16_ieee_to_fp32_value(d16), m = fp16_ieee_to_fp32_value(m16);
  if (d - d != 0.f || m - m != 0.f) return false;  // NaN or infinite
  for (int64_t i = 0; i < kBlock; ++i) {
    const float level = d == 0.f ? 0.f : std::nearbyint((v[i] - m) / d);
    q[i] = static_cast<int>(std::min(top, std::max(bottom, level)));
    volatile float product = d * static_cast<float>(q[i]);
    volatile float rebuilt = product + m;
    if (rebuilt != v[i]) return false;
  }
  return true;
}

// One block's values v[0..32) as `format`'s block at `out`, if some fp16 scale and integers
// give every value back bitwise (`rebuilds`). Q8_0: the scale amax / 127 rounded, or one step
// either side. Q4_1: the minimum as m and (max - min) / 15 likewise; then GGUF's Q4_0 values
// d (q - 8), which are Q4_1's with d as it is (negative where the block's largest magnitude
// is positive) and m = -8 d (exact in fp16): d from the largest magnitude. (Q4_0's d (8 - 8)
// is -0 where d < 0, rebuilt as +0: equal values, another zero's sign.)
bool encode_block(const float* v, int64_t format, uint8_t* out) {
  using c10::detail::fp16_ieee_from_fp32_value;
  using c10::detail::fp16_ieee_to_fp32_value;
  float lo = v[0], hi = v[0], amax = 0.f, extreme = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) {
    if (!(v[i] == v[i]) || v[i] - v[i] != 0.f) return false;  // NaN or infinite
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
    if (std::abs(v[i]) > amax) amax = std::abs(v[i]), extreme = v[i];
  }
  const bool q41 = format == 1;
  const float top = q41 ? 15.f : 127.f, bottom = q41 ? 0.f : -127.f;
  struct Candidate {
    uint16_t d16, m16;
  };
  Candidate candidates[3 + 15];
  int count = 0;
  const uint16_t m16 = fp16_ieee_from_fp32_value(lo);
  if (!q41 || fp16_ieee_to_fp32_value(m16) == lo) {  // Q4_1: the minimum is m, exactly
    const uint16_t nearest = fp16_ieee_from_fp32_value(q41 ? (hi - lo) / top : amax / top);
    const uint16_t offset = q41 ? m16 : 0;
    candidates[count++] = {nearest, offset};
    candidates[count++] = {static_cast<uint16_t>(nearest + 1), offset};
    if (nearest > 0) candidates[count++] = {static_cast<uint16_t>(nearest - 1), offset};
  }
  // Q4_0: the largest magnitude is d (q - 8) for some q - 8 = j in [-8, 7], j = -8 (q = 0)
  // where GGUF's quantiser made d from it, another j where the levels came from elsewhere
  // (an importance matrix's fit)
  for (int j = -8; q41 && j <= 7; ++j) {
    const uint16_t d16 = fp16_ieee_from_fp32_value(extreme / static_cast<float>(j));
    const float d = fp16_ieee_to_fp32_value(d16);
    const uint16_t q40_m16 = fp16_ieee_from_fp32_value(-8.f * d);
    if (j != 0 && d * static_cast<float>(j) == extreme &&
        fp16_ieee_to_fp32_value(q40_m16) == -8.f * d) {
      candidates[count++] = {d16, q40_m16};
    }
  }
  int q[kBlock];
  for (int c = 0; c < count; ++c) {
    const Candidate k = candidates[c];
    if (!rebuilds(v, k.d16, k.m16, bottom, top, q)) continue;
    std::memcpy(out, &k.d16, 2);
    if (q41) {
      std::memcpy(out + 2, &k.m16, 2);
      for (int64_t j = 0; j < 16; ++j) out[4 + j] = static_cast<uint8_t>(q[j] | (q[j + 16] << 4));
    } else {
      for (int64_t j = 0; j < kBlock; ++j) out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(q[j]));
    }
    return true;
  }
  return false;
}

}  // namespace

std::optional<at::Tensor> requantize_blocks(at::Tensor w, int64_t format) {
  const int64_t block_bytes = block_bytes_of(format);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w: float32 [N, K]");
  if (w.size(1) % kBlock != 0) return std::nullopt;
  w = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = k / kBlock;
  at::Tensor out = at::empty({n, blocks * block_bytes},
                             w.options().dtype(format == 1 ? at::kByte : at::kChar));
  const float* v = w.data_ptr<float>();
  auto* bytes = static_cast<uint8_t*>(out.data_ptr());
  std::atomic<bool> failed{false};
  at::parallel_for(0, n, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1 && !failed.load(std::memory_order_relaxed); ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        if (!encode_block(v + r * k + b * kBlock, format, bytes + (r * blocks + b) * block_bytes)) {
          failed = true;
          return;
        }
      }
    }
  });
  if (failed) return std::nullopt;
  return out;
}

at::Tensor dequantize_blocks(at::Tensor w, int64_t format) {
  const int64_t block_bytes = block_bytes_of(format);
  TORCH_CHECK(w.dim() == 2 && w.element_size() == 1 && w.is_contiguous(),
              "w: the blocks' contiguous bytes [N, K / 32 * block bytes]");
  TORCH_CHECK(w.size(1) % block_bytes == 0, "w's rows must be whole blocks of ", block_bytes,
              " bytes");
  const int64_t n = w.size(0), ld = w.size(1), k = ld / block_bytes * kBlock;
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kFloat));
  const auto* bytes = static_cast<const uint8_t*>(w.data_ptr());
  if (format == 1) {
    dequantize_rows<Q41>(bytes, ld, n, k, out.data_ptr<float>());
  } else {
    dequantize_rows<Q80>(bytes, ld, n, k, out.data_ptr<float>());
  }
  return out;
}

namespace {

// ---- Products on weights kept in blocks: 8-bit integer dot products ----
//
// x is quantised once per call, block by block as the weight's blocks run along K, in two
// 8-bit parts: a block of 32 values gets the scale dx = max|x| / 127 and the integers
// qx = round(x / dx) in [-127, 127] (llama.cpp's Q8_1 activations, with float32 scales), and
// what they leave (at most dx / 2 a value) is rounded again, with the scale dx / 254. Each
// part meets a weight block in one integer dot product, scaled once: Q4_1 (v = d q + m, q in
// 0..15) gives d s (q . qs) + m s sum(qs) for a part of scale s, Q8_0 (v = d q) d s (q . qs).
// The two products added are the weight's product with x rounded to about 16 bits (an error
// of at most dx / 508 a value). One part alone, as llama.cpp computes, changes the built-in
// model's greedy answers: its first token after "What is the capital of France?" is a
// near-tie (logprobs -1.883 and -1.885 on the exact values) that 8-bit x turns, as it does
// in llama.cpp. (Q4_1's second term takes the part's own sum: the exact sum(x) is worse,
// since a block's d q and m nearly cancel, leaving the first term's rounding alone.) About
// one instruction per value of a group of eight rows and part, where rebuilding the float32
// values takes about three, which makes the product bound by the memory rather than by
// arithmetic.
//
// Three forms of the dot product, each compiled where the CPU has its instructions and
// selectable for tests: portable integer loops; AVX2 (vpmaddubsw u8 x s8 pairs into 16 bits,
// then vpmaddwd into 32); AVX512-VNNI (vpdpbusd u8 x s8 quads straight into 32 bits). Q8_0's
// signed weights meet both through |q| . (qx with q's sign), which keeps the AVX2 pair sums
// (at most 2 x 128 x 127) inside 16 bits.
enum Form : int64_t { kBest = 0, kPortable = 1, kAvx2 = 2, kVnni = 3 };

struct QuantizedX {  // x's rows in two parts: rows 2 i and 2 i + 1
  at::Tensor q;      // int8 [2 m, K]
  at::Tensor scale;  // float [2 m, K / 32]: the part's scale s
  at::Tensor sum;    // float [2 m, K / 32]: s sum(q)
};

// One block of 32 values as 8-bit integers with scale `scale` (0: all zero) -> their sum.
// The scales are true quotients (no reciprocal estimates under -ffast-math), so the levels
// are the same whatever the CPU and the compiler's choices.
__attribute__((optimize("no-reciprocal-math"))) int32_t quantize_block(const float* v, float scale, int8_t* q) {
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  int32_t levels = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const float level = std::min(127.f, std::max(-127.f, std::nearbyint(v[j] * inv)));
    q[j] = static_cast<int8_t>(level);
    levels += static_cast<int32_t>(level);
  }
  return levels;
}

// x [m, K] in two 8-bit parts per row (see above): rows 2 i and 2 i + 1 of the result.
__attribute__((optimize("no-reciprocal-math"))) QuantizedX quantize_x(const float* x, int64_t m, int64_t k) {
  const int64_t nb = k / kBlock;
  QuantizedX out{at::empty({2 * m, k}, at::kChar), at::empty({2 * m, nb}, at::kFloat),
                 at::empty({2 * m, nb}, at::kFloat)};
  auto* q = out.q.data_ptr<int8_t>();
  float *scale = out.scale.data_ptr<float>(), *sum = out.sum.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + i * k + b * kBlock;
      const int64_t high = 2 * i * nb + b, low = high + nb;  // (row 2 i, b), (row 2 i + 1, b)
      float amax = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::abs(v[j]));
      scale[high] = amax / 127.f;
      int8_t* qh = q + 2 * i * k + b * kBlock;
      sum[high] = scale[high] * static_cast<float>(quantize_block(v, scale[high], qh));
      float rest[kBlock];  // what the first part leaves (at most half its step), rounded once
      for (int64_t j = 0; j < kBlock; ++j) rest[j] = std::fma(-scale[high], static_cast<float>(qh[j]), v[j]);
      scale[low] = scale[high] / 254.f;
      sum[low] = scale[low] * static_cast<float>(quantize_block(rest, scale[low], qh + k));
    }
  }
  return out;
}

template <typename W>
struct IntProblem {
  const int8_t* xq;      // [m, k]
  const float* xscale;   // [m, k / 32]
  const float* xsum;     // [m, k / 32]
  const uint8_t* w;      // [n, ld] the rows' blocks
  const float* bias;     // [n] or nullptr
  float* y;              // [m, n]
  int64_t m, n, k, ld;
};

// A weight block's integers . the same block of x's (the portable form). Not vectorised by
// the compiler: GCC 12 with AVX512-VNNI turns this signed . signed loop into vpdpbusd, which
// takes the weight's bytes as unsigned (a negative Q8_0 integer q read as q + 256).
template <typename W>
__attribute__((optimize("no-tree-vectorize"))) int32_t block_dot_portable(const uint8_t* blk,
                                                                        const int8_t* xq) {
  int32_t dot = 0;
  if constexpr (std::is_same_v<W, Q41>) {
    for (int64_t j = 0; j < 16; ++j) {
      dot += static_cast<int32_t>(blk[4 + j] & 15) * xq[j];
      dot += static_cast<int32_t>(blk[4 + j] >> 4) * xq[j + 16];
    }
  } else {
    for (int64_t j = 0; j < kBlock; ++j) dot += static_cast<int32_t>(static_cast<int8_t>(blk[2 + j])) * xq[j];
  }
  return dot;
}

// Rows [r0, r1) of the product, block by block in GGUF's layout (the portable form; every
// form's rows past the last whole group).
template <typename W>
void int_rows_portable(const IntProblem<W>& p, int64_t r0, int64_t r1) {
  const int64_t nb = p.k / kBlock;
  uint8_t buf[kBlockBytes<W>];
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t i = 0; i < p.m; ++i) {
      float s = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = gguf_block<W>(p.w, p.ld, p.n, r, b, buf);
        const int64_t at = i * nb + b;
        const int32_t dot = block_dot_portable<W>(blk, p.xq + i * p.k + b * kBlock);
        s += half_at(blk) * p.xscale[at] * static_cast<float>(dot);
        if constexpr (std::is_same_v<W, Q41>) s += half_at(blk + 2) * p.xsum[at];
      }
      if (p.bias != nullptr) s += p.bias[r];
      p.y[i * p.n + r] = s;
    }
  }
}

#ifdef PIPESERVE_BLOCK_TILES
#define PIPESERVE_INT8_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PIPESERVE_INT8_VNNI 1
#endif

// A tile's integers (see the layout above) as eight vectors, vector t holding values
// 4t .. 4t + 3 of each of the group's rows: Q4_1's levels (0..15), Q8_0's signed integers.
inline void tile_ints(const Q41*, const uint8_t* ints, __m256i* w) {
  const __m256i nibble = _mm256_set1_epi8(15);
  for (int64_t u = 0; u < 4; ++u) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ints + 32 * u));
    w[u] = _mm256_and_si256(raw, nibble);
    w[u + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  }
}
inline void tile_ints(const Q80*, const uint8_t* ints, __m256i* w) {
  for (int64_t t = 0; t < 8; ++t) {
    w[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ints + 32 * t));
  }
}

// The group's eight rows . one block of x (32 int8), one int32 sum per lane (row).
template <Form F, typename W>
inline __m256i tile_dot(const __m256i* w, const int8_t* x) {
  __m256i acc = _mm256_setzero_si256();
  if constexpr (std::is_same_v<W, Q41>) {
#ifdef PIPESERVE_INT8_VNNI
    if constexpr (F == kVnni) {
      for (int64_t t = 0; t < 8; ++t) {
        int32_t quad;
        std::memcpy(&quad, x + 4 * t, 4);
        acc = _mm256_dpbusd_epi32(acc, w[t], _mm256_set1_epi32(quad));
      }
      return acc;
    }
#endif
    // levels (<= 15) . int8 pairs stay within 16 bits summed over all eight (8 x 2 x 15 x 127)
    for (int64_t t = 0; t < 8; ++t) {
      int32_t quad;
      std::memcpy(&quad, x + 4 * t, 4);
      acc = _mm256_add_epi16(acc, _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(quad)));
    }
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
  } else {  // |q| . (x with q's sign): unsigned . signed
    for (int64_t t = 0; t < 8; ++t) {
      int32_t quad;
      std::memcpy(&quad, x + 4 * t, 4);
      const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(quad), w[t]);
      const __m256i ws = _mm256_sign_epi8(w[t], w[t]);
#ifdef PIPESERVE_INT8_VNNI
      if constexpr (F == kVnni) {
        acc = _mm256_dpbusd_epi32(acc, ws, xs);
        continue;
      }
#endif
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ws, xs), _mm256_set1_epi16(1)));
    }
    return acc;
  }
}

// Group g's eight outputs for x rows [i0, i0 + MT): each tile loaded and unpacked once
// serves the MT rows of x.
template <Form F, int64_t MT, typename W>
inline void group_tile(const IntProblem<W>& p, int64_t g, int64_t i0) {
  const int64_t nb = p.k / kBlock, tile_bytes = kGroup * kBlockBytes<W>;
  const uint8_t* tiles = p.w + g * kGroup * p.ld;
  __m256 acc[MT];
  for (int64_t i = 0; i < MT; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* tile = tiles + b * tile_bytes;
    for (int64_t line = 0; line < tile_bytes; line += 64) __builtin_prefetch(tile + 8 * tile_bytes + line);
    __m256i w[8];
    tile_ints(static_cast<const W*>(nullptr), tile + kGroup * kHeadBytes<W>, w);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile)));
    for (int64_t i = 0; i < MT; ++i) {
      const int64_t at = (i0 + i) * nb + b;
      const __m256 dot = _mm256_cvtepi32_ps(tile_dot<F, W>(w, p.xq + (i0 + i) * p.k + b * kBlock));
      acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(dot, d), _mm256_set1_ps(p.xscale[at]), acc[i]);
    }
    if constexpr (std::is_same_v<W, Q41>) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile + 16)));
      for (int64_t i = 0; i < MT; ++i) {
        acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(p.xsum[(i0 + i) * nb + b]), acc[i]);
      }
    }
  }
  for (int64_t i = 0; i < MT; ++i) {
    float* y = p.y + (i0 + i) * p.n + g * kGroup;
    __m256 out = acc[i];
    if (p.bias != nullptr) out = _mm256_add_ps(out, _mm256_loadu_ps(p.bias + g * kGroup));
    _mm256_storeu_ps(y, out);
  }
}

// The x rows in tiles of up to kXTile: a group's tiles, read from memory for the first, come
// from L1 for the others (a group of SmolLM2's 1,536-wide rows: 7.5 KiB in Q4_1).
constexpr int64_t kXTile = 4;

template <Form F, typename W>
inline void group_rows(const IntProblem<W>& p, int64_t g) {
  int64_t i = 0;
  for (; i + kXTile <= p.m; i += kXTile) group_tile<F, kXTile>(p, g, i);
  switch (p.m - i) {
    case 3: return group_tile<F, 3>(p, g, i);
    case 2: return group_tile<F, 2>(p, g, i);
    case 1: return group_tile<F, 1>(p, g, i);
    default: return;
  }
}
#endif

// Threads take runs of groups, one after another (four runs side by side, as `in_streams`
// reads plain weights, made one request of the built-in model 0.85x at one and two threads
// on Zen 4: these products are bound by their integer work more than by the memory); the
// rows past the last group go to the last run's thread.
template <Form F, typename W>
void run_int_form(const IntProblem<W>& p) {
  const int64_t groups = p.n / kGroup;
  at::parallel_for(0, groups + 1, kGrainRows / kGroup, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      if (g == groups) {
        int_rows_portable(p, groups * kGroup, p.n);
      } else if constexpr (F == kPortable) {
        int_rows_portable(p, g * kGroup, (g + 1) * kGroup);
      } else {
#ifdef PIPESERVE_BLOCK_TILES
        group_rows<F>(p, g);
#endif
      }
    }
  });
}

constexpr Form best_form() {
#if defined(PIPESERVE_INT8_VNNI)
  return kVnni;
#elif defined(PIPESERVE_INT8_AVX2)
  return kAvx2;
#else
  return kPortable;
#endif
}

template <typename W>
void run_int(const IntProblem<W>& p, Form form) {
  switch (form == kBest ? best_form() : form) {
#ifdef PIPESERVE_INT8_VNNI
    case kVnni:
      return run_int_form<kVnni>(p);
#endif
#ifdef PIPESERVE_INT8_AVX2
    case kAvx2:
      return run_int_form<kAvx2>(p);
#endif
    case kPortable:
      return run_int_form<kPortable>(p);
    default:
      TORCH_CHECK(false, "the integer product's form ", form, " is not compiled on this CPU");
  }
}

}  // namespace

std::vector<int64_t> int8_product_forms() {
  std::vector<int64_t> forms{kPortable};
#ifdef PIPESERVE_INT8_AVX2
  forms.push_back(kAvx2);
#endif
#ifdef PIPESERVE_INT8_VNNI
  forms.push_back(kVnni);
#endif
  return forms;
}

at::Tensor skinny_linear_blocks(at::Tensor x, at::Tensor w, int64_t format,
                                std::optional<at::Tensor> bias, int64_t form) {
  const int64_t block_bytes = block_bytes_of(format);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x [m, K] and w [N, K / 32 * block bytes] expected");
  TORCH_CHECK(w.element_size() == 1 && w.is_contiguous(), "w: the blocks' contiguous bytes");
  TORCH_CHECK(w.size(1) % block_bytes == 0 && w.size(1) / block_bytes * kBlock == x.size(1),
              "w's rows must hold x.size(1) / 32 blocks of ", block_bytes, " bytes");
  TORCH_CHECK(x.size(0) <= kMaxRows, "skinny_linear takes at most ", kMaxRows, " rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "skinny_linear takes float32 or bfloat16 x");
  TORCH_CHECK(form >= kBest && form <= kVnni, "form: 0 (best), 1 portable, 2 AVX2, 3 VNNI");
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1), ld = w.size(1);
  const Operands o(x, bias, n);
  const QuantizedX xq = quantize_x(o.xf.data_ptr<float>(), m, k);
  at::Tensor parts = at::empty({2 * m, n}, o.y.options());  // each row's two parts' products
  const auto* bytes = static_cast<const uint8_t*>(w.data_ptr());
  const int8_t* q = xq.q.data_ptr<int8_t>();
  const float *scale = xq.scale.data_ptr<float>(), *sum = xq.sum.data_ptr<float>();
  float* py = parts.data_ptr<float>();
  if (format == 1) {
    run_int(IntProblem<Q41>{q, scale, sum, bytes, nullptr, py, 2 * m, n, k, ld}, static_cast<Form>(form));
  } else {
    run_int(IntProblem<Q80>{q, scale, sum, bytes, nullptr, py, 2 * m, n, k, ld}, static_cast<Form>(form));
  }
  float* y = o.y.data_ptr<float>();
  const float* b = o.bias();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c = 0; c < n; ++c) {
      y[i * n + c] = py[2 * i * n + c] + py[(2 * i + 1) * n + c] + (b != nullptr ? b[c] : 0.f);
    }
  }
  return x.scalar_type() == at::kFloat ? o.y : o.y.to(x.scalar_type());
}
