// A GQA layer's queries and keys made ready for attention on the CPU: the rotary embedding of
// q and k and the write of the batch's keys and values into the paged pool, in one call per
// layer where the torch ops take about sixteen (two rotations of six ops each, two indexed
// writes, their views), which in a decode step of a small model cost more than they compute.
//
// The rotary form is the half-split one (rotate_half) over the whole head; cos and sin are the
// per-token tables the model builds once per forward ([tokens, 1, d]). The roundings are the
// torch ops' (layers/rotary.py apply_rotary): each product of x * cos + rotate_half(x) * sin
// rounded to the dtype, then their sum rounded (no fused multiply-add), so the result is
// bitwise theirs. float32 and bfloat16; q, k, v as the QKV projection's views ([tokens, heads,
// d], any row and head strides, channels contiguous); the pool [kv_heads, slots, d].
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "kernels.h"

namespace {

template <typename T>
inline float wide(T v) {
  return static_cast<float>(v);
}

// One head row rotated: out[j] = x[j] cos[j] + rotate_half(x)[j] sin[j], rounded as the ops.
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, int64_t d, T* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < d; ++j) {
    const float partner = j < half ? -wide(x[j + half]) : wide(x[j - half]);
    // each product rounded before the sum: volatile keeps -ffast-math from fusing them
    volatile float a = wide(static_cast<T>(wide(x[j]) * wide(cos[j])));
    volatile float b = wide(static_cast<T>(partner * wide(sin[j])));
    out[j] = static_cast<T>(a + b);
  }
}

struct Strides {
  int64_t token, head;
};

inline Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1)}; }

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots,
         at::Tensor& q_out) {
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), d = q.size(2);
  const Strides sq = strides_of(q), sk = strides_of(k), sv = strides_of(v);
  const Strides kc = {k_cache.stride(0), k_cache.stride(1)}, vc = {v_cache.stride(0), v_cache.stride(1)};
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
  const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
  T *kcp = k_cache.data_ptr<T>(), *vcp = v_cache.data_ptr<T>(), *op = q_out.data_ptr<T>();
  const int64_t cos_t = cos.stride(0), sin_t = sin.stride(0);
  at::parallel_for(0, tokens, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T *c = cp + t * cos_t, *s = sp + t * sin_t;
      for (int64_t h = 0; h < heads; ++h) {
        rotate(qp + t * sq.token + h * sq.head, c, s, d, op + (t * heads + h) * d);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(kp + t * sk.token + h * sk.head, c, s, d, kcp + h * kc.token + slots[t] * kc.head);
        const T* vr = vp + t * sv.token + h * sv.head;
        T* dst = vcp + h * vc.token + slots[t] * vc.head;
        for (int64_t j = 0; j < d; ++j) dst[j] = vr[j];
      }
    }
  });
}

}  // namespace

at::Tensor rope_store(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                      at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rope_store takes float32 or bfloat16");
  for (const at::Tensor* t : {&k, &v, &cos, &sin, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == dtype, "q, k, v, cos, sin and the pool: one dtype");
  }
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v: [tokens, heads, d]");
  const int64_t tokens = q.size(0), d = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(d % 2 == 0, "an even head dim");
  TORCH_CHECK(k.size(0) == tokens && v.size(0) == tokens && k.size(2) == d && v.size(2) == d &&
                  v.size(1) == kv_heads,
              "k and v: [tokens, kv_heads, d] with q's tokens and d");
  for (const at::Tensor* t : {&q, &k, &v}) TORCH_CHECK(t->stride(2) == 1, "channels contiguous");
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == tokens && cos.size(1) == 1 && cos.size(2) == d &&
                  cos.stride(2) == 1 && sin.sizes() == cos.sizes() && sin.stride(2) == 1,
              "cos and sin: [tokens, 1, d] (rotary over the whole head)");
  for (const at::Tensor* t : {&k_cache, &v_cache}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == kv_heads && t->size(2) == d && t->stride(2) == 1,
                "the pool: [kv_heads, slots, d]");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == tokens && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "slots: [tokens] int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sl[t] >= 0 && sl[t] < k_cache.size(1) && sl[t] < v_cache.size(1),
                "a slot outside the pool");
  }
  at::Tensor out = at::empty({tokens, q.size(1), d}, q.options());
  if (dtype == at::kFloat) {
    run<float>(q, k, v, cos, sin, k_cache, v_cache, sl, out);
  } else {
    run<c10::BFloat16>(q, k, v, cos, sin, k_cache, v_cache, sl, out);
  }
  return out;
}
