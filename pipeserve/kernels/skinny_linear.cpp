// A linear layer's product for a few rows (decode steps): y [m, N] = x [m, K] . w [N, K]^T
// (+ bias [N]), what a step of a handful of requests spends most of its time in. Each weight
// byte is read once per call, and the activations stay in L1: a register tile of kRows
// output rows x kPair rows of x keeps its sums in registers over all of K, each weight vector
// loaded once serving both rows of x (so m rows of x cost m / 2 passes over the weights'
// L1-resident tile rows, not m passes from memory). Threads take blocks of output rows, so
// two threads draw on the memory twice. The weight is read in the layout torch keeps ([N, K]
// row-major): nothing is packed.
//
// Arithmetic is float32: x is widened once per call, a bfloat16 weight as it is loaded (a
// bfloat16 is a float32's top half), so bfloat16 weights with float32 activations read half
// the bytes of float32 weights for the same products where the checkpoint is bfloat16. The
// output and bias take x's dtype. Each output is one sum in a fixed order (eight lane sums
// over K, then the lanes added), so a row's result does not depend on the other rows of x or
// on the thread count.
//
// `skinny_linear_blocks` takes a weight kept in GGUF's blocks of 32 values along K, each row
// its blocks' bytes: Q4_1 (20 bytes: fp16 d, fp16 m, 16 bytes holding q_j in the low nibble
// of byte j and q_(j+16) in its high one; v = d * q + m) or Q8_0 (34 bytes: fp16 d, 32 int8 q;
// v = d * q). Each weight vector is rebuilt in registers as the dequantised checkpoint holds
// it (a float32 product, then the sum: two roundings, as GGUF's reference dequantisation),
// then used exactly as a float32 weight, so the result is bitwise the float32 kernel's on the
// dequantised weight, for a quarter (Q4_1) or a bit more than a quarter (Q8_0) of its bytes.
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

// Bytes from the start of a row to its value c (the start of c's block for block formats).
template <typename W>
inline int64_t offset_of(int64_t c) {
  if constexpr (kBlockBytes<W> > 0) {
    return (c / kBlock) * kBlockBytes<W>;
  } else {
    return c * static_cast<int64_t>(sizeof(W));
  }
}

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

// Eight weight values of a row from value c on, whatever the row's form.
template <typename W>
inline v8 wload_at(const W* row, int64_t c) {
  if constexpr (kBlockBytes<W> > 0) {
    return wload(row, c);
  } else {
    return wload(row + c);
  }
}

template <typename W>
struct Problem {
  const float* x;  // [m, k], float32 (widened once where the caller's is bfloat16)
  const W* w;      // [n, ld]: k values per row, or a row's blocks
  const float* bias;  // [n] float32, or nullptr
  float* y;        // [m, n]
  int64_t m, n, k;
  int64_t ld;      // a row's length in W (k, or its blocks' bytes)
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
  constexpr int64_t every = kBlockBytes<W> > 0 ? kBlock : 64 / sizeof(W);  // values per line
  for (int64_t c = 0; c < kv; c += kLanes) {
    // the next tile's rows (the weight is one contiguous stream): more lines in flight than
    // the hardware prefetchers keep for these four interleaved streams
    if (c % every == 0) {
      for (int64_t r = 0; r < R; ++r) {
        __builtin_prefetch(reinterpret_cast<const char*>(wr[r] + R * p.ld) + offset_of<W>(c));
      }
    }
    v8 xv[MT];
    for (int64_t i = 0; i < MT; ++i) xv[i] = load8(xi[i] + c);
    for (int64_t r = 0; r < R; ++r) {
      const v8 wv = wload_at(wr[r], c);
      for (int64_t i = 0; i < MT; ++i) acc[i][r] = fma8(wv, xv[i], acc[i][r]);
    }
  }
  for (int64_t i = 0; i < MT; ++i) {
    for (int64_t r = 0; r < R; ++r) {
      float s = vec8::lanes_sum(acc[i][r]);
      if constexpr (kBlockBytes<W> == 0) {  // blocks hold whole vectors
        for (int64_t c = kv; c < k; ++c) s += widen(wr[r][c]) * xi[i][c];
      }
      if (p.bias != nullptr) s += p.bias[r0 + r];
      p.y[(i0 + i) * p.n + r0 + r] = s;
    }
  }
}

// Outputs [r0, r0 + R) of every row of x.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PIPESERVE_BLOCK_TILES 1
// A whole block's four weight vectors at once: its scale (and minimum) converted and
// broadcast once, its integers loaded once, where the per-vector `wload` above does both per
// 8 values (Zen 4, one thread, SmolLM2's layers at one row: 1.2-2.4x faster; the built-in
// model's decode 1.23x). The same values, each rounded the same way.
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

// `tile` for block formats, a block at a time: each accumulator still takes the values in
// the order of K, so the sums are bitwise `tile`'s.
template <int64_t R, int64_t MT, typename W>
inline void tile_blocks(const Problem<W>& p, int64_t r0, int64_t i0) {
  const int64_t k = p.k;
  const uint8_t* wr[R];
  const float* xi[MT];
  for (int64_t r = 0; r < R; ++r) wr[r] = &(p.w + (r0 + r) * p.ld)->byte;
  for (int64_t i = 0; i < MT; ++i) xi[i] = p.x + (i0 + i) * k;
  v8 acc[MT][R] = {};
  for (int64_t c = 0; c < k; c += kBlock) {
    const int64_t at = (c / kBlock) * kBlockBytes<W>;
    for (int64_t r = 0; r < R; ++r) __builtin_prefetch(wr[r] + R * p.ld + at);
    for (int64_t r = 0; r < R; ++r) {
      v8 w[4];
      block_values(static_cast<const W*>(nullptr), wr[r] + at, w);
      for (int64_t j = 0; j < 4; ++j) {
        for (int64_t i = 0; i < MT; ++i) acc[i][r] = fma8(w[j], load8(xi[i] + c + kLanes * j), acc[i][r]);
      }
    }
  }
  for (int64_t i = 0; i < MT; ++i) {
    for (int64_t r = 0; r < R; ++r) {
      float s = vec8::lanes_sum(acc[i][r]);
      if (p.bias != nullptr) s += p.bias[r0 + r];
      p.y[(i0 + i) * p.n + r0 + r] = s;
    }
  }
}
#endif

template <int64_t R, typename W>
inline void rows(const Problem<W>& p, int64_t r0) {
#ifdef PIPESERVE_BLOCK_TILES
  if constexpr (kBlockBytes<W> > 0) {
    int64_t i = 0;
    for (; i + kPair <= p.m; i += kPair) tile_blocks<R, kPair>(p, r0, i);
    if (i < p.m) tile_blocks<R, 1>(p, r0, i);
    return;
  }
#endif
  int64_t i = 0;
  for (; i + kPair <= p.m; i += kPair) tile<R, kPair>(p, r0, i);
  if (i < p.m) tile<R, 1>(p, r0, i);
}

template <typename W>
void run(const Problem<W>& p) {
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

// What both entry points hand the kernel: x widened once ([m, K], small), the bias widened,
// the float32 output [m, N].
struct Operands {
  at::Tensor xf, bf, y;
  Operands(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t n)
      : xf(x.to(at::kFloat).contiguous()), y(at::empty({x.size(0), n}, x.options().dtype(at::kFloat))) {
    if (bias.has_value()) {
      TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias [N] expected");
      TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "the bias must have x's dtype");
      bf = bias->to(at::kFloat).contiguous();
    }
  }
  const float* bias() const { return bf.defined() ? bf.data_ptr<float>() : nullptr; }
};

}  // namespace

int64_t skinny_linear_max_rows() { return kMaxRows; }

at::Tensor skinny_linear(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x [m, K] and w [N, K] expected");
  TORCH_CHECK(x.size(1) == w.size(1), "x and w disagree on K");
  TORCH_CHECK(x.size(0) <= kMaxRows, "skinny_linear takes at most ", kMaxRows, " rows");
  for (const at::Tensor* t : {&x, &w}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16,
                "skinny_linear takes float32 or bfloat16");
  }
  TORCH_CHECK(w.is_contiguous(), "the weight must be contiguous");
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  const Operands o(x, bias, n);
  const float *xf = o.xf.data_ptr<float>(), *b = o.bias();
  at::Tensor y = o.y;
  if (w.scalar_type() == at::kFloat) {
    run(Problem<float>{xf, w.data_ptr<float>(), b, y.data_ptr<float>(), m, n, k, k});
  } else {
    using B = c10::BFloat16;
    run(Problem<B>{xf, w.data_ptr<B>(), b, y.data_ptr<float>(), m, n, k, k});
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

namespace {

template <typename W>
void dequantize_rows(const W* w, int64_t ld, int64_t n, int64_t k, float* out) {
  at::parallel_for(0, n, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
#ifdef PIPESERVE_BLOCK_TILES
      const uint8_t* row = &(w + r * ld)->byte;
      for (int64_t c = 0; c < k; c += kBlock) {
        v8 values[4];
        block_values(w, row + (c / kBlock) * kBlockBytes<W>, values);
        for (int64_t j = 0; j < 4; ++j) vec8::store8(out + r * k + c + kLanes * j, values[j]);
      }
#else
      for (int64_t c = 0; c < k; c += kLanes) vec8::store8(out + r * k + c, wload_at(w + r * ld, c));
#endif
    }
  });
}

int64_t block_bytes_of(int64_t format) {
  TORCH_CHECK(format == 1 || format == 2, "format: 1 (Q4_1) or 2 (Q8_0)");
  return format == 1 ? kBlockBytes<Q41> : kBlockBytes<Q80>;
}

}  // namespace

namespace {

// One block's values v[0..32) as `format`'s block at `out`, if some fp16 scale (the estimate
// rounded, or one step either side) and integers give every value back bitwise with GGUF's
// arithmetic (a float32 product, then the sum: `volatile` keeps the two roundings apart).
bool encode_block(const float* v, int64_t format, uint8_t* out) {
  using c10::detail::fp16_ieee_from_fp32_value;
  using c10::detail::fp16_ieee_to_fp32_value;
  float lo = v[0], hi = v[0], amax = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) {
    if (!(v[i] == v[i]) || v[i] - v[i] != 0.f) return false;  // NaN or infinite
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
    amax = std::max(amax, std::abs(v[i]));
  }
  const bool q41 = format == 1;
  const uint16_t m16 = fp16_ieee_from_fp32_value(lo);
  const float m = q41 ? fp16_ieee_to_fp32_value(m16) : 0.f;
  if (q41 && m != lo) return false;  // the minimum is the block's m, exactly
  const float top = q41 ? 15.f : 127.f, bottom = q41 ? 0.f : -127.f;
  const uint16_t nearest = fp16_ieee_from_fp32_value(q41 ? (hi - lo) / top : amax / top);
  const uint16_t candidates[3] = {nearest, static_cast<uint16_t>(nearest + 1),
                                  static_cast<uint16_t>(nearest > 0 ? nearest - 1 : 0)};
  for (uint16_t d16 : candidates) {
    const float d = fp16_ieee_to_fp32_value(d16);
    if (!(d >= 0.f) || d - d != 0.f) continue;
    int q[kBlock];
    bool ok = true;
    for (int64_t i = 0; i < kBlock && ok; ++i) {
      const float level = d == 0.f ? 0.f : std::nearbyint((v[i] - m) / d);
      q[i] = static_cast<int>(std::min(top, std::max(bottom, level)));
      volatile float product = d * static_cast<float>(q[i]);
      volatile float rebuilt = product + m;
      ok = rebuilt == v[i];
    }
    if (!ok) continue;
    std::memcpy(out, &d16, 2);
    if (q41) {
      std::memcpy(out + 2, &m16, 2);
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
    dequantize_rows(reinterpret_cast<const Q41*>(bytes), ld, n, k, out.data_ptr<float>());
  } else {
    dequantize_rows(reinterpret_cast<const Q80*>(bytes), ld, n, k, out.data_ptr<float>());
  }
  return out;
}

at::Tensor skinny_linear_blocks(at::Tensor x, at::Tensor w, int64_t format,
                                std::optional<at::Tensor> bias) {
  const int64_t block_bytes = block_bytes_of(format);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x [m, K] and w [N, K / 32 * block bytes] expected");
  TORCH_CHECK(w.element_size() == 1 && w.is_contiguous(), "w: the blocks' contiguous bytes");
  TORCH_CHECK(w.size(1) % block_bytes == 0 && w.size(1) / block_bytes * kBlock == x.size(1),
              "w's rows must hold x.size(1) / 32 blocks of ", block_bytes, " bytes");
  TORCH_CHECK(x.size(0) <= kMaxRows, "skinny_linear takes at most ", kMaxRows, " rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "skinny_linear takes float32 or bfloat16 x");
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1), ld = w.size(1);
  const Operands o(x, bias, n);
  const float *xf = o.xf.data_ptr<float>(), *b = o.bias();
  at::Tensor y = o.y;
  const auto* bytes = static_cast<const uint8_t*>(w.data_ptr());
  if (format == 1) {
    run(Problem<Q41>{xf, reinterpret_cast<const Q41*>(bytes), b,
                     y.data_ptr<float>(), m, n, k, ld});
  } else {
    run(Problem<Q80>{xf, reinterpret_cast<const Q80*>(bytes), b,
                     y.data_ptr<float>(), m, n, k, ld});
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}
