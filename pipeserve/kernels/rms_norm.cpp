// RMSNorm, and the pre-norm residual step with it, in one pass per row (a decode step's
// ~10 small torch ops per norm, 60 per step of a 30-layer model, become one call):
//   rms_norm:      out = w * dtype(x * rsqrt(mean(x^2) + eps))
//   add_rms_norm:  s = dtype(x + residual); out = rms_norm(s); returns (out, s)
// as the torch ops compute it (backends/base.py NormKernels): float32 arithmetic, the
// normalised row rounded to the input dtype before the weight's product, which is rounded
// again. The mean of squares is summed in 8 lanes, then the lanes (torch sums in another
// order: float32 rounding apart). float32 and bfloat16, x, residual and w of one dtype.
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <tuple>

#include "kernels.h"
#include "vec8.h"

namespace {

using vec8::kLanes;
using vec8::v8;
using vec8::widen;

constexpr int64_t kGrainRows = 16;

template <typename T>
inline T rounded(float v) {
  return static_cast<T>(v);  // bfloat16: to nearest even, as torch's casts
}

template <typename T>
void run(const T* x, const T* residual, const T* w, T* out, T* sum, int64_t rows, int64_t h,
         float eps) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * h;
      T* sr = sum == nullptr ? nullptr : sum + r * h;
      if (sr != nullptr) {
        const T* rr = residual + r * h;
        for (int64_t c = 0; c < h; ++c) sr[c] = rounded<T>(widen(xr[c]) + widen(rr[c]));
        xr = sr;
      }
      v8 acc = {};
      int64_t c = 0;
      for (; c + kLanes <= h; c += kLanes) {
        const v8 v = vec8::load8(xr + c);
        acc += v * v;
      }
      float squares = vec8::lanes_sum(acc);
      for (; c < h; ++c) squares += widen(xr[c]) * widen(xr[c]);
      // 1 / sqrt as two rounded operations, as torch's rsqrt (-ffast-math would make it an
      // estimate plus a Newton step: a last-bit difference that moves bfloat16 roundings)
      volatile float root = std::sqrt(squares / static_cast<float>(h) + eps);
      const float scale = 1.f / root;
      T* o = out + r * h;
      for (int64_t j = 0; j < h; ++j) {
        const T normed = rounded<T>(widen(xr[j]) * scale);
        o[j] = rounded<T>(widen(w[j]) * widen(normed));
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
