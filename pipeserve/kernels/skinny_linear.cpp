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
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <optional>

#include "kernels.h"
#include "vec8.h"

namespace {

using vec8::kLanes;
using vec8::load8;
using vec8::v8;

constexpr int64_t kRows = 4;        // output rows per register tile
constexpr int64_t kPair = 2;        // rows of x per register tile (kRows x kPair sums in registers)
constexpr int64_t kGrainRows = 64;  // output rows per parallel task, at least
constexpr int64_t kMaxRows = 16;    // rows of x one call takes (decode-sized)

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

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

template <typename W>
struct Problem {
  const float* x;  // [m, k], float32 (widened once where the caller's is bfloat16)
  const W* w;      // [n, k]
  const float* bias;  // [n] float32, or nullptr
  float* y;        // [m, n]
  int64_t m, n, k;
};

// y[i0 .. i0 + MT) x [r0 .. r0 + R): each weight vector loaded once serves the MT rows of x,
// each x vector the R weight rows; R x MT sums stay in registers over all of K.
template <int64_t R, int64_t MT, typename W>
inline void tile(const Problem<W>& p, int64_t r0, int64_t i0) {
  const int64_t k = p.k, kv = k - k % kLanes;
  const W* wr[R];
  const float* xi[MT];
  for (int64_t r = 0; r < R; ++r) wr[r] = p.w + (r0 + r) * k;
  for (int64_t i = 0; i < MT; ++i) xi[i] = p.x + (i0 + i) * k;
  v8 acc[MT][R] = {};
  for (int64_t c = 0; c < kv; c += kLanes) {
    // the next tile's rows (the weight is one contiguous stream): more lines in flight than
    // the hardware prefetchers keep for these four interleaved streams
    if (c % (64 / sizeof(W)) == 0) {
      for (int64_t r = 0; r < R; ++r) __builtin_prefetch(wr[r] + R * k + c);
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

// Outputs [r0, r0 + R) of every row of x.
template <int64_t R, typename W>
inline void rows(const Problem<W>& p, int64_t r0) {
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
  at::Tensor xf = x.to(at::kFloat).contiguous();  // [m, K]: small, widened once
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias [N] expected");
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "the bias must have x's dtype");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (w.scalar_type() == at::kFloat) {
    run(Problem<float>{xf.data_ptr<float>(), w.data_ptr<float>(), b, y.data_ptr<float>(), m, n, k});
  } else {
    using B = c10::BFloat16;
    run(Problem<B>{xf.data_ptr<float>(), w.data_ptr<B>(), b, y.data_ptr<float>(), m, n, k});
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}
