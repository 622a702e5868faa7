// Paged prefill attention for CPUs with AVX512-BF16: causal attention of a prompt chunk over
// its request's KV (the cached prefix and the chunk itself, both read in place from the pool
// along the request's runs of slots), flash-style: per block of keys the scores of a strip
// of query rows are computed, softmaxed online in float32 and multiplied into the output
// right away, so the working set (a strip of scores, one packed block of keys and values)
// stays in the core's L1/L2 cache instead of streaming a [rows, prefix] score matrix through
// memory. Two copies of it on two cores therefore do not fight over the memory system.
//
// Work is split into tasks of (KV head, block of queries); threads take tasks from a shared
// counter, so a second thread (or core) shortens the call.
//
// q        [n, H, D]    the chunk's queries (H = Hk * G: G query heads share a KV head)
// k_cache  [Hk, N, D]   v_cache the same; the chunk's own keys are already written
// runs     [R, 2] int64 (first slot, length): positions 0 .. prefix + n - 1 of the request
// out      [n, H, D]
//
// Query row r of a task is (query t, head g) = (r / G, r % G): a KV head's G query heads
// sit side by side, so its keys are read once for all of them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "prefill_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PIPESERVE_PREFILL_NATIVE 1
#endif

bool prefill_attention_supported() {
#ifdef PIPESERVE_PREFILL_NATIVE
  return true;
#else
  return false;
#endif
}

#ifdef PIPESERVE_PREFILL_NATIVE
namespace {

constexpr int kRows = 6;           // query rows per register tile
constexpr int kKeyBlock = 256;     // keys per packed block

using bf16 = uint16_t;

// 2^x for x <= 0, exactly 0 below 2^-126 (masked keys give -inf): exponent by scalef,
// fraction by a degree-5 polynomial (relative error ~2e-7, far below bfloat16's resolution).
inline __m512 exp2_ps(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(prefill::kExp2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(prefill::kExp2Poly[i]));
  return _mm512_maskz_scalef_ps(live, p, n);
}

inline float hmax(__m512 v) { return _mm512_reduce_max_ps(v); }
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// Dims 2p and 2p+1 of a bfloat16 row as one word (low half: dim 2p).
inline uint32_t pair_at(const bf16* row, int p) {
  uint32_t w;
  std::memcpy(&w, row + 2 * p, sizeof w);
  return w;
}

// In-register transpose of a 16 x 16 matrix of 32-bit words: r[i][j] <- r[j][i].
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88);
    v[4 + k] = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
    v[8 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
    v[12 + k] = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
  }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_i32x4(v[k], v[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(v[k], v[8 + k], 0xdd);
  }
}

// Keys of one block packed for the score product: word (p, j) holds dims 2p, 2p+1 of key j,
// so a vector of 16 words is one dim pair of 16 keys (the VNNI layout of vdpbf16ps). Built
// 16 keys x 16 dim pairs at a time by an in-register transpose; keys past `keys` are zero.
void pack_keys(const bf16* const* rows, int keys, int padded, int D, uint32_t* out) {
  const int pairs = D / 2;  // a multiple of 8
  for (int j0 = 0; j0 < padded; j0 += 16) {
    for (int p0 = 0; p0 < pairs; p0 += 16) {
      const int np = std::min(16, pairs - p0);
      const __mmask16 mask = static_cast<__mmask16>((1u << np) - 1);
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = j0 + j < keys ? _mm512_maskz_loadu_epi32(mask, rows[j0 + j] + 2 * p0)
                             : _mm512_setzero_si512();
      transpose16(r);
      for (int p = 0; p < np; ++p)
        _mm512_storeu_si512(out + static_cast<int64_t>(p0 + p) * padded + j0, r[p]);
    }
  }
}

// Values of one block packed for the output product: word (q, e) holds dim e of keys 2q and
// 2q+1 (low half: key 2q). An odd last key is paired with zeros.
void pack_values(const bf16* const* rows, int keys, int D, uint32_t* out) {
  auto widen = [](const bf16* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  for (int q = 0; q < (keys + 1) / 2; ++q) {
    const bf16* a = rows[2 * q];
    const bf16* b = 2 * q + 1 < keys ? rows[2 * q + 1] : nullptr;
    uint32_t* o = out + static_cast<int64_t>(q) * D;
    for (int e = 0; e < D; e += 16) {
      const __m512i high = b ? _mm512_slli_epi32(widen(b + e), 16) : _mm512_setzero_si512();
      _mm512_storeu_si512(o + e, _mm512_or_si512(widen(a + e), high));
    }
  }
}

// scores[r][j0 + j] = q_r . k_(j0 + j) for R rows and 16 * NV keys, float32.
template <int R, int NV>
void score_group(const bf16* const* q, const uint32_t* kp, int padded, int pairs, int j0,
                 float* scores, int ld) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    __m512bh kv[NV];
    for (int v = 0; v < NV; ++v)
      kv[v] = (__m512bh)_mm512_loadu_si512(kp + p * padded + j0 + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(q[r], p)));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qb, kv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(scores + r * ld + j0 + 16 * v, acc[r][v]);
}

// A strip's scores against a whole packed block (padded to a multiple of 32 keys).
template <int R>
void score_tile(const bf16* const* q, const uint32_t* kp, int padded, int D, float* scores,
                int ld) {
  int j0 = 0;
  for (; j0 + 64 <= padded; j0 += 64) score_group<R, 4>(q, kp, padded, D / 2, j0, scores, ld);
  if (j0 < padded) score_group<R, 2>(q, kp, padded, D / 2, j0, scores, ld);
}

// acc[r][:] = alpha_r * acc[r][:] + sum_j p[r][j] v_j over one block, for R rows and a slab of
// 16 * NV output dims starting at e0 (accumulators stay in registers for the whole block).
template <int R, int NV>
void value_tile(const uint32_t* probs, int pair_count, const uint32_t* vp, int D, int e0,
                const float* alpha, float* out, int ld_out) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < NV; ++v)
      acc[r][v] = _mm512_mul_ps(a, _mm512_loadu_ps(out + r * ld_out + e0 + 16 * v));
  }
  for (int q = 0; q < pair_count; ++q) {
    __m512bh vv[NV];
    for (int v = 0; v < NV; ++v)
      vv[v] = (__m512bh)_mm512_loadu_si512(vp + static_cast<int64_t>(q) * D + e0 + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512bh pb =
          (__m512bh)_mm512_set1_epi32(static_cast<int>(probs[r * (kKeyBlock / 2) + q]));
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pb, vv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + r * ld_out + e0 + 16 * v, acc[r][v]);
}

template <int R>
void value_rows(const uint32_t* probs, int pair_count, const uint32_t* vp, int D,
                const float* alpha, float* out) {
  int e0 = 0;
  for (; e0 + 64 <= D; e0 += 64) value_tile<R, 4>(probs, pair_count, vp, D, e0, alpha, out, D);
  switch ((D - e0) / 16) {
    case 3: value_tile<R, 3>(probs, pair_count, vp, D, e0, alpha, out, D); break;
    case 2: value_tile<R, 2>(probs, pair_count, vp, D, e0, alpha, out, D); break;
    case 1: value_tile<R, 1>(probs, pair_count, vp, D, e0, alpha, out, D); break;
    default: break;
  }
}

// Online softmax of one strip's scores against one key block: updates the running max m and
// sum l, writes the block's probabilities as bfloat16 pairs and each row's rescale factor.
// Key j of the block is visible to row r when key_pos0 + j <= limit[r].
void softmax_rows(int R, float* scores, int keys, int padded, int64_t key_pos0,
                  const int64_t* limit, float c, float* m, float* l, float* alpha,
                  uint32_t* probs) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < R; ++r) {
    float* s = scores + r * kKeyBlock;
    const int64_t visible = std::min<int64_t>(keys, limit[r] - key_pos0 + 1);
    for (int j = static_cast<int>(std::max<int64_t>(visible, 0)); j < padded; ++j)
      s[j] = -std::numeric_limits<float>::infinity();
    __m512 vmax = neg_inf;
    for (int j = 0; j < padded; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
    const float block_max = hmax(vmax);
    const float m_new = std::max(m[r], block_max);
    alpha[r] = m[r] == m_new ? 1.f : std::exp2((m[r] - m_new) * c);
    m[r] = m_new;
    const __m512 cv = _mm512_set1_ps(c);
    const __m512 shift = _mm512_set1_ps(-m_new * c);
    __m512 vsum = _mm512_setzero_ps();
    uint32_t* pr = probs + r * (kKeyBlock / 2);
    for (int j = 0; j < padded; j += 32) {
      const __m512 p0 = exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), cv, shift));
      const __m512 p1 = exp2_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + j + 16), cv, shift));
      vsum = _mm512_add_ps(vsum, _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(pr + j / 2, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    l[r] = l[r] * alpha[r] + hsum(vsum);
  }
}

struct Problem : prefill::Shape {
  const bf16* q = nullptr;
  const bf16* k_cache = nullptr;
  const bf16* v_cache = nullptr;
  bf16* out = nullptr;
  std::vector<int64_t> slots;  // slot of each key position 0 .. total - 1
  int64_t prefix = 0;
  float c = 0;  // softmax scale in base 2: scale * log2(e)
};

struct Scratch {
  std::vector<uint32_t> kp, vp, probs;
  std::vector<float> scores, acc, m, l, alpha;
  std::vector<const bf16*> key_rows, val_rows, q_rows;
  std::vector<int64_t> limit;

  Scratch(const Problem& p, int64_t rows)
      : kp(p.D / 2 * kKeyBlock),
        vp(kKeyBlock / 2 * p.D),
        probs(kRows * kKeyBlock / 2),
        scores(kRows * kKeyBlock),
        acc(rows * p.D),
        m(rows),
        l(rows),
        alpha(kRows),
        key_rows(kKeyBlock),
        val_rows(kKeyBlock),
        q_rows(rows),
        limit(rows) {}
};

template <int R>
void strip(const Problem& p, Scratch& s, int64_t row0, int keys, int padded, int64_t key_pos0) {
  score_tile<R>(s.q_rows.data() + row0, s.kp.data(), padded, static_cast<int>(p.D),
                s.scores.data(), kKeyBlock);
  softmax_rows(R, s.scores.data(), keys, padded, key_pos0, s.limit.data() + row0, p.c,
               s.m.data() + row0, s.l.data() + row0, s.alpha.data(), s.probs.data());
  value_rows<R>(s.probs.data(), (keys + 1) / 2, s.vp.data(), static_cast<int>(p.D),
                s.alpha.data(), s.acc.data() + row0 * p.D);
}

void run_strip(int R, const Problem& p, Scratch& s, int64_t row0, int keys, int padded,
               int64_t key_pos0) {
  switch (R) {
    case 6: strip<6>(p, s, row0, keys, padded, key_pos0); break;
    case 5: strip<5>(p, s, row0, keys, padded, key_pos0); break;
    case 4: strip<4>(p, s, row0, keys, padded, key_pos0); break;
    case 3: strip<3>(p, s, row0, keys, padded, key_pos0); break;
    case 2: strip<2>(p, s, row0, keys, padded, key_pos0); break;
    default: strip<1>(p, s, row0, keys, padded, key_pos0); break;
  }
}

void run_task(const Problem& p, Scratch& s, int64_t head, int64_t t0, int64_t t1) {
  const int64_t rows = (t1 - t0) * p.G, D = p.D;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / p.G, h = head * p.G + r % p.G;
    s.q_rows[r] = p.q + (t * p.H + h) * D;
    s.limit[r] = p.prefix + t;  // causal: the last key position this row may see
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * D, 0.f);
  std::fill(s.m.begin(), s.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + rows, 0.f);
  const int64_t key_end = p.prefix + t1;  // no row of this task sees a key at or past it
  const bf16* kh = p.k_cache + head * p.N * D;
  const bf16* vh = p.v_cache + head * p.N * D;
  for (int64_t k0 = 0; k0 < key_end; k0 += kKeyBlock) {
    const int keys = static_cast<int>(std::min<int64_t>(kKeyBlock, key_end - k0));
    const int padded = (keys + 31) / 32 * 32;
    for (int j = 0; j < keys; ++j) {
      s.key_rows[j] = kh + p.slots[k0 + j] * D;
      s.val_rows[j] = vh + p.slots[k0 + j] * D;
    }
    pack_keys(s.key_rows.data(), keys, padded, static_cast<int>(D), s.kp.data());
    pack_values(s.val_rows.data(), keys, static_cast<int>(D), s.vp.data());
    for (int64_t row0 = 0; row0 < rows; row0 += kRows) {
      const int R = static_cast<int>(std::min<int64_t>(kRows, rows - row0));
      if (s.limit[row0 + R - 1] < k0) continue;  // every key of the block is in their future
      run_strip(R, p, s, row0, keys, padded, k0);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / p.G, h = head * p.G + r % p.G;
    const float inv = 1.f / s.l[r];
    const float* a = s.acc.data() + r * D;
    bf16* o = p.out + (t * p.H + h) * D;
    for (int64_t e = 0; e < D; e += 16) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(a + e),
                                                          _mm512_set1_ps(inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + e), (__m256i)v);
    }
  }
}

void run_all(const Problem& p) {
  const int64_t per = prefill::queries_per_task(p.n, p.Hk, p.G, at::get_num_threads(), kRows);
  prefill::run_tasks(
      p.n, p.Hk, per, [&] { return Scratch(p, per * p.G); },
      [&](Scratch& s, int64_t head, int64_t t0, int64_t t1) { run_task(p, s, head, t0, t1); });
}

}  // namespace
#endif

at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache,
                                      at::Tensor v_cache, at::Tensor runs, int64_t prefix,
                                      double scale) {
#ifdef PIPESERVE_PREFILL_NATIVE
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "the native prefill kernel takes bfloat16");
  q = q.contiguous();
  Problem p;
  static_cast<prefill::Shape&>(p) = prefill::check_inputs(q, k_cache, v_cache, runs, prefix, 16, p.slots);
  p.prefix = prefix;
  auto out = at::empty_like(q);
  p.q = reinterpret_cast<const bf16*>(q.data_ptr<at::BFloat16>());
  p.k_cache = reinterpret_cast<const bf16*>(k_cache.data_ptr<at::BFloat16>());
  p.v_cache = reinterpret_cast<const bf16*>(v_cache.data_ptr<at::BFloat16>());
  p.out = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  p.c = static_cast<float>(scale) * prefill::kLog2e;
  run_all(p);
  return out;
#else
  TORCH_CHECK(false, "the native prefill kernel needs a CPU with AVX512-BF16");
  return q;
#endif
}
