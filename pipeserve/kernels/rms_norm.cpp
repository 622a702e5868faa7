// RMSNorm, and the pre-norm residual step with it, in one pass per row (a decode step's
// ~10 small torch ops per norm, 60 per step of a 30-layer model, become one call):
//   rms_norm:      out = w * dtype(x * rsqrt(mean(x^2) + eps))
//   add_rms_norm:  s = dtype(x + residual); out = rms_norm(s); returns (out, s)
// bitwise as the torch ops compute it (backends/base.py NormKernels): float32 arithmetic, the
// normalised row rounded to the input dtype before the weight's product, which is rounded
// again, and the sum of squares added in the order of torch's own float32 sum
// (`torch_sum_of_squares` below). float32 and bfloat16, x, residual and w of one dtype.
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include "kernels.h"

// Every rounding below is the torch ops' one: no reassociation, no reciprocal for the
// division, no fused multiply-add (the build's -ffast-math and GCC's fp-contract=fast allow
// all three; the tests compare bitwise with torch). A function compiled under other options
// is not inlined here, so this file's vectors and conversions are its own, below the pragma.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

constexpr int64_t kLanes = 8;  // torch's Vectorized<float> for its sums (see below)
typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

constexpr int64_t kGrainRows = 16;
constexpr int64_t kIlp = 4;     // torch's sum: four independent sums of lanes
constexpr int64_t kLevels = 4;  // and four levels of its cascade

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {  // a bfloat16 is a float32's top half
  uint16_t half;
  std::memcpy(&half, &v, sizeof(half));
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline v8 load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline v8 load8(const c10::BFloat16* p) {
  v8h halves;
  std::memcpy(&halves, p, sizeof(halves));
  const v8u bits = __builtin_convertvector(halves, v8u) << 16;
  v8 r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

// Values rounded to T: float32 as they are; bfloat16 to nearest even, NaN as a quiet NaN
// (c10::BFloat16's cast rounds so; torch's vectorised cast too, with another NaN's bits)
template <typename T>
inline T rounded(float v);
template <>
inline float rounded<float>(float v) {
  return v;
}
template <>
inline c10::BFloat16 rounded<c10::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint16_t half = v != v ? 0x7FC0 : (bits + ((bits >> 16) & 1) + 0x7FFF) >> 16;  // NaN
  c10::BFloat16 r;
  std::memcpy(&r, &half, sizeof(half));
  return r;
}
// v rounded to T's precision, kept as float32 (a NaN stays a NaN)
inline v8 round_to(float*, v8 v) { return v; }
inline v8 round_to(c10::BFloat16*, v8 v) {
  v8u bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const v8u nan = (v8u)(v != v);
  bits = (((bits + ((bits >> 16) & 1) + 0x7FFF) & 0xFFFF0000u) & ~nan) | (bits & nan);
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
inline void store_rounded(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
inline void store_rounded(c10::BFloat16* p, v8 v) {
  v8u bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const v8u nan = (v8u)(v != v);  // all ones where v is NaN
  const v8u out = (((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16) & ~nan) | (nan & 0x7FC0);
  const v8h halves = __builtin_convertvector(out, v8h);
  std::memcpy(p, &halves, sizeof(halves));
}

inline int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2: 1 up to 2
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// torch's float32 sum of `size` terms (ATen's cascade_sum for a reduction over a contiguous
// row, aten/src/ATen/native/cpu/SumKernel.cpp: row_sum over multi_row_sum): term i goes into
// sum i mod 4, each sum a cascade of four levels of 2^p terms (p = 4 at any row of fewer than
// 2^20 terms), which are added into the level above at every 2^p terms; the terms left after
// the last group of four go into sum 0, then sums 1, 2 and 3 are added into it. E is a v8 of
// eight lanes or a float; term(i) the i-th term.
template <typename E, typename Term>
E torch_row_sum(int64_t size, Term term) {
  const int64_t rows = size / kIlp;
  const int64_t power = std::max<int64_t>(4, ceil_log2(rows) / kLevels);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  E acc[kLevels][kIlp] = {};
  int64_t i = 0;
  while (i + step <= rows) {
    for (int64_t j = 0; j < step; ++j, ++i) {
      for (int64_t k = 0; k < kIlp; ++k) acc[0][k] += term(i * kIlp + k);
    }
    for (int64_t level = 1; level < kLevels; ++level) {
      for (int64_t k = 0; k < kIlp; ++k) {
        acc[level][k] += acc[level - 1][k];
        acc[level - 1][k] = E{};
      }
      if ((i & (mask << (level * power))) != 0) break;
    }
  }
  for (; i < rows; ++i) {
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] += term(i * kIlp + k);
  }
  for (int64_t level = 1; level < kLevels; ++level) {
    for (int64_t k = 0; k < kIlp; ++k) acc[0][k] += acc[level][k];
  }
  for (int64_t j = rows * kIlp; j < size; ++j) acc[0][0] += term(j);
  for (int64_t k = 1; k < kIlp; ++k) acc[0][0] += acc[0][k];
  return acc[0][0];
}

// The sum of x[c]^2 over a row of h values as torch's float32 sum adds x.float().pow(2)
// (vectorized_inner_sum): rows of at least 8 values as 8-lane vectors (torch's Vectorized
// <float> for its sums on x86 at every CPU capability: AVX512 builds run the AVX2 kernel),
// then the values past the last vector, then the vector's lanes in order; shorter rows as
// single values in the same order of sums.
template <typename T>
float torch_sum_of_squares(const T* x, int64_t h) {
  auto square = [](float v) { return v * v; };
  if (h < kLanes) {
    return torch_row_sum<float>(h, [&](int64_t c) { return square(widen(x[c])); });
  }
  const int64_t vectors = h / kLanes;
  const v8 lanes = torch_row_sum<v8>(vectors, [&](int64_t j) {
    const v8 v = load8(x + j * kLanes);
    return v * v;
  });
  float sum = 0.f;
  for (int64_t c = vectors * kLanes; c < h; ++c) sum += square(widen(x[c]));
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

template <typename T>
void run(const T* x, const T* residual, const T* w, T* out, T* sum, int64_t rows, int64_t h,
         float eps) {
  const int64_t hv = h - h % kLanes;
  at::parallel_for(0, rows, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * h;
      T* sr = sum == nullptr ? nullptr : sum + r * h;
      if (sr != nullptr) {
        const T* rr = residual + r * h;
        for (int64_t c = 0; c < hv; c += kLanes) {
          store_rounded(sr + c, load8(xr + c) + load8(rr + c));
        }
        for (int64_t c = hv; c < h; ++c) sr[c] = rounded<T>(widen(xr[c]) + widen(rr[c]));
        xr = sr;
      }
      // mean, + eps, then 1 / sqrt as two rounded operations, as torch's sum.div_, add and
      // rsqrt
      const float mean = torch_sum_of_squares(xr, h) / static_cast<float>(h);
      const float scale = 1.f / std::sqrt(mean + eps);
      T* o = out + r * h;
      for (int64_t c = 0; c < hv; c += kLanes) {
        const v8 normed = round_to(o, load8(xr + c) * (v8{} + scale));
        store_rounded(o + c, load8(w + c) * normed);
      }
      for (int64_t c = hv; c < h; ++c) {
        const T n = rounded<T>(widen(xr[c]) * scale);
        o[c] = rounded<T>(widen(w[c]) * widen(n));
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                        const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rms_norm takes float32 or bfloat16");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.is_contiguous(),
              "the weight: one contiguous row of x's dtype");
  const int64_t h = w.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == h && x.is_contiguous(), "x [..., hidden], contiguous");
  const int64_t rows = x.numel() / std::max<int64_t>(h, 1);
  at::Tensor out = at::empty_like(x), sum;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                    residual->is_contiguous(),
                "the residual: x's shape and dtype, contiguous");
    sum = at::empty_like(x);
  }
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr, w.data_ptr<float>(),
        out.data_ptr<float>(), residual ? sum.data_ptr<float>() : nullptr, rows, h, e);
  } else {
    using B = c10::BFloat16;
    run(x.data_ptr<B>(), residual ? residual->data_ptr<B>() : nullptr, w.data_ptr<B>(),
        out.data_ptr<B>(), residual ? sum.data_ptr<B>() : nullptr, rows, h, e);
  }
  return {out, sum};
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) {
  return std::get<0>(norm(x, std::nullopt, w, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w,
                                                double eps) {
  return norm(x, residual, w, eps);
}

#pragma GCC pop_options
