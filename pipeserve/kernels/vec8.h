// Eight float lanes in GCC's vector extension, what the DeepSeek-V3.2 kernels share (the
// indexer's scores, the sparse attention in latent and in expanded form): loads of float32
// and of bfloat16 (widened), stores, broadcast, a horizontal sum, e^x for x <= 0 and a
// prefetch of a span. Compiled for the machine: AVX2 registers, or the low half of AVX512's.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "prefill_common.h"

namespace vec8 {

constexpr int64_t kLanes = 8;

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

inline v8 load8(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}

inline v8 load8(const c10::BFloat16* p) {  // bfloat16 is a float32's top half
  v8h bits;
  std::memcpy(&bits, p, sizeof(bits));
  const v8i wide = __builtin_convertvector(bits, v8i) << 16;
  v8 r;
  std::memcpy(&r, &wide, sizeof(r));
  return r;
}

inline v8 load8(const c10::Half* p) {  // lane by lane (skinny_linear.cpp has F16C's form)
  v8 r;
  for (int64_t l = 0; l < kLanes; ++l) r[l] = static_cast<float>(p[l]);
  return r;
}

inline void store8(float* p, v8 x) { std::memcpy(p, &x, sizeof(x)); }

// One value as float32, whatever its storage.
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

// The lanes' sum as one fixed tree (halves, then pairs), written as vector adds: a scalar
// loop left to -ffast-math was summed in different orders where the function was inlined
// into different tiles (seen in the portable build), so a row's result depended on its
// neighbours.
inline float lanes_sum(v8 a) {
  typedef float v4 __attribute__((vector_size(16)));
  v4 lo, hi;
  std::memcpy(&lo, &a, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&a) + sizeof(lo), sizeof(hi));
  const v4 q = lo + hi;
  const v4 pair = q + __builtin_shufflevector(q, q, 2, 3, 0, 1);
  return pair[0] + pair[1];
}

// e^x for x <= 0 (a score minus its maximum), as 2^n * 2^f with f in [-0.5, 0.5] and 2^f the
// prefill kernels' polynomial (relative error ~2e-7); below 2^-126 it stays near 2^-126,
// which no sum holding an e^0 notices. V: a vector of floats in GCC's extension (eight lanes
// here, sixteen in the AVX512 forms), VI its lanes as int32.
template <typename V, typename VI>
inline V exp_lanes(V x) {
  V t = x * prefill::kLog2e;
  t = t > -126.f ? t : V{} - 126.f;
  const VI n = __builtin_convertvector(t - 0.5f, VI);  // t <= 0: round half down
  const V f = t - __builtin_convertvector(n, V);
  V p = V{} + prefill::kExp2Poly[0];
  for (int i = 1; i < 6; ++i) p = p * f + prefill::kExp2Poly[i];
  const VI bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline v8 exp8(v8 x) { return exp_lanes<v8, v8i>(x); }

inline void prefetch_span(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off);
}

}  // namespace vec8
