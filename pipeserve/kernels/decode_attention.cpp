// Paged decode attention for CPUs: one query token per request, keys and values read in
// place from the KV pool along the request's runs of slots, softmax accumulated online in
// float32 (e^x by vec8::exp8), one pass over the cache. Parallel over (request, KV head). A
// KV head's G query heads share each key and value row, widened to float32 once per block of
// 32 (`decode_one`). SmolLM2's heads (3 KV heads of 3 queries, 64 wide), bfloat16, one
// thread, Zen 4: 16.5 us a layer at 192 keys and 137-160 at 2048, where a row at a time per
// head (a horizontal sum per score) took 27.5 and 276.
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
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "vec8.h"

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

using vec8::kLanes;
using vec8::v8;

// Copies rows [pos, pos + n) of a request's sequence (along its runs) to dst as float32, each
// row `stride` floats apart (its tail past D left as it is); `cursor` (run index, offset in
// it) advances with pos, so a sweep costs one pass.
template <typename T>
void gather_rows(const T* head, const int64_t* runs, int64_t& run, int64_t& offset, int64_t n,
                 int64_t D, int64_t stride, float* dst) {
  while (n > 0) {
    const int64_t first = runs[2 * run], count = runs[2 * run + 1];
    const int64_t take = std::min<int64_t>(n, count - offset);
    const T* src = head + (first + offset) * D;
    for (int64_t j = 0; j < take; ++j) to_float(src + j * D, dst + j * stride, D);
    dst += take * stride;
    n -= take;
    offset += take;
    if (offset == count) ++run, offset = 0;
  }
}

// NaN by its bits: the build's -ffast-math lets the compiler turn comparisons into max/min
// instructions that drop a NaN
inline bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

// The horizontal sums of eight vectors, as one vector: lane i = the sum of a[i]'s lanes
// (pairs of lanes added within each half, then the halves), ~20 shuffles and adds where
// eight separate sums take ~50.
inline v8 sums8(const v8* a) {
  auto pairs = [](v8 x, v8 y) {
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const v8 t0 = pairs(pairs(a[0], a[1]), pairs(a[2], a[3]));
  const v8 t1 = pairs(pairs(a[4], a[5]), pairs(a[6], a[7]));
  return __builtin_shufflevector(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// One request's G query heads of one KV head over its sequence, in blocks of kBlock keys.
// Rows are float32 in buffers `dp` floats long (D rounded up to the lanes, zero past D), so a
// row is whole vectors. Per block: the scores of each head (a row's eight-lane partial sums
// for eight keys at a time, then `sums8`), the online-softmax step (vec8::exp8), and the
// values accumulated per head in registers over the block's keys, 64 channels at a time.
constexpr int64_t kChains = 8;  // value accumulators a head keeps in registers (FMA latency x 2)

// One task's buffers, reused for each (request, KV head) it takes.
struct Work {
  int64_t dp;                               // D rounded up to the lanes
  std::vector<float> q, acc, rows, scores;  // [G, dp], [G, dp], [kBlock, dp], [G, kBlock]
  std::vector<float> m, l;                  // [G]: the online softmax's maximum and sum
  std::vector<uint8_t> nan;                 // [G]: a NaN score seen
  Work(int64_t G, int64_t D)
      : dp((D + kLanes - 1) / kLanes * kLanes),
        q(G * dp, 0.f),
        acc(G * dp),
        rows(kBlock * dp, 0.f),
        scores(G * kBlock),
        m(G),
        l(G),
        nan(G) {}
};

// Keys are scored in blocks of kBlock sequence positions counted from position 0, whatever
// the runs: the sums and the online-softmax steps of a request are the same however its KV
// is laid out in the pool (batch and allocation invariant; a block may span two runs).
template <typename T>
void decode_one(const T* q, const T* k_head, const T* v_head, const int64_t* runs,
                int64_t run_begin, int64_t run_end, int64_t G, int64_t D, float scale, T* out,
                Work& w) {
  const int64_t dp = w.dp, chunks = dp / kLanes;
  float* qf = w.q.data();
  float* acc = w.acc.data();
  float* rows = w.rows.data();
  float* scores = w.scores.data();
  for (int64_t g = 0; g < G; ++g) {
    to_float(q + g * D, qf + g * dp, D);
    for (int64_t d = 0; d < D; ++d) qf[g * dp + d] *= scale;
  }
  std::fill(acc, acc + G * dp, 0.f);
  std::vector<float>& m = w.m;
  std::vector<float>& l = w.l;
  std::vector<uint8_t>& nan = w.nan;
  std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
  std::fill(l.begin(), l.end(), 0.f);
  std::fill(nan.begin(), nan.end(), 0);
  int64_t total = 0;
  for (int64_t r = run_begin; r < run_end; ++r) total += runs[2 * r + 1];
  int64_t k_run = run_begin, k_off = 0, v_run = run_begin, v_off = 0;
  for (int64_t s0 = 0; s0 < total; s0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, total - s0);
    const int64_t n8 = (n + kLanes - 1) / kLanes * kLanes;
    gather_rows(k_head, runs, k_run, k_off, n, D, dp, rows);
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * dp;
      float* sg = scores + g * kBlock;
      for (int64_t j0 = 0; j0 < n8; j0 += kLanes) {
        const float* kj[kLanes];  // past n: the last row again, its score unused
        for (int64_t jj = 0; jj < kLanes; ++jj) kj[jj] = rows + std::min(j0 + jj, n - 1) * dp;
        v8 part[kLanes] = {};  // eight keys' partial sums, in registers over the channels
        for (int64_t c = 0; c < dp; c += kLanes) {
          const v8 qc = vec8::load8(qg + c);
          for (int64_t jj = 0; jj < kLanes; ++jj) part[jj] += qc * vec8::load8(kj[jj] + c);
        }
        vec8::store8(sg + j0, sums8(part));
      }
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        block_max = std::max(block_max, sg[j]);
        nan[g] |= is_nan(sg[j]);  // a NaN in q or the keys: this head's output NaN
      }
      const float new_m = std::max(m[g], block_max);
      const float rescale = std::exp(m[g] - new_m);
      if (rescale != 1.f) {
        for (int64_t d = 0; d < dp; ++d) acc[g * dp + d] *= rescale;
      }
      float sum = 0.f;
      for (int64_t j0 = 0; j0 < n8; j0 += kLanes) {
        v8 e = vec8::exp8(vec8::load8(sg + j0) - vec8::splat(new_m));
        for (int64_t jj = 0; jj < kLanes; ++jj) {
          if (j0 + jj >= n) e[jj] = 0.f;
        }
        vec8::store8(sg + j0, e);
        sum += vec8::lanes_sum(e);
      }
      l[g] = l[g] * rescale + sum;
      m[g] = new_m;
    }
    gather_rows(v_head, runs, v_run, v_off, n, D, dp, rows);  // the buffer now holds values
    for (int64_t g = 0; g < G; ++g) {
      const float* sg = scores + g * kBlock;
      float* ag = acc + g * dp;
      int64_t c = 0;
      for (; c + kChains <= chunks; c += kChains) {  // 64 channels in registers over the keys
        v8 a[kChains];
        for (int64_t u = 0; u < kChains; ++u) a[u] = vec8::load8(ag + (c + u) * kLanes);
        for (int64_t j = 0; j < n; ++j) {
          const v8 p = vec8::splat(sg[j]);
          const float* vj = rows + j * dp + c * kLanes;
          for (int64_t u = 0; u < kChains; ++u) a[u] += p * vec8::load8(vj + u * kLanes);
        }
        for (int64_t u = 0; u < kChains; ++u) vec8::store8(ag + (c + u) * kLanes, a[u]);
      }
      for (; c < chunks; ++c) {
        v8 a = vec8::load8(ag + c * kLanes);
        for (int64_t j = 0; j < n; ++j) {
          a += vec8::splat(sg[j]) * vec8::load8(rows + j * dp + c * kLanes);
        }
        vec8::store8(ag + c * kLanes, a);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = nan[g] ? std::numeric_limits<float>::quiet_NaN()
                      : l[g] > 0.f ? 1.f / l[g]
                                   : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = static_cast<T>(acc[g * dp + d] * inv);
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
      Work work(G, D);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / Hk, h = i % Hk;
        decode_one<scalar_t>(qp + i * G * D, kp + h * N * D, vp + h * N * D, run_ptr, off[b],
                             off[b + 1], G, D, static_cast<float>(scale), op + i * G * D, work);
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
