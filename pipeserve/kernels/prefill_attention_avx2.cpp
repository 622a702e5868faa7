// Paged prefill attention for x86 CPUs with AVX2 and FMA (every x86 server since 2013; the
// only native path on those without AVX512-BF16, e.g. AMD Zen 2/3): causal attention of a
// prompt chunk over its request's KV, read along the request's runs of slots, computed in
// float32 for float32 or bfloat16 storage. The same tiling as the AVX512-BF16 kernel: per
// block of keys, the scores of a strip of query rows are computed, softmaxed online and
// multiplied into the output at once, so the working set (a strip's scores and queries, a
// block of keys and values) stays in the core's L1/L2 cache.
//
// Layout of the work, chosen for 16 ymm registers:
// - a strip is kStrip = 24 query rows, held transposed (qs[d][r], pre-scaled to base 2), so
//   one score vector is one key against 8 rows: acc[key][row/8] += bcast(k[d]) * qs[d][8 rows]
//   (4 keys x 3 row vectors = 12 accumulators). Keys are read in place from the pool
//   (float32) or from a block widened once (bfloat16), never transposed;
// - the online softmax runs on whole vectors: per row its max and sum are a lane of 3
//   vectors, and masked keys are blended to -inf by comparing positions;
// - out[r][e] += p[r][j] * v[j][e] for 6 rows x 16 dims at a time (12 accumulators), slab
//   by slab of 16 dims, so a slab of the block's values stays in L1 for all the strip's rows.
// Measured on an AMD Zen 3 core, one thread, the bench model's 12 query and 4 KV heads of 64
// (2048 queries after 0 or 6144 keys, 8192 after 0): 58-71 GFLOP/s, where PyTorch's fused
// CPU kernel reaches 39-49 on the same inputs and the core's FMA peak is ~97.
//
// Every query row is computed alone and in a fixed order: keys in blocks of kKeyBlock counted
// from position 0, each block's keys in order, dims in order. A row's result therefore does
// not depend on the chunking, the pool layout, the other rows or the thread count (batch
// invariant, as deterministic inference needs).
//
// q        [n, H, D]    the chunk's queries (H = Hk * G: G query heads share a KV head)
// k_cache  [Hk, N, D]   v_cache the same; the chunk's own keys are already written
// runs     [R, 2] int64 (first slot, length): positions 0 .. prefix + n - 1 of the request
// out      [n, H, D]    q's dtype
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "prefill_common.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PIPESERVE_PREFILL_AVX2 1
#endif

bool prefill_attention_avx2_supported() {
#ifdef PIPESERVE_PREFILL_AVX2
  return true;
#else
  return false;
#endif
}

#ifdef PIPESERVE_PREFILL_AVX2
namespace {

constexpr int kStrip = 24;          // query rows per strip: 3 vectors of 8
constexpr int kKeys = 4;            // keys per score micro-tile
constexpr int kRowsPV = 6;          // rows per output micro-tile
constexpr int kKeyBlock = 128;      // keys per block: a strip's scores take 12 KB of L1

// 2^x for x <= 0, exactly 0 below 2^-126 and for -inf or NaN (masked keys): exponent by
// integer add, fraction by a degree-5 polynomial (relative error ~2e-7).
inline __m256 exp2_ps(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-126.f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);  // [-0.5, 0.5]
  __m256 p = _mm256_set1_ps(prefill::kExp2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(prefill::kExp2Poly[i]));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);  // 2^n, n >= -126
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), live);
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline void store_as(float x, float* out) { *out = x; }
inline void store_as(float x, at::BFloat16* out) { *out = at::BFloat16(x); }  // nearest even

// Rows of a bfloat16 block widened to float32 (a shift each: bf16 is a float32's top half).
void widen_rows(const at::BFloat16* const* rows, int count, int D, float* out,
                const float** row_ptrs) {
  for (int j = 0; j < count; ++j) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(rows[j]);
    float* dst = out + static_cast<int64_t>(j) * D;
    for (int e = 0; e < D; e += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e)));
      _mm256_storeu_ps(dst + e, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    row_ptrs[j] = dst;
  }
}

// The micro-tiles below name each accumulator: GCC keeps an array of __m256 accumulators
// in memory, storing it back on every iteration (measured: half the kernel's time).
#define PS_FMA(acc, a, b) acc = _mm256_fmadd_ps(a, b, acc)

// scores[j][r] = q_r . k_j for the strip's 24 rows and keys k[0..3] (base-2 units): 12
// accumulators, the 3 query vectors and a broadcast key value fill the 16 registers. The
// empty asm pins the queries in registers: GCC otherwise re-reads them from memory in every
// product (12 vector loads per 12 products: load-bound, measured 30% slower).
inline void score_tile(const float* qs, const float* const* k, int D, float* scores) {
  const float *k0 = k[0], *k1 = k[1], *k2 = k[2], *k3 = k[3];
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
  __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
  for (int d = 0; d < D; ++d, qs += kStrip) {
    __m256 q0 = _mm256_loadu_ps(qs), q1 = _mm256_loadu_ps(qs + 8), q2 = _mm256_loadu_ps(qs + 16);
    asm("" : "+x"(q0), "+x"(q1), "+x"(q2));
    __m256 b = _mm256_broadcast_ss(k0 + d);
    PS_FMA(a00, b, q0), PS_FMA(a01, b, q1), PS_FMA(a02, b, q2);
    b = _mm256_broadcast_ss(k1 + d);
    PS_FMA(a10, b, q0), PS_FMA(a11, b, q1), PS_FMA(a12, b, q2);
    b = _mm256_broadcast_ss(k2 + d);
    PS_FMA(a20, b, q0), PS_FMA(a21, b, q1), PS_FMA(a22, b, q2);
    b = _mm256_broadcast_ss(k3 + d);
    PS_FMA(a30, b, q0), PS_FMA(a31, b, q1), PS_FMA(a32, b, q2);
  }
  const __m256 acc[12] = {a00, a01, a02, a10, a11, a12, a20, a21, a22, a30, a31, a32};
  for (int i = 0; i < 12; ++i) _mm256_storeu_ps(scores + (i / 3) * kStrip + 8 * (i % 3), acc[i]);
}

// acc[r][e0 .. e0 + 16) = alpha_r acc[r][..] + sum_j p[j][r] v_j[..] for 6 rows.
inline void value_tile16(const float* probs, int keys, const float* const* v, int e0,
                         const float* alpha, float* acc, int D) {
  auto scaled = [&](int r, int i) {
    return _mm256_mul_ps(_mm256_set1_ps(alpha[r]), _mm256_loadu_ps(acc + r * D + e0 + 8 * i));
  };
  __m256 a00 = scaled(0, 0), a01 = scaled(0, 1), a10 = scaled(1, 0), a11 = scaled(1, 1);
  __m256 a20 = scaled(2, 0), a21 = scaled(2, 1), a30 = scaled(3, 0), a31 = scaled(3, 1);
  __m256 a40 = scaled(4, 0), a41 = scaled(4, 1), a50 = scaled(5, 0), a51 = scaled(5, 1);
  for (int j = 0; j < keys; ++j, probs += kStrip) {
    const __m256 v0 = _mm256_loadu_ps(v[j] + e0), v1 = _mm256_loadu_ps(v[j] + e0 + 8);
    __m256 p = _mm256_broadcast_ss(probs);
    PS_FMA(a00, p, v0), PS_FMA(a01, p, v1);
    p = _mm256_broadcast_ss(probs + 1);
    PS_FMA(a10, p, v0), PS_FMA(a11, p, v1);
    p = _mm256_broadcast_ss(probs + 2);
    PS_FMA(a20, p, v0), PS_FMA(a21, p, v1);
    p = _mm256_broadcast_ss(probs + 3);
    PS_FMA(a30, p, v0), PS_FMA(a31, p, v1);
    p = _mm256_broadcast_ss(probs + 4);
    PS_FMA(a40, p, v0), PS_FMA(a41, p, v1);
    p = _mm256_broadcast_ss(probs + 5);
    PS_FMA(a50, p, v0), PS_FMA(a51, p, v1);
  }
  const __m256 out[12] = {a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51};
  for (int i = 0; i < 12; ++i) _mm256_storeu_ps(acc + (i / 2) * D + e0 + 8 * (i % 2), out[i]);
}

// The same for the last 8 dims when D is not a multiple of 16.
inline void value_tile8(const float* probs, int keys, const float* const* v, int e0,
                        const float* alpha, float* acc, int D) {
  auto scaled = [&](int r) {
    return _mm256_mul_ps(_mm256_set1_ps(alpha[r]), _mm256_loadu_ps(acc + r * D + e0));
  };
  __m256 a0 = scaled(0), a1 = scaled(1), a2 = scaled(2), a3 = scaled(3), a4 = scaled(4);
  __m256 a5 = scaled(5);
  for (int j = 0; j < keys; ++j, probs += kStrip) {
    const __m256 v0 = _mm256_loadu_ps(v[j] + e0);
    PS_FMA(a0, _mm256_broadcast_ss(probs), v0), PS_FMA(a1, _mm256_broadcast_ss(probs + 1), v0);
    PS_FMA(a2, _mm256_broadcast_ss(probs + 2), v0), PS_FMA(a3, _mm256_broadcast_ss(probs + 3), v0);
    PS_FMA(a4, _mm256_broadcast_ss(probs + 4), v0), PS_FMA(a5, _mm256_broadcast_ss(probs + 5), v0);
  }
  const __m256 out[6] = {a0, a1, a2, a3, a4, a5};
  for (int r = 0; r < 6; ++r) _mm256_storeu_ps(acc + r * D + e0, out[r]);
}

struct Problem : prefill::Shape {
  int64_t prefix = 0;
  float c = 0;                 // softmax scale in base 2: scale * log2(e)
  std::vector<int64_t> slots;  // slot of each key position 0 .. total - 1
};

// One task's state: its rows in strips (queries transposed, output accumulators, running
// max and sum per row), and one block's scores, key/value row pointers and widened rows.
struct Scratch {
  std::vector<float> qs, acc, m, l, scores, alpha, zeros, kbuf, vbuf;
  std::vector<int32_t> limit;
  std::vector<const float*> keys, values;

  Scratch(const Problem& p, int64_t rows)
      : qs(rows * p.D),
        acc(rows * p.D),
        m(rows),
        l(rows),
        scores(static_cast<int64_t>(kKeyBlock + kKeys) * kStrip),
        alpha(kStrip),
        zeros(p.D, 0.f),
        kbuf(static_cast<int64_t>(kKeyBlock) * p.D),
        vbuf(static_cast<int64_t>(kKeyBlock) * p.D),
        limit(rows),
        keys(kKeyBlock + kKeys),
        values(kKeyBlock) {}
};

// Online softmax of one strip against one block: masks keys past each row's limit (and the
// padding past `keys`), updates the running max and sum, leaves probabilities in `scores`
// and each row's rescale factor in `alpha`.
void softmax_strip(float* scores, int keys, int padded, int64_t k0, const int32_t* limit,
                   float* m, float* l, float* alpha) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i lim[3];
  int32_t lowest = limit[0];
  for (int v = 0; v < 3; ++v) {
    lim[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(limit + 8 * v));
    for (int i = 0; i < 8; ++i) lowest = std::min(lowest, limit[8 * v + i]);
  }
  const int visible_all = static_cast<int>(std::clamp<int64_t>(lowest - k0 + 1, 0, keys));
  for (int j = visible_all; j < padded; ++j) {
    const __m256i pos = _mm256_set1_epi32(j < keys ? static_cast<int32_t>(k0 + j)
                                                   : std::numeric_limits<int32_t>::max());
    for (int v = 0; v < 3; ++v) {
      const __m256 hidden = _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos, lim[v]));
      float* s = scores + j * kStrip + 8 * v;
      _mm256_storeu_ps(s, _mm256_blendv_ps(_mm256_loadu_ps(s), neg_inf, hidden));
    }
  }
  for (int v = 0; v < 3; ++v) {
    __m256 block_max = neg_inf;
    for (int j = 0; j < padded; ++j)
      block_max = _mm256_max_ps(block_max, _mm256_loadu_ps(scores + j * kStrip + 8 * v));
    const __m256 m_old = _mm256_loadu_ps(m + 8 * v);
    const __m256 m_new = _mm256_max_ps(m_old, block_max);
    // a row whose max did not move keeps its sums exactly (alpha 1, not exp2(0) rounded)
    const __m256 same = _mm256_cmp_ps(m_old, m_new, _CMP_EQ_OQ);
    const __m256 a = _mm256_blendv_ps(exp2_ps(_mm256_sub_ps(m_old, m_new)), _mm256_set1_ps(1.f), same);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < padded; ++j) {
      float* s = scores + j * kStrip + 8 * v;
      const __m256 pr = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s), m_new));
      _mm256_storeu_ps(s, pr);
      sum = _mm256_add_ps(sum, pr);
    }
    _mm256_storeu_ps(m + 8 * v, m_new);
    _mm256_storeu_ps(l + 8 * v, _mm256_fmadd_ps(_mm256_loadu_ps(l + 8 * v), a, sum));
    _mm256_storeu_ps(alpha + 8 * v, a);
  }
}

void strip_block(const Problem& p, Scratch& s, int64_t row0, int keys, int64_t k0) {
  const int D = static_cast<int>(p.D);
  const int padded = (keys + kKeys - 1) / kKeys * kKeys;
  const float* qs = s.qs.data() + row0 * p.D;  // [D][24] for this strip
  for (int j = keys; j < padded; ++j) s.keys[j] = s.zeros.data();
  for (int j = 0; j < padded; j += kKeys)
    score_tile(qs, s.keys.data() + j, D, s.scores.data() + j * kStrip);
  softmax_strip(s.scores.data(), keys, padded, k0, s.limit.data() + row0, s.m.data() + row0,
                s.l.data() + row0, s.alpha.data());
  // a slab of the block's values (16 dims of every key) serves all the strip's rows while
  // it is in L1
  for (int e0 = 0; e0 < D; e0 += 16) {
    for (int r = 0; r < kStrip; r += kRowsPV) {
      float* acc = s.acc.data() + (row0 + r) * p.D;
      const float* probs = s.scores.data() + r;
      if (e0 + 16 <= D)
        value_tile16(probs, keys, s.values.data(), e0, s.alpha.data() + r, acc, D);
      else
        value_tile8(probs, keys, s.values.data(), e0, s.alpha.data() + r, acc, D);
    }
  }
}

// Rows of a task, strip by strip: row r is (query t0 + r / G, head head * G + r % G); rows past
// the task's (to fill the last strip) repeat its last row and are never written out.
template <typename T>
void load_queries(const Problem& p, const T* q, Scratch& s, int64_t head, int64_t t0,
                  int64_t rows, int64_t padded_rows) {
  for (int64_t r = 0; r < padded_rows; ++r) {
    const int64_t real = std::min(r, rows - 1);
    const int64_t t = t0 + real / p.G, h = head * p.G + real % p.G;
    const T* src = q + (t * p.H + h) * p.D;
    float* strip = s.qs.data() + (r / kStrip) * kStrip * p.D;
    for (int64_t d = 0; d < p.D; ++d) strip[d * kStrip + r % kStrip] = to_float(src[d]) * p.c;
    s.limit[r] = static_cast<int32_t>(p.prefix + t);  // causal: the last key this row sees
  }
}

// The block's rows of one head of the pool: float32 rows in place, bfloat16 rows widened
// into `buf`.
template <typename T>
void point_rows(const Problem& p, const T* cache, int64_t head, int64_t k0, int keys,
                const float** ptrs, float* buf) {
  const T* base = cache + head * p.N * p.D;
  if constexpr (std::is_same_v<T, float>) {
    (void)buf;
    for (int j = 0; j < keys; ++j) ptrs[j] = base + p.slots[k0 + j] * p.D;
  } else {
    for (int j = 0; j < keys; ++j) {
      const at::BFloat16* row = base + p.slots[k0 + j] * p.D;
      widen_rows(&row, 1, static_cast<int>(p.D), buf + static_cast<int64_t>(j) * p.D, ptrs + j);
    }
  }
}

template <typename T>
void run_task(const Problem& p, const T* q, const T* k_cache, const T* v_cache, T* out,
              Scratch& s, int64_t head, int64_t t0, int64_t t1) {
  const int64_t rows = (t1 - t0) * p.G, D = p.D;
  const int64_t padded_rows = (rows + kStrip - 1) / kStrip * kStrip;
  load_queries(p, q, s, head, t0, rows, padded_rows);
  std::fill(s.acc.begin(), s.acc.begin() + padded_rows * D, 0.f);
  std::fill(s.m.begin(), s.m.begin() + padded_rows, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + padded_rows, 0.f);
  const int64_t key_end = p.prefix + t1;  // no row of this task sees a key at or past it
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
    const int keys = static_cast<int>(std::min<int64_t>(kKeyBlock, key_end - k0));
    point_rows(p, k_cache, head, k0, keys, s.keys.data(), s.kbuf.data());
    point_rows(p, v_cache, head, k0, keys, s.values.data(), s.vbuf.data());
    for (int64_t row0 = 0; row0 < padded_rows; row0 += kStrip) {
      if (s.limit[std::min(row0 + kStrip, rows) - 1] < k0) continue;  // all in their future
      strip_block(p, s, row0, keys, k0);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / p.G, h = head * p.G + r % p.G;
    const float inv = 1.f / s.l[r];
    const float* a = s.acc.data() + r * D;
    T* o = out + (t * p.H + h) * D;
    for (int64_t e = 0; e < D; ++e) store_as(a[e] * inv, o + e);
  }
}

template <typename T>
void run_all(const Problem& p, const T* q, const T* k, const T* v, T* out) {
  const int64_t per = prefill::queries_per_task(p.n, p.Hk, p.G, at::get_num_threads(), kStrip);
  const int64_t rows = (per * p.G + kStrip - 1) / kStrip * kStrip;
  prefill::run_tasks(
      p.n, p.Hk, per, [&] { return Scratch(p, rows); },
      [&](Scratch& s, int64_t head, int64_t t0, int64_t t1) {
        run_task(p, q, k, v, out, s, head, t0, t1);
      });
}

}  // namespace
#endif

at::Tensor paged_prefill_attention_avx2(at::Tensor q, at::Tensor k_cache,
                                           at::Tensor v_cache, at::Tensor runs,
                                           int64_t prefix, double scale) {
#ifdef PIPESERVE_PREFILL_AVX2
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "the AVX2 prefill kernel takes float32 or bfloat16");
  q = q.contiguous();
  Problem p;
  static_cast<prefill::Shape&>(p) = prefill::check_inputs(q, k_cache, v_cache, runs, prefix, 8, p.slots);
  TORCH_CHECK(prefix + p.n < std::numeric_limits<int32_t>::max(), "sequence too long");
  p.prefix = prefix;
  auto out = at::empty_like(q);
  p.c = static_cast<float>(scale) * prefill::kLog2e;
  if (dtype == at::kFloat) {
    run_all(p, q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
            out.data_ptr<float>());
  } else {
    run_all(p, q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
            v_cache.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  }
  return out;
#else
  TORCH_CHECK(false, "the AVX2 prefill kernel needs a CPU with AVX2 and FMA");
  return q;
#endif
}
