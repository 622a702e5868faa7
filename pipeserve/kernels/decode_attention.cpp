// Paged decode attention for CPUs: one query token per request, keys and values read in
// place from the KV pool along the request's runs of slots, softmax accumulated online in
// float32, one pass over the cache. Parallel over (request, KV head).
//
// q        [B, Hk, G, D]  (G query heads share a KV head)
// k_cache  [Hk, N, D]     v_cache the same
// runs     [R, 2] int64   (first slot, length); request b owns runs[offsets[b]:offsets[b+1]]
// out      [B, Hk, G, D]  same dtype as q
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/zeros.h>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int kBlock = 32;  // keys scored together before their values are accumulated

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 is the top half of a float32: widening is a shift, which vectorises.
template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// Copies rows [pos, pos + n) of a request's sequence (along its runs) to dst as float32;
// `cursor` (run index, offset in it) advances with pos, so a sweep costs one pass.
template <typename T>
void gather_rows(const T* head, const int64_t* runs, int64_t& run, int64_t& offset, int64_t n,
                 int64_t D, float* dst) {
  while (n > 0) {
    const int64_t first = runs[2 * run], count = runs[2 * run + 1];
    const int64_t take = std::min<int64_t>(n, count - offset);
    to_float(head + (first + offset) * D, dst, take * D);
    dst += take * D;
    n -= take;
    offset += take;
    if (offset == count) ++run, offset = 0;
  }
}

// Keys are scored in blocks of kBlock sequence positions counted from position 0, whatever
// the runs: the sums and the online-softmax steps of a request are the same however its KV
// is laid out in the pool (batch and allocation invariant; a block may span two runs).
template <typename T>
void decode_one(const T* q, const T* k_head, const T* v_head, const int64_t* runs,
                int64_t run_begin, int64_t run_end, int64_t G, int64_t D, float scale, T* out) {
  std::vector<float> qf(G * D), acc(G * D, 0.f), kbuf(kBlock * D), scores(G * kBlock);
  std::vector<float> m(G, -std::numeric_limits<float>::infinity()), l(G, 0.f);
  to_float(q, qf.data(), G * D);
  for (int64_t i = 0; i < G * D; ++i) qf[i] *= scale;
  int64_t total = 0;
  for (int64_t r = run_begin; r < run_end; ++r) total += runs[2 * r + 1];
  int64_t k_run = run_begin, k_off = 0, v_run = run_begin, v_off = 0;
  for (int64_t s0 = 0; s0 < total; s0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, total - s0);
    gather_rows(k_head, runs, k_run, k_off, n, D, kbuf.data());
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = &qf[g * D];
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = &kbuf[j * D];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * kj[d];
        scores[g * kBlock + j] = dot;
        block_max = std::max(block_max, dot);
      }
      const float new_m = std::max(m[g], block_max);
      const float rescale = std::exp(m[g] - new_m);
      float* ag = &acc[g * D];
      if (rescale != 1.f) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] *= rescale;
      }
      l[g] *= rescale;
      m[g] = new_m;
      float* sg = &scores[g * kBlock];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        sg[j] = std::exp(sg[j] - new_m);
        sum += sg[j];
      }
      l[g] += sum;
    }
    gather_rows(v_head, runs, v_run, v_off, n, D, kbuf.data());  // the buffer now holds values
    for (int64_t j = 0; j < n; ++j) {
      const float* vj = &kbuf[j * D];
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * kBlock + j];
        float* ag = &acc[g * D];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * vj[d];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * D + d] * inv);
  }
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor runs, at::Tensor offsets, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 3, "q [B,Hk,G,D], k_cache [Hk,N,D] expected");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(runs.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong,
              "runs and offsets must be int64");
  q = q.contiguous();
  runs = runs.contiguous();
  offsets = offsets.contiguous();
  const int64_t B = q.size(0), Hk = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t N = k_cache.size(1);
  TORCH_CHECK(k_cache.size(0) == Hk && k_cache.size(2) == D, "q and k_cache disagree on heads/dim");
  auto out = at::empty_like(q);
  const int64_t* run_ptr = runs.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * Hk, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / Hk, h = i % Hk;
        decode_one<scalar_t>(qp + i * G * D, kp + h * N * D, vp + h * N * D, run_ptr, off[b],
                             off[b + 1], G, D, static_cast<float>(scale), op + i * G * D);
      }
    });
  });
  return out;
}

// The same computation with the two products done by the BLAS library per run and head
// (memory-bound at long contexts): scores = q K^T per run, one softmax over all runs of the
// request, out = sum over runs of P V.
at::Tensor paged_decode_attention_gemm(at::Tensor q, at::Tensor k_cache,
                                          at::Tensor v_cache, at::Tensor runs,
                                          at::Tensor offsets, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 3, "q [B,Hk,G,D], k_cache [Hk,N,D] expected");
  const int64_t B = q.size(0), Hk = q.size(1);
  auto qs = q.mul(scale).contiguous();
  auto out = at::empty_like(q);
  auto runs_cpu = runs.contiguous();
  const int64_t* rp = runs_cpu.data_ptr<int64_t>();
  const int64_t* off = offsets.contiguous().data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < Hk; ++h) {
      auto qbh = qs[b][h];  // [G, D]
      auto kh = k_cache[h], vh = v_cache[h];
      std::vector<at::Tensor> parts;
      for (int64_t r = off[b]; r < off[b + 1]; ++r) {
        parts.push_back(at::mm(qbh, kh.narrow(0, rp[2 * r], rp[2 * r + 1]).t()));
      }
      auto scores = parts.size() == 1 ? parts[0] : at::cat(parts, 1);
      auto probs = at::softmax(scores, -1, at::kFloat).to(q.scalar_type());
      auto acc = at::zeros({q.size(2), q.size(3)}, q.options().dtype(at::kFloat));
      int64_t pos = 0;
      for (int64_t r = off[b]; r < off[b + 1]; ++r) {
        const int64_t len = rp[2 * r + 1];
        acc.add_(at::mm(probs.narrow(1, pos, len), vh.narrow(0, rp[2 * r], len)));
        pos += len;
      }
      out[b][h].copy_(acc);
    }
  }
  return out;
}
