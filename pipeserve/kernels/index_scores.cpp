// DeepSeek-V3.2's lightning-indexer scores, fused (pipeserve/layers/indexer.py):
//
//   scores[i, j] = sum_h w[i, h] * max(0, scale * q[i, h, :] . k[j, :])   for j <= prefix + i
//   scores[i, j] = -inf                                                    for later keys
//
// q [n, H, d] and k [L, d] both float32 or both bfloat16, w [n, H] float32, L = prefix + n.
// No [H, n, L] tensor of per-head logits exists: a query's per-head dot products with a block
// of keys live in registers, are ReLU'd, weighted and summed over the heads there, and only
// the head sum is stored. Keys are packed per block transposed, so the inner loop multiplies a
// broadcast query value into the block's two key vectors for kPair queries at once: a
// register tile of kPair x 2 vectors of dot products, each key vector loaded feeding kPair
// multiply-adds. Two forms of the tile:
//  - float32 (F32Keys): GCC's 8-lane vector extension, compiled for the machine (AVX2 here;
//    AVX512 machines run the same 8-lane code); blocks of 16 keys packed [d][16].
//  - bfloat16 on CPUs with AVX512-BF16 (Bf16Keys): vdpbf16ps, which multiplies pairs of
//    bfloat16 values exactly and adds both products into a float32 lane, so a 16-key vector
//    advances two dimensions of every key at once (32 multiply-adds per instruction, twice
//    float32's); blocks of 32 keys packed [d / 2][32][2]. A bfloat16 call on a CPU without
//    it, or at an odd d, widens the queries, and each key as it is packed, to float32.
// Blocks of a query's future are skipped, the rest of its row is masked. Work is split over
// blocks of queries as the prefill kernels split theirs (prefill::run_tasks); the selection's
// tasks of every segment of a call (index_topk_segments: a batch's requests, each over its
// own rows of the key cache) share the threads, those that see the most keys first.
#include <ATen/ops/empty.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

// select_row's sixteen-lane passes (compress, 16-bit compares) where the target has them
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PIPESERVE_SELECT_AVX512 1
#include <immintrin.h>
#endif

#include "prefill_common.h"
#include "vec8.h"

#include "bf16_pairs.h"

namespace {

constexpr int64_t kQueries = 24;  // queries per task (a multiple of each form's kPair)

// Where a segment's keys are: key j is row j of `keys`, or with `runs` ([count][2]: first row,
// rows) the row its run puts it at (`starts`: the position each run starts at). The rows are
// float32 or bfloat16 (`bf16`).
struct KeyRows {
  const void* keys = nullptr;
  bool bf16 = false;
  const int64_t* runs = nullptr;
  const int64_t* starts = nullptr;
  int64_t count = 0;

  int64_t row(int64_t j) const {
    if (runs == nullptr) return j;
    const int64_t r = std::upper_bound(starts, starts + count, j) - starts - 1;
    return runs[2 * r] + (j - starts[r]);
  }
  float value(int64_t row, int64_t t, int64_t d) const {
    return bf16 ? static_cast<float>(static_cast<const c10::BFloat16*>(keys)[row * d + t])
                : static_cast<const float*>(keys)[row * d + t];
  }
};

// What the tiles read: T is the storage of queries and keys (float, or c10::BFloat16 in the
// AVX512-BF16 form).
template <typename T>
struct Inputs {
  const T* q;        // [n, H, d]
  const float* w;    // [n, H]
  const T* packed;   // the keys as the form packs them, zero past L (null: not packed yet)
  int64_t n, H, d, L, prefix;
  float scale;
  KeyRows src;  // where the keys are, to pack them in a task when `packed` is null
};

// Where a task's score rows go: row i at base + (i - row0) * L (the output tensor, or a
// thread's scratch rows when only the top-k leave the kernel).
struct Rows {
  float* base;
  int64_t row0, L;
  float* row(int64_t i) const { return base + (i - row0) * L; }
};

// pack_key(j) for every key j of whole blocks of `keys` covering L (j >= L: the last block's
// padding, zeros), blocks split over the threads.
template <typename PackKey>
void pack_blocks(int64_t L, int64_t keys, PackKey&& pack_key) {
  at::parallel_for(0, (L + keys - 1) / keys, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t j = b0 * keys; j < b1 * keys; ++j) pack_key(j);
  });
}

// float32 keys in blocks of two 8-lane vectors, packed [blocks][d][kKeys].
struct F32Keys {
  using T = float;
  static constexpr int64_t kKeys = 2 * vec8::kLanes;
  static constexpr int64_t kPair = 6;  // queries per register tile

  // bfloat16 rows widened here (a CPU without AVX512-BF16): only the keys read, never a
  // whole cache
  static void pack(const KeyRows& src, int64_t L, int64_t d, float* packed) {
    pack_blocks(L, kKeys, [&](int64_t j) {
      float* dst = packed + (j / kKeys) * d * kKeys + j % kKeys;
      if (j >= L) {
        for (int64_t t = 0; t < d; ++t) dst[t * kKeys] = 0.f;
        return;
      }
      const int64_t row = src.row(j);
      for (int64_t t = 0; t < d; ++t) dst[t * kKeys] = src.value(row, t, d);
    });
  }

  // Queries i .. i + P - 1 against one key block: acc[p] = sum_h w_ph * max(0, q_ph . k_block),
  // kKeys floats per query. Their dot products (P x 2 vectors) stay in registers over the
  // d-loop; 12 of AVX2's 16 registers at P = 6.
  template <int P>
  static void block(const Inputs<T>& in, int64_t i, int64_t b, float (*acc)[kKeys]) {
    using vec8::load8;
    using vec8::splat;
    using vec8::v8;
    constexpr int64_t kLanes = vec8::kLanes;
    v8 sum[P][2];
    for (int p = 0; p < P; ++p) sum[p][0] = sum[p][1] = splat(0.f);
    const float* kb = in.packed + b * in.d * kKeys;
    const v8 zero = splat(0.f);
    for (int64_t h = 0; h < in.H; ++h) {
      const float* qh[P];
      v8 dots[P][2];
      for (int p = 0; p < P; ++p) {
        qh[p] = in.q + ((i + p) * in.H + h) * in.d;
        dots[p][0] = dots[p][1] = zero;
      }
      for (int64_t t = 0; t < in.d; ++t) {
        const v8 k0 = load8(kb + t * kKeys), k1 = load8(kb + t * kKeys + kLanes);
        for (int p = 0; p < P; ++p) {
          const v8 qv = splat(qh[p][t]);
          dots[p][0] += qv * k0;
          dots[p][1] += qv * k1;
        }
      }
      for (int p = 0; p < P; ++p) {
        const v8 wh = splat(in.w[(i + p) * in.H + h] * in.scale);  // scale > 0: w relu(s x) = ws relu(x)
        sum[p][0] += wh * (dots[p][0] > zero ? dots[p][0] : zero);
        sum[p][1] += wh * (dots[p][1] > zero ? dots[p][1] : zero);
      }
    }
    for (int p = 0; p < P; ++p) {
      std::memcpy(acc[p], &sum[p][0], sizeof(v8));
      std::memcpy(acc[p] + kLanes, &sum[p][1], sizeof(v8));
    }
  }
};

#ifdef PIPESERVE_BF16_PAIRS
// bfloat16 keys (even d) in blocks of two 16-lane vectors, packed [blocks][d / 2][kKeys][2]:
// each 32-bit lane holds one key's two values of a pair of dimensions, as vdpbf16ps takes them.
struct Bf16Keys {
  using T = c10::BFloat16;
  static constexpr int64_t kKeys = 32;
  // queries per register tile: at 6, GCC 12 spills the key vectors (100 against 177 GMAC/s
  // on Zen 4, 16 heads of 64)
  static constexpr int64_t kPair = 4;

  static void pack(const KeyRows& src, int64_t L, int64_t d, T* packed) {
    pack_blocks(L, kKeys, [&](int64_t j) {
      T* dst = packed + (j / kKeys) * d * kKeys + (j % kKeys) * 2;
      const T* row = j < L ? static_cast<const T*>(src.keys) + src.row(j) * d : nullptr;
      for (int64_t t = 0; t < d; t += 2) {
        dst[t * kKeys] = row ? row[t] : T(0.f);
        dst[t * kKeys + 1] = row ? row[t + 1] : T(0.f);
      }
    });
  }

  // As F32Keys::block, the dot products by vdpbf16ps over pairs of dimensions: a query's
  // pair broadcast to every lane, against the block's two vectors of 16 keys. P x 2 dot
  // products and P x 2 head sums in registers.
  template <int P>
  static void block(const Inputs<T>& in, int64_t i, int64_t b, float (*acc)[kKeys]) {
    const int64_t pairs = in.d / 2;
    const T* kb = in.packed + b * in.d * kKeys;
    const __m512 zero = _mm512_setzero_ps();
    __m512 sum[P][2];
    for (int p = 0; p < P; ++p) sum[p][0] = sum[p][1] = zero;
    for (int64_t h = 0; h < in.H; ++h) {
      const T* qh[P];
      __m512 dots[P][2];
      for (int p = 0; p < P; ++p) {
        qh[p] = in.q + ((i + p) * in.H + h) * in.d;
        dots[p][0] = dots[p][1] = zero;
      }
      for (int64_t t = 0; t < pairs; ++t) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + t * 2 * kKeys);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + t * 2 * kKeys + kKeys);
        for (int p = 0; p < P; ++p) {
          int32_t two;  // the query's values at dimensions 2t, 2t + 1
          std::memcpy(&two, qh[p] + 2 * t, sizeof(two));
          const __m512bh qv = (__m512bh)_mm512_set1_epi32(two);
          dots[p][0] = _mm512_dpbf16_ps(dots[p][0], qv, k0);
          dots[p][1] = _mm512_dpbf16_ps(dots[p][1], qv, k1);
        }
      }
      for (int p = 0; p < P; ++p) {
        const __m512 wh = _mm512_set1_ps(in.w[(i + p) * in.H + h] * in.scale);
        sum[p][0] = _mm512_fmadd_ps(wh, _mm512_max_ps(dots[p][0], zero), sum[p][0]);
        sum[p][1] = _mm512_fmadd_ps(wh, _mm512_max_ps(dots[p][1], zero), sum[p][1]);
      }
    }
    for (int p = 0; p < P; ++p) {
      _mm512_storeu_ps(acc[p], sum[p][0]);
      _mm512_storeu_ps(acc[p] + 16, sum[p][1]);
    }
  }
};
#endif

// One key block's scores for rows i .. i + P - 1, up to each query's own position.
template <class F, int P>
void tile(const Inputs<typename F::T>& in, const Rows& out, int64_t i, int64_t block,
          float (*acc)[F::kKeys]) {
  F::template block<P>(in, i, block, acc);
  const int64_t j0 = block * F::kKeys;
  for (int p = 0; p < P; ++p) {
    const int64_t visible = in.prefix + i + p + 1;
    if (j0 < visible)
      std::memcpy(out.row(i + p) + j0, acc[p], std::min(F::kKeys, visible - j0) * sizeof(float));
  }
}

// The last rows of a task, fewer than F::kPair of them, in one tile.
template <class F>
void rest(const Inputs<typename F::T>& in, const Rows& out, int64_t i, int64_t count,
          int64_t block, float (*acc)[F::kKeys]) {
  switch (count) {
    case 7: return tile<F, 7>(in, out, i, block, acc);
    case 6: return tile<F, 6>(in, out, i, block, acc);
    case 5: return tile<F, 5>(in, out, i, block, acc);
    case 4: return tile<F, 4>(in, out, i, block, acc);
    case 3: return tile<F, 3>(in, out, i, block, acc);
    case 2: return tile<F, 2>(in, out, i, block, acc);
    case 1: return tile<F, 1>(in, out, i, block, acc);
    default: return;
  }
}

// Rows q0 .. q1 - 1 up to each query's own position: key block by key block (a block stays
// in L1 while every tile of the rows uses it: all of a task's in run_scores, one tile in
// run_topk), tiles whose queries all precede the block skipped. Nothing past a query's position
// is written.
template <class F>
void task_rows(const Inputs<typename F::T>& in, const Rows& out, int64_t q0, int64_t q1,
               float (*acc)[F::kKeys]) {
  const int64_t last = in.prefix + q1;  // keys 0 .. last - 1 are visible to some row
  for (int64_t block = 0; block * F::kKeys < last; ++block) {
    // the first tile some of whose queries see the block (visible = prefix + i + 1)
    const int64_t seen = std::max<int64_t>(q0, block * F::kKeys - in.prefix - F::kPair + 1);
    int64_t i = q0 + (seen - q0) / F::kPair * F::kPair;
    for (; i + F::kPair <= q1; i += F::kPair) tile<F, F::kPair>(in, out, i, block, acc);
    rest<F>(in, out, i, q1 - i, block, acc);
  }
}

template <class F>
struct Acc {
  float rows[F::kPair][F::kKeys];
};

// Every score row, its future -inf, into out [n, L].
template <class F>
void run_scores(const Inputs<typename F::T>& in, float* out) {
  // tasks of kQueries queries on every thread, later (longer) rows first: the prefill
  // kernels' split, with one "head" (the heads are summed inside a task)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  prefill::run_tasks(
      in.n, 1, kQueries, [] { return Acc<F>{}; },
      [&](Acc<F>& acc, int64_t, int64_t q0, int64_t q1) {
        task_rows<F>(in, Rows{out, 0, in.L}, q0, q1, acc.rows);
        for (int64_t i = q0; i < q1; ++i)
          std::fill(out + i * in.L + in.prefix + i + 1, out + (i + 1) * in.L, neg_inf);
      });
}

// The positions of row's `topk` best among its first `visible` scores into pick[0 .. topk),
// the earlier position first among equal scores at the boundary (as layers/indexer.py's
// top_positions; -0.0 equals 0.0 in these comparisons); all of them, then -1s, when there
// are no more than topk. NaN (from NaN or infinite inputs) ranks as -inf, below every number:
// the row (the thread's scratch) is rewritten so, once, and every comparison below is then a
// strict weak order, so a row always yields topk positions.
//
// A selection in four passes over the row, none of them a sort: (1) NaN to -inf and the range
// of the finite scores; (2) a histogram of kBins equal bins over that range (-inf in the
// lowest, +inf in the highest: the bin is monotone in the score), from which the bin holding
// the topk-th best and the count above it follow; (3) that bin's scores gathered into `copy`
// and the topk-th best found among them alone (nth_element over a few, not over the row);
// (4) the positions in order: every score above it, then the earliest of those equal to it.
// `copy` holds `visible` + 16 floats, `tags` each score's bin, `bins` kBins counters.
constexpr int64_t kBins = 2048;

void select_row(float* row, int64_t visible, int64_t topk, float* copy, int64_t* pick,
                int32_t* bins, uint16_t* tags) {
  using vec8::load8;
  using vec8::splat;
  using vec8::store8;
  using vec8::v8;
  constexpr int64_t kLanes = vec8::kLanes;
  std::fill(pick, pick + topk, int64_t{-1});
  if (visible <= topk) {
    for (int64_t j = 0; j < visible; ++j) pick[j] = j;
    return;
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t body = visible - visible % kLanes;
  // (1) NaN to -inf, and the range of the finite scores
  v8 lo8 = splat(inf), hi8 = splat(-inf);
  for (int64_t j = 0; j < body; j += kLanes) {
    v8 x = load8(row + j);
    x = x == x ? x : splat(neg_inf);
    store8(row + j, x);
    const auto finite = (x > splat(neg_inf)) & (x < splat(inf));
    lo8 = finite & (x < lo8) ? x : lo8;
    hi8 = finite & (x > hi8) ? x : hi8;
  }
  float lo = inf, hi = -inf;
  for (int64_t l = 0; l < kLanes; ++l) {
    lo = std::min(lo, lo8[l]);
    hi = std::max(hi, hi8[l]);
  }
  for (int64_t j = body; j < visible; ++j) {
    const float x = std::isnan(row[j]) ? neg_inf : row[j];
    row[j] = x;
    if (std::isfinite(x)) {
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
  }
  // (2) bin(x): 0 at lo and below, kBins - 1 at hi and above, equal widths between; a weakly
  // increasing function of x (a subtraction and a product by a positive constant round
  // monotonically), so every score of a higher bin is at least every score of a lower one
  const float scale = hi > lo ? (kBins - 1) / (hi - lo) : 0.f;
  const float top = kBins - 1;
  const auto bin = [&](float x) -> uint16_t {
    if (!(x > lo)) return 0;
    if (!(x < hi)) return kBins - 1;
    const float t = (x - lo) * scale;  // +inf where hi - lo is too small for 1 / it
    return static_cast<uint16_t>(t < top ? t : top);
  };
  for (int64_t j = 0; j < body; j += kLanes) {  // bin() eight lanes at a time
    const v8 x = load8(row + j);
    v8 t = (x - splat(lo)) * splat(scale);
    t = t < splat(top) ? t : splat(top);  // +inf (and NaN: 0 x inf at lo, settled below)
    t = x < splat(hi) ? t : splat(top);
    t = x > splat(lo) ? t : splat(0.f);
    const vec8::v8h b = __builtin_convertvector(__builtin_convertvector(t, vec8::v8i), vec8::v8h);
    std::memcpy(tags + j, &b, sizeof(b));
  }
  for (int64_t j = body; j < visible; ++j) tags[j] = bin(row[j]);
  std::fill(bins, bins + kBins, 0);
  for (int64_t j = 0; j < visible; ++j) ++bins[tags[j]];
  int64_t above = 0, b = kBins - 1;
  while (above + bins[b] < topk) above += bins[b--];  // some bin holds the topk-th: visible > topk
  // (3) that bin's scores, and the topk-th best among them
  int64_t c = 0, j = 0;
#ifdef PIPESERVE_SELECT_AVX512
  // sixteen at a time: the bin's lanes compressed to the front of a register, stored whole
  // (copy has 16 floats of room past visible)
  const __m256i bin_b = _mm256_set1_epi16(static_cast<int16_t>(b));
  for (; j + 16 <= visible; j += 16) {
    const __mmask16 m = _mm256_cmpeq_epi16_mask(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tags + j)), bin_b);
    if (!m) continue;
    _mm512_storeu_ps(copy + c, _mm512_maskz_compress_ps(m, _mm512_loadu_ps(row + j)));
    c += __builtin_popcount(m);
  }
#endif
  for (; j < visible; ++j)
    if (tags[j] == b) copy[c++] = row[j];  // the bins counted (fast-math may round twice apart)
  const int64_t need = topk - above;  // in 1 .. bins[b]
  std::nth_element(copy, copy + need - 1, copy + c, std::greater<float>());
  const float kth = copy[need - 1];
  for (int64_t t = 0; t < c; ++t) above += copy[t] > kth;
  // (4) the positions in order, without a branch per score
  int64_t ties = topk - above, taken = 0;
  j = 0;
#ifdef PIPESERVE_SELECT_AVX512
  // sixteen at a time: the lanes above kth and the first `ties` equal to it, their positions
  // compressed to the front of a register and stored as int64 (masked: pick holds topk)
  const __m512 kv = _mm512_set1_ps(kth);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; j + 16 <= visible && taken < topk; j += 16) {
    const __m512 x = _mm512_loadu_ps(row + j);
    __mmask16 m = _mm512_cmp_ps_mask(x, kv, _CMP_GT_OQ);
    for (__mmask16 eq = ties > 0 ? _mm512_cmp_ps_mask(x, kv, _CMP_EQ_OQ) : 0; eq && ties > 0;
         --ties) {
      m |= eq & -eq;  // the earliest equal lane left
      eq &= eq - 1;
    }
    if (!m) continue;
    // no more than topk in all (so by the counts above; the bound keeps pick's end safe)
    const int count = static_cast<int>(std::min<int64_t>(__builtin_popcount(m), topk - taken));
    const __m512i at = _mm512_maskz_compress_epi32(
        m, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(j))));
    _mm512_mask_storeu_epi64(pick + taken, static_cast<__mmask8>((1u << std::min(count, 8)) - 1),
                             _mm512_cvtepi32_epi64(_mm512_castsi512_si256(at)));
    if (count > 8)
      _mm512_mask_storeu_epi64(pick + taken + 8, static_cast<__mmask8>((1u << (count - 8)) - 1),
                               _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(at, 1)));
    taken += count;
  }
#endif
  for (; j < visible && taken < topk; ++j) {
    const bool tie = row[j] == kth && ties > 0;
    pick[taken] = j;
    taken += (row[j] > kth) | tie;
    ties -= tie;
  }
}

// Each row's top-k positions into its segment's pick [n, topk] (picks[s] for ins[s]); the scores
// of a task's rows live only in its thread's scratch (a task's rows x L floats: 16 MiB at most,
// fewer rows per task when L is long, and at least one tile of kPair rows, 24 MiB at a million
// keys). The tasks of every segment go on all threads at once, those that see the most keys
// first.
template <class F>
void run_topk(const std::vector<Inputs<typename F::T>>& ins, const std::vector<int64_t*>& picks,
              int64_t topk) {
  constexpr int64_t kScratchFloats = int64_t{1} << 22;  // 16 MiB of score rows per thread
  struct Task {
    int64_t seg, q0, q1;
  };
  std::vector<Task> tasks;
  for (int64_t g = 0; g < static_cast<int64_t>(ins.size()); ++g) {
    const Inputs<typename F::T>& in = ins[g];
    if (in.n == 0) continue;
    const int64_t per = std::max<int64_t>(
        F::kPair, std::min<int64_t>(kQueries, kScratchFloats / in.L / F::kPair * F::kPair));
    for (int64_t q0 = 0; q0 < in.n; q0 += per) tasks.push_back({g, q0, std::min(in.n, q0 + per)});
  }
  if (tasks.empty()) return;
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    return ins[a.seg].prefix + a.q1 > ins[b.seg].prefix + b.q1;
  });
  struct Scratch {
    Acc<F> acc;
    std::vector<float> rows, copy;
    std::vector<int32_t> bins = std::vector<int32_t>(kBins);
    std::vector<uint16_t> tags;
    std::vector<typename F::T> keys;  // a one-task segment's keys, packed in its task
  };
  // each thread's scratch kept between calls (up to prefill::kKeptScratchBytes): allocated
  // afresh, its pages may be faulted in and zeroed again on every prompt chunk and layer
  prefill::run_in_order(
      static_cast<int64_t>(tasks.size()),
      []() -> Scratch& {
        thread_local Scratch kept;
        return kept;
      },
      [&](Scratch& s, int64_t t) {
        Inputs<typename F::T> in = ins[tasks[t].seg];
        int64_t* pick = picks[tasks[t].seg];
        if (in.packed == nullptr && in.src.keys != nullptr && in.prefix + in.n > topk) {
          // a decode step's keys: packed here, on this thread, into its scratch (inline: no
          // parallel region inside this one), read by this task alone
          const int64_t size = (in.L + F::kKeys - 1) / F::kKeys * in.d * F::kKeys;
          s.keys.resize(std::max(s.keys.size(), static_cast<size_t>(size)));
          F::pack(in.src, in.L, in.d, s.keys.data());
          in.packed = s.keys.data();
        }
        const int64_t q0 = tasks[t].q0, q1 = tasks[t].q1;
        // a decode step's one query: one row, not a whole task's
        s.rows.resize(std::max(s.rows.size(), static_cast<size_t>((q1 - q0) * in.L)));
        s.copy.resize(std::max(s.copy.size(), static_cast<size_t>(in.L + 16)));  // + whole vectors
        s.tags.resize(std::max(s.tags.size(), static_cast<size_t>(in.L)));
        // rows that see no more than topk keys keep them all: their scores are not read (nor
        // are keys packed for a segment whose every row does). A tile of rows at a time, over
        // every key block, then selected while its rows are in L2 (the task's rows, 1.5 MiB at
        // 16K keys, are not): 1.3% less time on Zen 4, 16 heads of 64, 2048 queries over 16K
        // keys (three alternating runs each), than all the task's rows block by block
        const int64_t scored = std::clamp<int64_t>(topk - in.prefix, q0, q1);
        for (int64_t r0 = q0; r0 < q1; r0 += F::kPair) {
          const int64_t r1 = std::min(q1, r0 + F::kPair);
          if (std::max(r0, scored) < r1)
            task_rows<F>(in, Rows{s.rows.data(), q0, in.L}, std::max(r0, scored), r1, s.acc.rows);
          for (int64_t i = r0; i < r1; ++i)
            select_row(s.rows.data() + (i - q0) * in.L, in.prefix + i + 1, topk, s.copy.data(),
                       pick + i * topk, s.bins.data(), s.tags.data());
        }
        prefill::trim_scratch(s.rows, s.copy, s.tags, s.keys);
      });
}

// A call's segments: segment g's queries are rows [q_start, q_start + q_len) of q and w, at
// positions prefix .. prefix + q_len - 1 of its keys, which are rows of k: row j, or along
// `runs` (KeyRows); with no keys (keys false) the segment sees no more than topk positions and
// keeps them all.
struct Segment {
  int64_t q_start, q_len, prefix;
  bool keys;
  const int64_t* runs = nullptr;
  const int64_t* starts = nullptr;
  int64_t count = 0;
};

// Checks the inputs, packs each segment's keys in the form the dtype and this CPU take (a
// segment of one query, when `in_tasks`, is packed later in its own task: see run_topk), and
// calls run(form, inputs of every segment): bfloat16 q and k (d even) in the AVX512-BF16 form
// where built, anything else as float32 (bfloat16 keys widened as they are packed).
template <typename Run>
void with_inputs(at::Tensor q, at::Tensor w, at::Tensor k, const std::vector<Segment>& segs,
                 double scale, bool in_tasks, Run&& run) {
  TORCH_CHECK(q.dim() == 3 && w.dim() == 2 && k.dim() == 2, "q [n,H,d], w [n,H], k [L,d] expected");
  const bool bf16 = q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || (q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat),
              "the indexer kernels take q and k both float32 or both bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kFloat, "the indexer kernels take float32 head weights");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2);
  TORCH_CHECK(w.size(0) == n && w.size(1) == H, "w must be [n, H]");
  TORCH_CHECK(k.size(1) == d, "q and k disagree on the head dim");
  TORCH_CHECK(scale > 0, "the score scale must be positive");
  for (const Segment& g : segs)
    TORCH_CHECK(g.q_start >= 0 && g.q_len >= 0 && g.q_start + g.q_len <= n && g.prefix >= 0,
                "a segment's queries lie outside q");
  w = w.contiguous();
  k = k.contiguous();
  const float s = static_cast<float>(scale);
  auto up_front = [&](const Segment& g) { return g.keys && !(in_tasks && g.q_len == 1); };
  auto packed_inputs = [&](auto form, auto* qp, const at::TensorOptions& options) {
    using F = decltype(form);
    using T = typename F::T;
    auto blocks = [&](const Segment& g) {
      return (g.prefix + g.q_len + F::kKeys - 1) / F::kKeys * d * F::kKeys;
    };
    int64_t total = 0;
    for (const Segment& g : segs) total += up_front(g) ? blocks(g) : 0;
    at::Tensor packed = at::empty({total}, options);
    T* dst = static_cast<T*>(packed.data_ptr());
    std::vector<Inputs<T>> ins;
    for (const Segment& g : segs) {
      const int64_t L = g.prefix + g.q_len;
      Inputs<T> in{qp + g.q_start * H * d, w.data_ptr<float>() + g.q_start * H, nullptr,
                   g.q_len, H, d, L, g.prefix, s};
      if (g.keys) in.src = KeyRows{k.data_ptr(), bf16, g.runs, g.starts, g.count};
      if (up_front(g)) {
        F::pack(in.src, L, d, dst);
        in.packed = dst;
        dst += blocks(g);
      }
      ins.push_back(in);
    }
    run(form, ins);
  };
#ifdef PIPESERVE_BF16_PAIRS
  if (bf16 && d % 2 == 0) {
    q = q.contiguous();
    packed_inputs(Bf16Keys{}, q.data_ptr<c10::BFloat16>(), k.options());
    return;
  }
#endif
  q = q.to(at::kFloat).contiguous();
  packed_inputs(F32Keys{}, q.data_ptr<float>(), k.options().dtype(at::kFloat));
}

// One segment: q's queries at the last positions of k, its rows in order.
std::vector<Segment> whole(const at::Tensor& q, const at::Tensor& k, int64_t prefix) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 2, "q [n,H,d], k [L,d] expected");
  TORCH_CHECK(prefix >= 0 && prefix + q.size(0) == k.size(0),
              "k must hold the prefix and the queries' own keys");
  return {Segment{0, q.size(0), prefix, true}};
}

}  // namespace

at::Tensor index_scores(at::Tensor q, at::Tensor w, at::Tensor k, int64_t prefix, double scale) {
  at::Tensor out = at::empty({q.size(0), k.size(0)}, w.options());
  with_inputs(q, w, k, whole(q, k, prefix), scale, false, [&](auto form, const auto& ins) {
    run_scores<decltype(form)>(ins[0], out.data_ptr<float>());
  });
  return out;
}

// [n, topk] positions, in the memory of an earlier call's answer where nothing refers to it any
// more (no tensor, no view: its storage held by `kept` alone), made in the same inference mode.
// A prompt chunk's choice is tens of MB (32 MiB at 2048 queries x 2048), which glibc maps
// afresh on every call (its mmap threshold stops at 32 MiB), and the kernel's first writes then
// fault it in page by page: 2048 queries over 16K keys took 7% longer so (0.177 against 0.165 s
// on Zen 4, 16 heads of 64). Answers of kKeptPickMinBytes to kKeptPickBytes are kept, the
// latest one per thread; smaller ones come from the heap as any tensor (a decode step's, even
// while a prompt chunk's is held). The answer is a view: a raw pointer to it held past its
// last reference would see later answers.
constexpr int64_t kKeptPickMinBytes = int64_t{1} << 20, kKeptPickBytes = int64_t{64} << 20;

at::Tensor new_pick(int64_t n, int64_t topk, const at::TensorOptions& options) {
  thread_local at::Tensor kept;  // flat int64
  thread_local bool kept_inference = false;  // the mode it was made in
  const int64_t count = n * topk, bytes = count * static_cast<int64_t>(sizeof(int64_t));
  if (bytes < kKeptPickMinBytes || bytes > kKeptPickBytes) return at::empty({n, topk}, options);
  const bool inference = c10::InferenceMode::is_enabled();
  if (!kept.defined() || kept.storage().use_count() > 1 || kept.numel() < count ||
      kept_inference != inference) {
    kept = at::empty({count}, options);  // the one held (if any) is its holder's alone now
    kept_inference = inference;
  }
  return kept.narrow(0, 0, count).view({n, topk});
}

at::Tensor index_topk(at::Tensor q, at::Tensor w, at::Tensor k, int64_t prefix, double scale,
                      int64_t topk) {
  TORCH_CHECK(topk > 0, "topk must be positive");
  at::Tensor pick = new_pick(q.size(0), topk, w.options().dtype(at::kLong));
  // one segment: its keys packed by every thread, before its tasks
  with_inputs(q, w, k, whole(q, k, prefix), scale, false, [&](auto form, const auto& ins) {
    run_topk<decltype(form)>(ins, {pick.data_ptr<int64_t>()}, topk);
  });
  return pick;
}

at::Tensor index_topk_segments(at::Tensor q, at::Tensor w, at::Tensor cache, at::Tensor runs,
                               at::Tensor segments, double scale, int64_t topk) {
  TORCH_CHECK(topk > 0, "topk must be positive");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 5 &&
                  segments.scalar_type() == at::kLong,
              "segments: [S, 5] int64 rows of (q_start, q_len, prefix, first run, runs)");
  TORCH_CHECK(runs.dim() == 2 && runs.size(1) == 2 && runs.scalar_type() == at::kLong,
              "runs: [R, 2] int64 rows of (first slot, slots)");
  TORCH_CHECK(cache.dim() == 2, "cache: [slots, d]");
  segments = segments.contiguous();
  runs = runs.contiguous();
  const int64_t* rows = segments.data_ptr<int64_t>();
  const int64_t* run = runs.data_ptr<int64_t>();
  const int64_t slots = cache.size(0), R = runs.size(0);
  // where each run starts among its segment's positions: O(runs), not O(positions)
  std::vector<std::vector<int64_t>> starts(segments.size(0));
  std::vector<Segment> segs;
  for (int64_t g = 0; g < segments.size(0); ++g) {
    const int64_t* r = rows + 5 * g;
    const int64_t L = r[2] + r[1];
    TORCH_CHECK(r[4] >= 0 && r[3] >= 0 && r[3] + r[4] <= R, "a segment's runs lie outside runs");
    if (r[4] == 0) {
      TORCH_CHECK(L <= topk, "a segment without keys must see no more than topk positions");
      segs.push_back(Segment{r[0], r[1], r[2], false});
      continue;
    }
    std::vector<int64_t>& first = starts[g];
    int64_t covered = 0;
    for (int64_t i = r[3]; i < r[3] + r[4]; ++i) {
      const int64_t slot = run[2 * i], count = run[2 * i + 1];
      TORCH_CHECK(slot >= 0 && count > 0 && slot + count <= slots, "a run lies outside cache");
      first.push_back(covered);
      covered += count;
    }
    TORCH_CHECK(covered >= L, "a segment's runs cover fewer positions than it has");
    segs.push_back(Segment{r[0], r[1], r[2], true, run + 2 * r[3], first.data(), r[4]});
  }
  const int64_t n = q.size(0);
  at::Tensor pick = new_pick(n, topk, w.options().dtype(at::kLong));
  std::vector<char> covered(n, 0);
  for (const Segment& g : segs)
    if (g.q_start >= 0 && g.q_len >= 0 && g.q_start + g.q_len <= n)
      for (int64_t i = g.q_start; i < g.q_start + g.q_len; ++i) covered[i] = 1;
  int64_t* out = pick.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)  // a row no segment holds chooses nothing
    if (!covered[i]) std::fill(out + i * topk, out + (i + 1) * topk, int64_t{-1});
  with_inputs(q, w, cache, segs, scale, true, [&](auto form, const auto& ins) {
    std::vector<int64_t*> picks;
    for (const Segment& g : segs) picks.push_back(out + g.q_start * topk);
    run_topk<decltype(form)>(ins, picks, topk);
  });
  return pick;
}

// Whether bfloat16 inputs take the vdpbf16ps forms here, in sparse_expanded.cpp and in
// sparse_attention.cpp (bf16_pairs.h: AVX512F and AVX512-BF16 in the compiler's target).
bool bf16_pairs_supported() {
#ifdef PIPESERVE_BF16_PAIRS
  return true;
#else
  return false;
#endif
}
