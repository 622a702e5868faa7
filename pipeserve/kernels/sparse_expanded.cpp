// DeepSeek-V3.2's sparse attention on up-projected keys (pipeserve/layers/mla.py, prompt
// chunks long enough that up-projecting the request's latents costs less than attending in
// latent space, `MLAttention.sparse_expands`): each query attends, in every head, to the
// positions its indexer chose and no other,
//
//   out[i, h] = sum_{p in S_i} softmax_p(scale * q[i, h] . key[p, h]) v[p, h]
//
// with key[p, h] = [k[p, h] | rope[p]] (the per-head k_nope, then the roped k_rope that every
// head shares; no rope: whole per-head keys) and S_i = {pos[i, t] : pos[i, t] >= 0}. Per
// (query, position, head) this is dk + dr + dv multiply-adds, against 2 * kv_lora_rank + dr in
// latent space (3.4x fewer at DeepSeek-V3's widths), but each reads a value of its own: per-head
// keys are not shared by the heads as a latent row is, and each dot product ends in a
// reduction across lanes, so a multiply-add costs more than in the latent kernel (2-2.5x its
// time in float32 on Zen 3; 1.75x at 8 heads of 96/64 and 2.2x at 16 of 192/128 in the
// vdpbf16ps forms on Zen 4).
//
// The chosen positions are scattered over the request's expanded keys (tens of MB), so the
// work is blocked by position: a task's queries (up to kMaxTask) sweep the positions in spans
// that stay in L3 (kSpanBytes: each span read from memory once per task), a tile of
// tile_queries() queries at a time (their running state stays in L2) over the span's blocks of
// kBlock positions. Within a block a query's chosen positions are a run of its ascending list
// (read in place when the caller's is ascending with any -1s at its end, as the indexer's
// are; else copied without the -1s and sorted here); each head's scores over the run are eight
// dot products side by side (eight independent chains of multiply-adds, reduced into one
// vector), its weights by 2^x polynomial against a running maximum (an online softmax across
// blocks), then its values in register tiles of kRows positions (each output vector loaded and
// stored once per kRows). Plain C++ with GCC's 8-lane vector extension, compiled for the machine;
// float32 or bfloat16 storage (widened on load), float32 arithmetic. bfloat16 storage on CPUs
// with AVX512-BF16 takes the Bf16Form instead (below: vdpbf16ps for the scores and the
// values, blocks that fill L2). The (query, position) pairs read are counted, so
// tests can check that no more than the chosen ones were.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <unistd.h>

#include "prefill_common.h"
#include "vec8.h"

#include "bf16_pairs.h"

namespace {

using vec8::exp8;
using vec8::kLanes;
using vec8::lanes_sum;
using vec8::load8;
using vec8::splat;
using vec8::store8;
using vec8::v8;
using vec8::v8i;

constexpr int64_t kBlock = 64;  // positions per block (~256 KB of float32 keys and values at H = 8)
// The Bf16Form's blocks: as many positions as the keys and values of which fill a core's L2
// (1 MiB on Zen 4, where 1024 queries over 2048 of 16K positions took 0.077 s at 8 heads of
// 96/64 and 0.279 s at 16 of 192/128, against 0.075 and 0.382 s at half of it and 0.20 and
// 0.48 s at 256 positions); longer runs per query and block pay for their misses.
inline int64_t l2_bytes() {
  static const int64_t bytes = [] {
    const long n = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return n > 0 ? static_cast<int64_t>(n) : int64_t{1} << 20;
  }();
  return bytes;
}
constexpr int64_t kMaxTask = 512;  // queries per task at most
constexpr int64_t kRows = 4;       // positions per register tile
// Queries sweeping a span's blocks together: as many as have 256 KiB of accumulators, 32 to
// 128. A rule measured, not derived (the blocks fill L2 as it is): on Zen 4 (1 MiB L2), 2048
// queries over 2048 of 16K positions took 3% less time with 128 than with 32 at 8 heads of
// 96/64 in both dtypes, and 7% more at 16 of 192/128.
constexpr int64_t kTileStateBytes = int64_t{256} << 10;
inline int64_t tile_queries(int64_t H, int64_t dv) {
  const int64_t per_query = std::max<int64_t>(1, H * dv * int64_t{sizeof(float)});
  return std::clamp<int64_t>(kTileStateBytes / per_query, 32, 128);
}
constexpr int64_t kSpanBytes = int64_t{4} << 20;  // keys and values of a span of positions

template <typename T>
struct Inputs {
  const T* q;            // [n, H, dk + dr], contiguous
  const T* k;            // k[p, h, :dk] at k + p * sk0 + h * sk1
  const T* v;            // v[p, h, :dv] at v + p * sv0 + h * sv1
  const T* rope;         // rope[p, :dr] at rope + p * sr0; dr may be 0
  const int64_t* pos;    // [n, topk]
  T* out;                // [n, H, dv]
  int64_t n, H, dk, dr, dv, topk, keys;
  int64_t sk0, sk1, sv0, sv1, sr0;
  float scale;
};

struct Scratch {
  std::vector<int64_t> pos;                 // sorted copies of the queries' lists that need one
  std::vector<std::pair<int64_t, int64_t>> copied;  // (query, end of its copy in pos)
  std::vector<const int64_t*> next, end;    // per query: the next of its positions to read, its end
  std::vector<const int64_t*> ends;         // per query and block of a span: one past its run
  std::vector<float> q;                     // [queries, H, dk + dr], scaled, float32
  std::vector<float> acc;                   // [queries, H, dv] (the Bf16Form's: 32 a chunk)
  std::vector<float> top, sums;             // [queries, H rounded up to kLanes]
  std::vector<float> w;                     // a run's scores, then weights (padded to lanes)
  std::vector<c10::BFloat16> qb;            // the Bf16Form's queries in zero-padded chunks
  std::vector<uint32_t> pairs;              // the Bf16Form's weights as bfloat16 pairs
  int64_t read = 0;
};

// One vector of eight vectors' lane sums: lane r holds the sum of a[r]'s lanes.
inline v8 lane_sums(const v8 (&a)[kLanes]) {
  const auto hadd = [](v8 x, v8 y) {  // pairwise sums of x's and y's lanes, interleaved
    return __builtin_shuffle(x, y, v8i{0, 2, 8, 10, 4, 6, 12, 14}) +
           __builtin_shuffle(x, y, v8i{1, 3, 9, 11, 5, 7, 13, 15});
  };
  const v8 g0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));  // halves' sums of a[0..4)
  const v8 g1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return __builtin_shuffle(g0, g1, v8i{0, 1, 2, 3, 8, 9, 10, 11}) +
         __builtin_shuffle(g0, g1, v8i{4, 5, 6, 7, 12, 13, 14, 15});
}

// Scores of one head (query qh, scaled, dk + dr floats) against eight positions p[0 .. 8):
// eight dot products side by side (eight independent chains of multiply-adds, each query
// vector loaded feeding all eight), reduced into one vector, lane r for p[r].
template <typename T>
inline v8 score8(const Inputs<T>& in, const float* qh, const int64_t* p, int64_t h) {
  const int64_t kb = in.dk - in.dk % kLanes, rb = in.dr - in.dr % kLanes;
  const T* kr[kLanes];
  const T* rr[kLanes];
  v8 acc[kLanes];
  for (int r = 0; r < kLanes; ++r) {
    kr[r] = in.k + p[r] * in.sk0 + h * in.sk1;
    rr[r] = in.dr ? in.rope + p[r] * in.sr0 : nullptr;
    acc[r] = splat(0.f);  // not `= {}`: GCC zeroes that through memory
  }
  for (int64_t j = 0; j < kb; j += kLanes) {
    const v8 qv = load8(qh + j);
    for (int r = 0; r < kLanes; ++r) acc[r] += qv * load8(kr[r] + j);
  }
  const float* qr = qh + in.dk;
  for (int64_t j = 0; j < rb; j += kLanes) {
    const v8 qv = load8(qr + j);
    for (int r = 0; r < kLanes; ++r) acc[r] += qv * load8(rr[r] + j);
  }
  v8 s = lane_sums(acc);
  if (kb < in.dk || rb < in.dr)
    for (int r = 0; r < kLanes; ++r) {
      float tail = 0.f;
      for (int64_t j = kb; j < in.dk; ++j) tail += qh[j] * static_cast<float>(kr[r][j]);
      for (int64_t j = rb; j < in.dr; ++j) tail += qr[j] * static_cast<float>(rr[r][j]);
      s[r] += tail;
    }
  return s;
}


// acc[:dv] += sum_r w[r] * v[p[r], h, :dv], r < R.
template <typename T, int R>
inline void value_tile(const Inputs<T>& in, const int64_t* p, int64_t h, const float* w,
                       float* acc) {
  const int64_t body = in.dv - in.dv % kLanes;
  const T* vr[R];
  v8 wv[R];
  for (int r = 0; r < R; ++r) {
    vr[r] = in.v + p[r] * in.sv0 + h * in.sv1;
    wv[r] = splat(w[r]);
  }
  for (int64_t j = 0; j < body; j += kLanes) {
    v8 a = load8(acc + j);
    for (int r = 0; r < R; ++r) a += wv[r] * load8(vr[r] + j);
    store8(acc + j, a);
  }
  for (int64_t t = body; t < in.dv; ++t)
    for (int r = 0; r < R; ++r) acc[t] += w[r] * static_cast<float>(vr[r][t]);
}

// One head's scores w[0 .. c) of a run into weights e^(score - top), against its running
// maximum `top` (what was summed shrinks when it grows: the head's sum and its accumulator
// acc, len floats); their sum added to `sum`. w has room for c rounded up to kLanes.
inline void weigh(float* w, int64_t c, int64_t len, float& top, float& sum, float* acc) {
  const int64_t padded = (c + kLanes - 1) / kLanes * kLanes;
  for (int64_t t = c; t < padded; ++t) w[t] = -std::numeric_limits<float>::infinity();
  v8 most = splat(top);
  for (int64_t t = 0; t < padded; t += kLanes) {
    const v8 x = load8(w + t);
    most = x > most ? x : most;
  }
  float best = top;
  for (int64_t l = 0; l < kLanes; ++l) best = std::max(best, most[l]);
  if (best > top) {
    const float shrink = std::exp(top - best);  // 0 on the first run
    sum *= shrink;
    for (int64_t j = 0; j < len; ++j) acc[j] *= shrink;
    top = best;
  }
  v8 total = splat(0.f);  // the padding's weights (~2^-126 each) vanish beside the e^0 of a maximum
  for (int64_t t = 0; t < padded; t += kLanes) {
    const v8 e = exp8(load8(w + t) - splat(top));
    store8(w + t, e);
    total += e;
  }
  sum += lanes_sum(total);
}

// acc[:dv] += sum_t w[t] * v[p[t], h, :dv] over a run of c positions, kRows at a time.
template <typename T>
void values(const Inputs<T>& in, const int64_t* p, int64_t c, int64_t h, const float* w,
            float* acc) {
  int64_t r = 0;
  for (; r + kRows <= c; r += kRows) value_tile<T, kRows>(in, p + r, h, w + r, acc);
  for (; r < c; ++r) value_tile<T, 1>(in, p + r, h, w + r, acc);
}

// One head of one query over its positions p[0 .. c) of a block: scores, weights, values.
template <typename T>
void head_run(const Inputs<T>& in, const float* qh, const int64_t* p, int64_t c, int64_t h,
              float* w, float& top, float& sum, float* acc) {
  const int64_t padded = (c + kLanes - 1) / kLanes * kLanes;
  for (int64_t r = 0; r < padded; r += kLanes) {
    int64_t p8[kLanes];  // past c: the last position again, its score then dropped
    for (int64_t t = 0; t < kLanes; ++t) p8[t] = p[std::min(r + t, c - 1)];
    store8(w + r, score8(in, qh, p8, h));
  }
  weigh(w, c, in.dv, top, sum, acc);
  values(in, p, c, h, w, acc);
}

#ifdef PIPESERVE_BF16_PAIRS
// bfloat16 storage on CPUs with AVX512-BF16 (the `Bf16Form`): a query over a run as head_run
// does, with vdpbf16ps (pairs of bfloat16 multiplied exactly, float32 sums), for a group of
// eight heads at once (the lanes of a vector of scores), so that what a position costs once
// (its row's address, its rope chunks, the reduction of dot products, the softmax's
// arithmetic) is shared by the group's heads instead of paid by each:
//  - Scores: each head's dot product with a position's key is one vdpbf16ps per chunk of 32
//    values (the key's last chunk masked; the query's chunks zero-padded copies), the rope
//    chunks loaded once per position. Register tiles of TH heads (their query chunks held in
//    registers over the run) by 8 / TH positions: the tile's eight 16-lane sums are reduced
//    together into one vector (sums_of_eight). The scale multiplies the sums.
//  - Weights: the online softmax in lanes of heads, one vector per position, two positions a
//    16-lane vector, each pair made into bfloat16 pairs of weights for all eight heads as it is
//    weighed.
//  - Values: HV heads at a time (neighbours in a position's row), two positions at a time:
//    their value rows interleaved (bf16_pairs::interleave), so one vdpbf16ps adds both
//    positions into 16 channels with their pair of weights; the heads' accumulators (32
//    channels a chunk, in two vectors) stay in registers over the run. The interleave leaves
//    the channels permuted within each chunk (bf16_pairs::lane_of); the accumulator is kept
//    so and put in order when the query's output is written.
// A group of fewer than eight heads (the last, when H is not a multiple of 8) repeats its
// last head in the spare lanes and drops them. On Zen 4 this runs 1.5x the speed of one head
// at a time (benchmarks/v32_kernels.py, 8 heads of 96/64: 55 against 36 GMAC/s; 16 of
// 192/128: 43 against 38). Widths
// beyond kMaxKeyChunks / kMaxRopeChunks / kMaxValueChunks take head_run (bfloat16 widened).
using bf16 = c10::BFloat16;
using bf16_pairs::chunk_mask;
using bf16_pairs::chunks;
using bf16_pairs::lane_of;
constexpr int64_t kMaxKeyChunks = 6, kMaxRopeChunks = 2, kMaxValueChunks = 4;

inline bool bf16_form(const Inputs<bf16>& in) {
  return in.dk > 0 && in.dv > 0 && chunks(in.dk) <= kMaxKeyChunks &&
         chunks(in.dr) <= kMaxRopeChunks && chunks(in.dv) <= kMaxValueChunks;
}

// What a group of heads' run reads and writes besides the inputs.
struct GroupRun {
  const bf16* q;     // the group's heads, NQ chunks of 32 each, zero past the widths
  int64_t h0, heads;  // the group's first head and how many it has (1 .. kLanes)
  float* w;          // kLanes floats per position
  uint32_t* pairs;   // kLanes per two positions
  float* top;        // kLanes: each head's running maximum
  float* sum;        // kLanes: each head's sum of weights
  float* acc;        // the heads' accumulators, 32 NV floats each
};

// One vector of eight 16-lane vectors' sums, lane r holding the sum of a[r]'s lanes: pairs of
// vectors interleaved and added within 128-bit lanes twice (each 128-bit lane then holds four
// vectors' partial sums), then the 128-bit lanes added across: 24 instructions, where folding
// each vector to 8 lanes first and reducing those (lane_sums) took 37.
inline v8 sums_of_eight(const __m512 (&a)[kLanes]) {
  __m512 pairs[4];
  for (int i = 0; i < 4; ++i)  // lane 4k + (0, 1, 2, 3): a[2i], a[2i + 1], a[2i], a[2i + 1]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  __m512 quads[2];
  for (int i = 0; i < 2; ++i)  // lane 4k + j: a[4i + j]'s sum over the 128-bit lane k
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  // 128-bit lanes (q0 k0 + k2, q0 k1 + k3, q1 k0 + k2, q1 k1 + k3), then k0 + k1 per half
  const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                 _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
  const __m512 y = _mm512_shuffle_f32x4(x, x, 0xD8);  // (q0 k02, q1 k02, q0 k13, q1 k13)
  const __m256 sums = _mm256_add_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
  v8 out;
  std::memcpy(&out, &sums, sizeof(v8));
  return out;
}

// Positions ahead whose key lines a run's scores prefetch, for narrow heads (key and rope parts
// of at most three chunks together, four heads a pass): the hardware cannot foresee a gathered
// row. On Zen 4, 2048 queries over 2048 of 16K positions took 4-5% less time at 4 than without
// at 8 heads of 96/64 (more at 2, 6 or 12), but not at 16 heads of 192/128 (with it 0.42-0.52
// s, without 0.38-0.49 s over four alternating runs; their runs a sixth as long, eight lines a
// position a pass), where it is off.
constexpr int64_t kAhead = 4;

// g.w[r * kLanes + l] = head h0 + l's scaled score at position p[r], r < c: NK chunks of the
// key part, NR of the rope part. A group of kLanes heads goes in register tiles of TH heads
// (their query chunks held in registers over the run) by 8 / TH positions, whose eight dot
// products are reduced together; a group of fewer heads position by position, its spare
// lanes copying its last head's sums (no work of their own).
template <int NK, int NR>
void group_scores(const Inputs<bf16>& in, const GroupRun& g, const int64_t* p, int64_t c) {
  constexpr int NQ = NK + NR;
  constexpr int TH = NQ <= 3 ? 4 : 2, TP = kLanes / TH;
  constexpr bool kPrefetch = NQ <= 3;
  __mmask32 kmask[NK], rmask[NR > 0 ? NR : 1];
  for (int j = 0; j < NK; ++j) kmask[j] = chunk_mask(in.dk, j);
  for (int j = 0; j < NR; ++j) rmask[j] = chunk_mask(in.dr, j);
  const int64_t stride = in.sk1;
  const auto dot = [&](const bf16* kh, const __m512i* rope, const __m512i* qv) {
    __m512 acc = _mm512_setzero_ps();
    for (int j = 0; j < NK; ++j)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(kmask[j], kh + 32 * j),
                             (__m512bh)qv[j]);
    for (int j = 0; j < NR; ++j)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)rope[j], (__m512bh)qv[NK + j]);
    return acc;  // its 16 lanes sum to the dot product
  };
  const auto load_rope = [&](int64_t pos, __m512i* rope) {
    const bf16* rp = in.rope + pos * in.sr0;
    for (int j = 0; j < NR; ++j) rope[j] = _mm512_maskz_loadu_epi16(rmask[j], rp + 32 * j);
  };
  constexpr int NRV = NR > 0 ? NR : 1;
  if (g.heads == kLanes) {
    for (int64_t hb = 0; hb < kLanes; hb += TH) {
      __m512i qv[TH][NQ];
      for (int i = 0; i < TH; ++i)
        for (int j = 0; j < NQ; ++j)
          qv[i][j] = _mm512_loadu_si512(g.q + (hb + i) * NQ * 32 + 32 * j);
      const bf16* k0 = in.k + (g.h0 + hb) * stride;
      for (int64_t r = 0; r < c; r += TP) {
        __m512 dots[kLanes];
        for (int t = 0; t < TP; ++t) {
          if (kPrefetch && r + t + kAhead < c) {  // the key lines this pass reads, ahead
            const bf16* ahead = k0 + p[r + t + kAhead] * in.sk0;
            for (int i = 0; i < TH; ++i)
              for (int j = 0; j < NK; ++j)
                _mm_prefetch(reinterpret_cast<const char*>(ahead + i * stride + 32 * j),
                             _MM_HINT_T0);
            if (hb == 0)
              for (int j = 0; j < NR; ++j)
                _mm_prefetch(reinterpret_cast<const char*>(in.rope + p[r + t + kAhead] * in.sr0 +
                                                           32 * j),
                             _MM_HINT_T0);
          }
          const int64_t pos = p[std::min(r + t, c - 1)];  // past c: the last again, dropped
          __m512i rope[NRV];
          load_rope(pos, rope);
          const bf16* kp = k0 + pos * in.sk0;
          for (int i = 0; i < TH; ++i) dots[t * TH + i] = dot(kp + i * stride, rope, qv[i]);
        }
        const v8 sums = sums_of_eight(dots) * splat(in.scale);
        for (int t = 0; t < TP && r + t < c; ++t)
          std::memcpy(g.w + (r + t) * kLanes + hb, reinterpret_cast<const float*>(&sums) + t * TH,
                      TH * sizeof(float));
      }
    }
    return;
  }
  const bf16* k0 = in.k + g.h0 * stride;
  for (int64_t r = 0; r < c; ++r) {
    __m512i rope[NRV];
    load_rope(p[r], rope);
    const bf16* kp = k0 + p[r] * in.sk0;
    __m512 dots[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      if (l >= g.heads) {  // a spare lane: its last head's score again, no dot product
        dots[l] = dots[g.heads - 1];
        continue;
      }
      __m512i qv[NQ];
      for (int j = 0; j < NQ; ++j) qv[j] = _mm512_loadu_si512(g.q + l * NQ * 32 + 32 * j);
      dots[l] = dot(kp + l * stride, rope, qv);
    }
    store8(g.w + r * kLanes, sums_of_eight(dots) * splat(in.scale));
  }
}

// The run's scores into weights e^(score - top) lane by lane (head by head), against each
// head's running maximum (what was summed shrinks when it grows: its sum and accumulator, len
// floats); their sums added to g.sum, and the weights as bfloat16 pairs of positions: g.pairs
// [r / 2 * kLanes + l] holds head l's weights at r (low half) and r + 1 (zero past c). Two
// positions a 16-lane vector, the weights paired as they are made: 6% of the kernel's time on
// a 16K prompt on Zen 4, where e^x in eight lanes, stored, then read again to pair them took
// 7%.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

void group_weigh(const GroupRun& g, int64_t c, int64_t len) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  __m512 most2 = _mm512_set1_ps(neg_inf);
  for (int64_t r = 0; r < c; r += 2) {
    const __mmask16 m = r + 1 < c ? 0xffff : 0x00ff;
    most2 = _mm512_mask_max_ps(most2, m, most2, _mm512_maskz_loadu_ps(m, g.w + r * kLanes));
  }
  const __m256 folded =
      _mm256_max_ps(_mm512_castps512_ps256(most2), _mm512_extractf32x8_ps(most2, 1));
  v8 most;
  std::memcpy(&most, &folded, sizeof(most));
  for (int64_t l = 0; l < kLanes; ++l)  // spare lanes too: they follow the last head
    if (most[l] > g.top[l]) {
      const float shrink = std::exp(g.top[l] - most[l]);  // 0 on the first run
      g.sum[l] *= shrink;
      if (l < g.heads)
        for (float *acc = g.acc + l * len, *end = acc + len; acc < end; ++acc) *acc *= shrink;
      g.top[l] = most[l];
    }
  const __m512 top = _mm512_broadcast_f32x8(_mm256_loadu_ps(g.top));
  // word 2l of a pair of positions' eight heads: head l at r, word 2l + 1: head l at r + 1
  static constexpr int16_t kPairing[32] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};
  const __m512i pairing = _mm512_loadu_si512(kPairing);
  __m512 total = _mm512_setzero_ps();
  for (int64_t r = 0; r < c; r += 2) {  // rounded to nearest even
    const __mmask16 m = r + 1 < c ? 0xffff : 0x00ff;
    // past c: x = 0 (a score equal to the maximum; e^x is masked away below)
    const __m512 x = _mm512_sub_ps(_mm512_mask_loadu_ps(top, m, g.w + r * kLanes), top);
    v16 xv;
    std::memcpy(&xv, &x, sizeof(xv));
    const v16 ev = vec8::exp_lanes<v16, v16i>(xv);
    __m512 e;
    std::memcpy(&e, &ev, sizeof(e));
    e = _mm512_maskz_mov_ps(m, e);  // past c: no weight
    total = _mm512_add_ps(total, e);
    const __m512i both = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(e));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(g.pairs + r / 2 * kLanes),
                        _mm512_castsi512_si256(_mm512_permutexvar_epi16(pairing, both)));
  }
  const __m256 sums =
      _mm256_add_ps(_mm512_castps512_ps256(total), _mm512_extractf32x8_ps(total, 1));
  _mm256_storeu_ps(g.sum, _mm256_add_ps(_mm256_loadu_ps(g.sum), sums));
}

// HV heads' accumulators (2 NV vectors each, permuted) += sum_r w[r] v[p[r], h] over the run,
// for heads h = h0 + i, i < HV: acc + i * 32 NV, pairs[r / 2 * kLanes + i] its weights at r and
// r + 1. The heads of a position are neighbours in its row, so HV of them read together share
// its address and fill 2 NV HV independent chains of multiply-adds.
template <int NV, int HV>
void head_values(const Inputs<bf16>& in, const int64_t* p, int64_t c, int64_t h0,
                 const uint32_t* pairs, float* acc) {
  __m512 a[HV][2 * NV];
  __mmask32 mask[NV];
  for (int j = 0; j < NV; ++j) mask[j] = chunk_mask(in.dv, j);
  for (int i = 0; i < HV; ++i)
    for (int j = 0; j < 2 * NV; ++j) a[i][j] = _mm512_loadu_ps(acc + i * 32 * NV + 16 * j);
  const bf16* v = in.v + h0 * in.sv1;
  for (int64_t r = 0; r < c; r += 2) {
    const bf16* v0 = v + p[r] * in.sv0;
    const bf16* v1 = r + 1 < c ? v + p[r + 1] * in.sv0 : nullptr;
    for (int i = 0; i < HV; ++i) {
      const __m512bh wp =
          (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pairs[r / 2 * kLanes + i]));
      for (int j = 0; j < NV; ++j) {
        __m512i lo, hi;
        bf16_pairs::interleave(v0 + i * in.sv1, v1 ? v1 + i * in.sv1 : nullptr, j, mask[j], lo,
                               hi);
        a[i][2 * j] = _mm512_dpbf16_ps(a[i][2 * j], (__m512bh)lo, wp);
        a[i][2 * j + 1] = _mm512_dpbf16_ps(a[i][2 * j + 1], (__m512bh)hi, wp);
      }
    }
  }
  for (int i = 0; i < HV; ++i)
    for (int j = 0; j < 2 * NV; ++j) _mm512_storeu_ps(acc + i * 32 * NV + 16 * j, a[i][j]);
}

// A group of heads of one query over a run of c positions p[0 .. c).
template <int NK, int NR, int NV>
void group_run(const Inputs<bf16>& in, const GroupRun& g, const int64_t* p, int64_t c) {
  group_scores<NK, NR>(in, g, p, c);
  group_weigh(g, c, 32 * NV);
  constexpr int HV = NV == 1 ? 4 : NV == 2 ? 2 : 1;  // 8 accumulators at most
  int64_t l = 0;
  for (; l + HV <= g.heads; l += HV)
    head_values<NV, HV>(in, p, c, g.h0 + l, g.pairs + l, g.acc + l * 32 * NV);
  for (; l < g.heads; ++l)
    head_values<NV, 1>(in, p, c, g.h0 + l, g.pairs + l, g.acc + l * 32 * NV);
}

using GroupRunFn = void (*)(const Inputs<bf16>&, const GroupRun&, const int64_t*, int64_t);

template <int NK, int NR, int... NV>
constexpr std::array<GroupRunFn, sizeof...(NV)> runs_of(std::integer_sequence<int, NV...>) {
  return {&group_run<NK, NR, NV + 1>...};
}

template <int NK, int... NR>
constexpr std::array<std::array<GroupRunFn, kMaxValueChunks>, sizeof...(NR)> runs_by_rope(
    std::integer_sequence<int, NR...>) {
  return {runs_of<NK, NR>(std::make_integer_sequence<int, kMaxValueChunks>{})...};
}

template <int... NK>
constexpr auto run_table(std::integer_sequence<int, NK...>) {
  return std::array{
      runs_by_rope<NK + 1>(std::make_integer_sequence<int, kMaxRopeChunks + 1>{})...};
}

// The instantiation for the inputs' widths (bf16_form(in) must hold).
inline GroupRunFn group_run_for(const Inputs<bf16>& in) {
  static constexpr auto table = run_table(std::make_integer_sequence<int, kMaxKeyChunks>{});
  return table[chunks(in.dk) - 1][chunks(in.dr)][chunks(in.dv) - 1];
}
#else
using GroupRunFn = void*;  // no Bf16Form in this build
#endif

// Queries q0 .. q1 - 1, every head, sweeping the positions block by block.
template <typename T>
void task(const Inputs<T>& in, Scratch& s, int64_t q0, int64_t q1) {
  const int64_t m = q1 - q0, H = in.H, dq = in.dk + in.dr, dv = in.dv;
  // the Bf16Form's instantiation for these widths (its accumulators 32 channels a chunk), or
  // none: head_run on float32 (bfloat16 widened) with the query scaled in float32
  GroupRunFn fast = nullptr;
#ifdef PIPESERVE_BF16_PAIRS
  if constexpr (std::is_same_v<T, bf16>)
    if (bf16_form(in)) fast = group_run_for(in);
#endif
  const int64_t per_position = (H * (in.dk + dv) + in.dr) * static_cast<int64_t>(sizeof(T));
  const int64_t block =
      fast ? std::clamp<int64_t>(l2_bytes() / per_position / 16 * 16, 16, 1024) : kBlock;
  // each query's chosen positions ascending, the -1s dropped: its own row where that is already
  // so (the indexer's rows: ascending, any -1s at the end), else a sorted copy in s.pos (its
  // copies first, their addresses after: s.pos may grow)
  s.next.resize(m);
  s.end.resize(m);
  s.copied.clear();
  int64_t last = -1, kept = 0;
  for (int64_t t = 0; t < m; ++t) {
    const int64_t* chosen = in.pos + (q0 + t) * in.topk;
    int64_t len = in.topk;
    while (len > 0 && chosen[len - 1] == -1) --len;
    bool clean = true;  // in range and ascending (checked here, on every thread, before any read)
    for (int64_t j = 0; j < len; ++j) clean &= (chosen[j] >= 0) & (chosen[j] < in.keys);
    for (int64_t j = 1; j < len; ++j) clean &= chosen[j - 1] <= chosen[j];
    if (clean) {
      s.next[t] = chosen;
      s.end[t] = chosen + len;
    } else {
      const int64_t at = s.copied.empty() ? 0 : s.copied.back().second;
      s.pos.resize(std::max(s.pos.size(), static_cast<size_t>(at + in.topk)));
      int64_t* copy = s.pos.data() + at;
      int64_t n = 0;
      bool outside = false;
      for (int64_t j = 0; j < in.topk; ++j) {
        copy[n] = chosen[j];
        n += chosen[j] >= 0;
        outside |= (chosen[j] < -1) | (chosen[j] >= in.keys);
      }
      TORCH_CHECK(!outside, "a chosen position is outside the keys");
      std::sort(copy, copy + n);
      s.copied.emplace_back(t, at + n);
    }
  }
  for (size_t i = 0; i < s.copied.size(); ++i) {
    const int64_t t = s.copied[i].first, from = i ? s.copied[i - 1].second : 0;
    s.next[t] = s.pos.data() + from;
    s.end[t] = s.pos.data() + s.copied[i].second;
  }
  for (int64_t t = 0; t < m; ++t) {
    kept += s.end[t] - s.next[t];
    if (s.end[t] != s.next[t]) last = std::max(last, *(s.end[t] - 1));
  }
  s.read += kept;
  const int64_t acc_len = fast ? 32 * ((dv + 31) / 32) : dv;
  const int64_t hp = (H + kLanes - 1) / kLanes * kLanes;  // a query's heads in whole groups
  if (!fast) {
    s.q.resize(m * H * dq);
    for (int64_t j = 0; j < m * H * dq; ++j)
      s.q[j] = static_cast<float>(in.q[q0 * H * dq + j]) * in.scale;
  }
#ifdef PIPESERVE_BF16_PAIRS
  // the Bf16Form's queries: each head's key part, then its rope part, in zero-padded chunks
  const int64_t nk = chunks(in.dk), qw = 32 * (nk + chunks(in.dr));
  if constexpr (std::is_same_v<T, bf16>) if (fast) {
    s.qb.assign(m * H * qw, bf16(0.f));
    for (int64_t th = 0; th < m * H; ++th) {
      const bf16* src = in.q + (q0 * H + th) * dq;
      std::copy(src, src + in.dk, s.qb.begin() + th * qw);
      std::copy(src + in.dk, src + dq, s.qb.begin() + th * qw + 32 * nk);
    }
    s.pairs.resize((in.topk / 2 + 1) * kLanes);
  }
#endif
  s.acc.assign(m * H * acc_len, 0.f);
  s.sums.assign(m * hp, 0.f);
  s.top.assign(m * hp, -std::numeric_limits<float>::infinity());
  // a run: at most a query's choice (a repeated position); the Bf16Form's a vector a position
  s.w.resize(fast ? (in.topk + 2) * kLanes : in.topk + 16);
  // positions in spans that stay in L3 (each read from memory once per task), within a span
  // tiles of queries whose state stays in L2 while they sweep its blocks
  const int64_t span = std::max<int64_t>(1, kSpanBytes / per_position / block) * block;
  const int64_t tile = tile_queries(H, dv);
  for (int64_t s0 = 0; s0 <= last; s0 += span) {
    const int64_t s1 = std::min(s0 + span, last + 1), blocks = (s1 - s0 + block - 1) / block;
    // where each query's run in each of the span's blocks ends: ends[t * blocks + b] is one
    // past its last position before s0 + (b + 1) * block, in one walk along its list (a
    // galloping search per run, from a list the task's other queries had pushed out of cache,
    // was 46% of the samples outside the runs themselves on a 16K prompt on Zen 4; the walk
    // took 1-3% off the kernel's time)
    s.ends.resize(std::max(s.ends.size(), static_cast<size_t>(m * blocks)));
    for (int64_t t = 0; t < m; ++t) {
      const int64_t *j = s.next[t], *end = s.end[t];
      for (int64_t b = 0, bound = s0 + block; b < blocks; ++b, bound += block) {
        while (end - j >= 8 && j[7] < bound) j += 8;  // eight at a time, then one by one
        while (j < end && *j < bound) ++j;
        s.ends[t * blocks + b] = j;
      }
    }
    for (int64_t t0 = 0; t0 < m; t0 += tile) {
      const int64_t t1 = std::min(m, t0 + tile);
      for (int64_t b0 = s0; b0 < s1; b0 += block) {
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t *c0 = s.next[t], *c1 = s.ends[t * blocks + (b0 - s0) / block];
          if (c1 == c0) continue;
          s.next[t] = c1;
#ifdef PIPESERVE_BF16_PAIRS
          if constexpr (std::is_same_v<T, bf16>)
            if (fast) {
              for (int64_t h0 = 0; h0 < H; h0 += kLanes) {
                const int64_t th = t * H + h0;
                const GroupRun g{s.qb.data() + th * qw, h0, std::min<int64_t>(kLanes, H - h0),
                                 s.w.data(), s.pairs.data(), s.top.data() + t * hp + h0,
                                 s.sums.data() + t * hp + h0, s.acc.data() + th * acc_len};
                fast(in, g, c0, c1 - c0);
              }
              continue;
            }
#endif
          for (int64_t h = 0; h < H; ++h) {
            const int64_t th = t * H + h;
            head_run(in, s.q.data() + th * dq, c0, c1 - c0, h, s.w.data(),
                     s.top[t * hp + h], s.sums[t * hp + h], s.acc.data() + th * dv);
          }
        }
      }
    }
  }
  for (int64_t th = 0; th < m * H; ++th) {
    T* out = in.out + (q0 * H + th) * dv;
    const float* acc = s.acc.data() + th * acc_len;
    const float sum = s.sums[th / H * hp + th % H];
    const float inv = sum > 0.f ? 1.f / sum : 0.f;  // nothing chosen: zeros
#ifdef PIPESERVE_BF16_PAIRS
    if (fast) {
      for (int64_t j = 0; j < dv; ++j) out[j] = static_cast<T>(acc[lane_of(j)] * inv);
      continue;
    }
#endif
    for (int64_t j = 0; j < dv; ++j) out[j] = static_cast<T>(acc[j] * inv);
  }
}

template <typename T>
int64_t run(const Inputs<T>& in) {
  if (in.n == 0) return 0;
  // equal tasks, a whole number of them per thread: a query that sees more than topk positions
  // costs what every other does, so 1820 queries on 2 threads go in 4 tasks of 455, not 3 of 512
  // and one of 284 (one thread idle for a fifth of the call)
  const int64_t threads = at::get_num_threads();
  const int64_t rounds = (in.n + kMaxTask * threads - 1) / (kMaxTask * threads);
  const int64_t per = std::max<int64_t>(1, (in.n + rounds * threads - 1) / (rounds * threads));
  std::atomic<int64_t> read{0};
  // each thread's scratch kept between calls (up to prefill::kKeptScratchBytes: ~8 MiB at
  // kMaxTask queries of 16 heads of 192/128 when the positions are read in place, ~16 MiB when
  // every query's are copied), so its pages are not faulted in again on every call
  prefill::run_tasks(
      in.n, 1, per,
      []() -> Scratch& {
        thread_local Scratch kept;
        return kept;
      },
      [&](Scratch& s, int64_t, int64_t q0, int64_t q1) {
        task(in, s, q0, q1);
        read += s.read;
        s.read = 0;
        prefill::trim_scratch(s.pos, s.copied, s.next, s.end, s.ends, s.q, s.acc, s.top,
                              s.sums, s.w, s.qb, s.pairs);
      });
  return read.load();
}

}  // namespace

at::Tensor sparse_expanded_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor rope,
                                     at::Tensor positions, double scale, at::Tensor keys_read) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && positions.dim() == 2,
              "q [n,H,dk+dr], k [L,H,dk], v [L,H,dv], positions [n,topk] expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "sparse_expanded_attention takes float32 or bfloat16");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k and v must have one dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  TORCH_CHECK(keys_read.scalar_type() == at::kLong && keys_read.numel() == 1 &&
                  keys_read.is_contiguous(),
              "keys_read must be one int64");
  const int64_t n = q.size(0), H = q.size(1), L = k.size(0), dk = k.size(2), dv = v.size(2);
  TORCH_CHECK(k.size(1) == H && v.size(1) == H && v.size(0) == L,
              "k and v must be [L, H, d] with q's heads");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "each head's key and value must be contiguous");
  const bool shared = rope.numel() > 0;
  const int64_t dr = shared ? rope.size(1) : 0;
  if (shared) {
    TORCH_CHECK(rope.dim() == 2 && rope.size(0) == L && rope.stride(1) == 1,
                "rope must be [L, dr] with contiguous rows");
    TORCH_CHECK(rope.scalar_type() == q.scalar_type(), "rope must have q's dtype");
  }
  TORCH_CHECK(q.size(2) == dk + dr, "q must be as wide as a key with its rope part");
  TORCH_CHECK(positions.size(0) == n, "positions must have one row per query");
  q = q.contiguous();
  positions = positions.contiguous();
  const int64_t topk = positions.size(1);
  const int64_t* pp = positions.data_ptr<int64_t>();  // each task checks its queries' own
  at::Tensor out = at::empty({n, H, dv}, q.options());
  const float sc = static_cast<float>(scale);
  int64_t read = 0;
  const auto launch = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* rp = shared ? rope.data_ptr<T>() : nullptr;
    Inputs<T> in{q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), rp, pp, out.data_ptr<T>(),
                 n, H, dk, dr, dv, topk, L, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                 shared ? rope.stride(0) : 0, sc};
    read = run(in);
  };
  if (q.scalar_type() == at::kFloat) {
    launch(static_cast<float*>(nullptr));
  } else {
    launch(static_cast<c10::BFloat16*>(nullptr));
  }
  *keys_read.data_ptr<int64_t>() += read;
  return out;
}
