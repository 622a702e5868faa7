// DeepSeek-V3.2's sparse attention in latent space (pipeserve/layers/mla.py, absorbed form):
// each query attends, in every head, to the cache rows its indexer chose and to no other,
//
//   out[i, h] = sum_{s in S_i} softmax_s(scale * q[i, h] . row[s]) row[s][:rank]
//
// with S_i = {slots[i, t] : slots[i, t] >= 0} (a set in any order, -1 for none). q [n, H, W] is
// the absorbed query (q_nope W_UK | q_rope), rows [N, W] the latent cache ([latent | rope] per
// position, keys and values alike: one key head shared by all H heads, MQA), read in place at
// the chosen slots: no gathered copy and no [n, L] mask exist, and the work is O(n * |S_i|)
// whatever the context is.
//
// Queries are independent (tasks of kQueries on every thread). For one query the H heads are
// the rows of a small matrix product with its chosen rows: scores [H, c] = q [H, W] . rows^T
// in register tiles of 4 heads x 2 rows (each row vector loaded serves four heads, each query
// vector two rows), the softmax per head over its c scores (2^x polynomial, vectorised over
// the rows), then out [H, rank] = p [H, c] . rows[:, :rank] over tiles of 8 rows, in register
// blocks of 2 heads x 4 rows (each row vector loaded feeds both heads, each output vector is
// loaded and stored once per 4 rows: 1.0 memory operations per multiply-add, against 1.25
// for one head at a time, which had the kernel waiting on loads). The query block
// (H x W floats) stays in L1; rows are prefetched ahead, as the chosen ones are scattered.
// Rows may be strided (a view of wider rows: the first W values of each are read).
// Plain C++ with GCC's vector extension (8 float lanes: AVX2 here, AVX512 registers half used),
// compiled for the machine; bfloat16 rows on CPUs with AVX512-BF16 take the Bf16Form instead
// (vdpbf16ps for the scores and the values, below). The (query, row) pairs read are counted, so
// tests can check that no more than the chosen ones were.
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16_pairs.h"
#include "prefill_common.h"
#include "vec8.h"

namespace {

constexpr int64_t kQueries = 4;  // queries per task (with every head)
constexpr int64_t kLanes = vec8::kLanes;
constexpr int64_t kAhead = 24;  // rows ahead whose lines are prefetched
constexpr int64_t kHeadTile = 4;  // scores: heads x rows per register tile
constexpr int64_t kRowTile = 2;
constexpr int64_t kTile = 8;  // rows per pass: scored, weighted, added (one vector of weights)

using vec8::exp8;
using vec8::lanes_sum;
using vec8::load8;
using vec8::prefetch_span;
using vec8::splat;
using vec8::store8;
using vec8::v8;

template <typename T>
struct Inputs {
  const T* q;
  const T* rows;
  const int64_t* slots;
  T* out;
  int64_t n, H, W, rank, topk, N, stride;  // stride: between rows
  float scale;
};

struct Scratch {
  std::vector<float> q;       // [H, W] the query, scaled, float32
  std::vector<int64_t> keys;  // its chosen slots
  std::vector<float> tile;    // [H, kTile]: a tile's scores, then weights
  std::vector<float> top;     // [H]: each head's running maximum
  std::vector<float> acc;     // [H, rank] (the Bf16Form's: 32 floats a chunk of rank)
  std::vector<float> sums;    // [H]: each head's sum of weights
  std::vector<int16_t> pairs;  // the Bf16Form's interleaved rows of a tile (from a 64-byte line)
  int64_t read = 0;           // (query, row) pairs read by this thread
};

// Whether rows of this storage take the Bf16Form (bfloat16 where the build has vdpbf16ps).
template <typename T>
constexpr bool kPairs =
#ifdef PIPESERVE_BF16_PAIRS
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// Floats a head's accumulator holds.
template <typename T>
int64_t acc_len(int64_t rank) {
  return kPairs<T> ? 32 * ((rank + 31) / 32) : rank;
}

// Scores of heads h0 .. h0 + HT - 1 against rows row[0 .. RT): HT x RT vector sums over W,
// then one horizontal sum each, into sc[h * kTile + r0 + r].
template <typename T, int HT, int RT>
inline void score_tile(const Inputs<T>& in, const float* q, const T* const* row, int64_t h0,
                       int64_t r0, float* sc) {
  const int64_t W = in.W, body = W - W % kLanes;
  v8 acc[HT][RT] = {};
  for (int64_t j = 0; j < body; j += kLanes) {
    v8 rv[RT];
    for (int r = 0; r < RT; ++r) rv[r] = load8(row[r] + j);
    for (int h = 0; h < HT; ++h) {
      const v8 qv = load8(q + (h0 + h) * W + j);
      for (int r = 0; r < RT; ++r) acc[h][r] += qv * rv[r];
    }
  }
  for (int h = 0; h < HT; ++h)
    for (int r = 0; r < RT; ++r) {
      float dot = lanes_sum(acc[h][r]);
      for (int64_t j = body; j < W; ++j) dot += q[(h0 + h) * W + j] * static_cast<float>(row[r][j]);
      sc[(h0 + h) * kTile + r0 + r] = dot;
    }
}

// Scores of every head against rows row[r0 .. r0 + RT) (they stay in L1 across the heads).
template <typename T, int RT>
inline void score_rows(const Inputs<T>& in, const float* q, const T* const* row, int64_t r0,
                       int64_t hb, int64_t he, float* sc) {
  int64_t h0 = hb;
  for (; h0 + kHeadTile <= he; h0 += kHeadTile)
    score_tile<T, kHeadTile, RT>(in, q, row + r0, h0, r0, sc);
  for (; h0 < he; ++h0) score_tile<T, 1, RT>(in, q, row + r0, h0, r0, sc);
}

// acc[h, :rank] += sum_t w[h * kTile + t] * row[t][:rank], t < R, every head
template <typename T, int R>
inline void value_tile(const Inputs<T>& in, const T* const* row, const float* w, int64_t hb,
                       int64_t he, float* accs) {
  const int64_t rank = in.rank, body = rank - rank % kLanes;
  for (int64_t h = hb; h < he; ++h) {
    v8 wv[R];
    for (int t = 0; t < R; ++t) wv[t] = splat(w[h * kTile + t]);
    float* acc = accs + h * rank;
    for (int64_t j = 0; j < body; j += kLanes) {
      v8 a = load8(acc + j);
      for (int t = 0; t < R; ++t) a += wv[t] * load8(row[t] + j);
      store8(acc + j, a);
    }
    for (int64_t j = body; j < rank; ++j)
      for (int t = 0; t < R; ++t) acc[j] += w[h * kTile + t] * static_cast<float>(row[t][j]);
  }
}

// acc[h, :rank] += sum_t w[h * kTile + t] * row[t][:rank] for heads h0 .. h0 + HP - 1 and
// rows t < RT: a register block of HP x RT weights, each row vector loaded feeding HP heads,
// each head's output vector loaded and stored once per RT rows.
template <typename T, int HP, int RT>
inline void value_block(const Inputs<T>& in, const T* const* row, const float* w, int64_t h0,
                        float* accs) {
  const int64_t rank = in.rank, body = rank - rank % kLanes;
  v8 wv[HP][RT];
  for (int h = 0; h < HP; ++h)
    for (int t = 0; t < RT; ++t) wv[h][t] = splat(w[(h0 + h) * kTile + t]);
  for (int64_t j = 0; j < body; j += kLanes) {
    v8 a[HP];
    for (int h = 0; h < HP; ++h) a[h] = load8(accs + (h0 + h) * rank + j);
    for (int t = 0; t < RT; ++t) {
      const v8 r = load8(row[t] + j);
      for (int h = 0; h < HP; ++h) a[h] += wv[h][t] * r;
    }
    for (int h = 0; h < HP; ++h) store8(accs + (h0 + h) * rank + j, a[h]);
  }
  for (int h = 0; h < HP; ++h)
    for (int64_t j = body; j < rank; ++j)
      for (int t = 0; t < RT; ++t)
        accs[(h0 + h) * rank + j] += w[(h0 + h) * kTile + t] * static_cast<float>(row[t][j]);
}

// A whole tile of kTile rows into every head hb .. he - 1: blocks of 2 heads x 4 rows (8
// weights, 2 outputs and a row in 11 of AVX2's 16 registers), a last odd head alone.
template <typename T>
inline void value_full_tile(const Inputs<T>& in, const T* const* row, const float* w,
                            int64_t hb, int64_t he, float* accs) {
  static_assert(kTile == 8, "two halves of 4 rows");
  int64_t h = hb;
  for (; h + 2 <= he; h += 2) {
    value_block<T, 2, 4>(in, row, w, h, accs);
    value_block<T, 2, 4>(in, row + 4, w + 4, h, accs);
  }
  if (h < he) value_tile<T, kTile>(in, row, w, h, he, accs);
}

#ifdef PIPESERVE_BF16_PAIRS
// bfloat16 rows on CPUs with AVX512-BF16 (the Bf16Form), one_query's tile by vdpbf16ps: the
// scores of a 4-head x 2-row register tile by one vdpbf16ps per chunk of 32 values (the query's
// own bfloat16, scaled after the sum); the values two rows at a time, interleaved once per tile
// and added to every head with its two weights rounded to bfloat16 as a pair (as transformers'
// bfloat16 attention rounds its weights), the head's accumulator in the channel order the
// interleave leaves (bf16_pairs::lane_of), put in order when the output is written.
using bf16 = c10::BFloat16;
using bf16_pairs::chunk_mask;
using bf16_pairs::chunks;

template <int HT, int RT>
inline void score_tile_bf16(const Inputs<bf16>& in, const bf16* q, const bf16* const* row,
                            int64_t h0, int64_t r0, float* sc) {
  const int64_t W = in.W, nc = chunks(W);
  const bf16* qh[HT];
  const bf16* rr[RT];
  __m512 acc[HT][RT];
  for (int h = 0; h < HT; ++h) {
    qh[h] = q + (h0 + h) * W;
    for (int r = 0; r < RT; ++r) acc[h][r] = _mm512_setzero_ps();
  }
  for (int r = 0; r < RT; ++r) rr[r] = row[r];
  for (int64_t j = 0; j < nc; ++j) {
    const __mmask32 m = chunk_mask(W, j);
    __m512i rv[RT];
    for (int r = 0; r < RT; ++r) rv[r] = _mm512_maskz_loadu_epi16(m, rr[r] + 32 * j);
    for (int h = 0; h < HT; ++h) {
      const __m512i qv = _mm512_maskz_loadu_epi16(m, qh[h] + 32 * j);
      for (int r = 0; r < RT; ++r)
        acc[h][r] = _mm512_dpbf16_ps(acc[h][r], (__m512bh)qv, (__m512bh)rv[r]);
    }
  }
  for (int h = 0; h < HT; ++h)
    for (int r = 0; r < RT; ++r)
      sc[(h0 + h) * kTile + r0 + r] = _mm512_reduce_add_ps(acc[h][r]) * in.scale;
}

template <int RT>
inline void score_rows_bf16(const Inputs<bf16>& in, const bf16* q, const bf16* const* row,
                            int64_t r0, int64_t hb, int64_t he, float* sc) {
  int64_t h0 = hb;
  for (; h0 + kHeadTile <= he; h0 += kHeadTile)
    score_tile_bf16<kHeadTile, RT>(in, q, row + r0, h0, r0, sc);
  for (; h0 < he; ++h0) score_tile_bf16<1, RT>(in, q, row + r0, h0, r0, sc);
}

// acc[h] (32 floats a chunk of rank, lane_of's order) += sum_t w[h * kTile + t] row[t][:rank],
// t < R, every head hb .. he - 1; pairs: scratch for the tile's interleaved rows (kTile x
// chunks(rank) vectors of 32 values).
inline void value_tile_bf16(const Inputs<bf16>& in, const bf16* const* row, int64_t R,
                            const float* w, int64_t hb, int64_t he, float* accs, int16_t* pairs) {
  const auto pair = [&](int64_t v) { return (__m512bh)_mm512_loadu_si512(pairs + 32 * v); };
  const int64_t nc = chunks(in.rank), len = 32 * nc, np = (R + 1) / 2;
  for (int64_t p = 0; p < np; ++p)
    for (int64_t j = 0; j < nc; ++j) {
      __m512i lo, hi;
      const bf16* second = 2 * p + 1 < R ? row[2 * p + 1] : nullptr;
      bf16_pairs::interleave(row[2 * p], second, j, chunk_mask(in.rank, j), lo, hi);
      _mm512_storeu_si512(pairs + 32 * ((p * nc + j) * 2), lo);
      _mm512_storeu_si512(pairs + 32 * ((p * nc + j) * 2 + 1), hi);
    }
  for (int64_t h = hb; h < he; ++h) {
    __m512bh wp[kTile / 2];  // the head's weights, a pair of rows in each 32-bit lane
    alignas(16) bf16 wb[kTile];
    _mm_store_si128(reinterpret_cast<__m128i*>(wb),
                    (__m128i)_mm256_cvtneps_pbh(_mm256_loadu_ps(w + h * kTile)));
    for (int64_t p = 0; p < np; ++p) {
      int32_t two;
      std::memcpy(&two, wb + 2 * p, sizeof(two));  // a lone last row's partner: zeros
      wp[p] = (__m512bh)_mm512_set1_epi32(two);
    }
    float* acc = accs + h * len;
    if (np == kTile / 2) {  // a whole tile: two chains of two pairs each, then their sum
      for (int64_t v = 0; v < 2 * nc; ++v) {
        __m512 a = _mm512_dpbf16_ps(_mm512_loadu_ps(acc + 16 * v), pair(v), wp[0]);
        __m512 b = _mm512_dpbf16_ps(_mm512_setzero_ps(), pair(v + 2 * nc), wp[1]);
        a = _mm512_dpbf16_ps(a, pair(v + 4 * nc), wp[2]);
        b = _mm512_dpbf16_ps(b, pair(v + 6 * nc), wp[3]);
        _mm512_storeu_ps(acc + 16 * v, _mm512_add_ps(a, b));
      }
      continue;
    }
    for (int64_t v = 0; v < 2 * nc; ++v) {
      __m512 a = _mm512_loadu_ps(acc + 16 * v);
      for (int64_t p = 0; p < np; ++p) a = _mm512_dpbf16_ps(a, pair(p * 2 * nc + v), wp[p]);
      _mm512_storeu_ps(acc + 16 * v, a);
    }
  }
}
#endif

// Query i's heads hb .. he - 1 over its chosen rows in one pass, kTile rows at a time (an
// online softmax: each head's running maximum, its sums rescaled when the maximum grows):
// each row is read once, scored by the heads and added to their values while it is in L1.
template <typename T>
void one_query(const Inputs<T>& in, int64_t i, int64_t hb, int64_t he, Scratch& s) {
  const int64_t H = in.H, W = in.W, rank = in.rank, len = acc_len<T>(rank);
  s.keys.clear();
  bool outside = false;  // checked here, on every thread, before any row is read
  for (int64_t t = 0; t < in.topk; ++t) {
    const int64_t slot = in.slots[i * in.topk + t];
    if (slot >= 0) s.keys.push_back(slot);
    outside |= slot >= in.N;
  }
  TORCH_CHECK(!outside, "a chosen slot is outside the cache");
  const int64_t c = static_cast<int64_t>(s.keys.size());
  s.read += c;
  T* out = in.out + i * H * rank;
  if (c == 0) {  // nothing chosen: zeros
    for (int64_t j = hb * rank; j < he * rank; ++j) out[j] = static_cast<T>(0.f);
    return;
  }
  if (!kPairs<T>)  // the Bf16Form multiplies the query's own values, scaled after the sum
    for (int64_t j = hb * W; j < he * W; ++j)
      s.q[j] = static_cast<float>(in.q[i * H * W + j]) * in.scale;
  std::fill(s.acc.begin() + hb * len, s.acc.begin() + he * len, 0.f);
  std::fill(s.sums.begin() + hb, s.sums.begin() + he, 0.f);
  std::fill(s.top.begin() + hb, s.top.begin() + he, -std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < std::min(c, kAhead); ++t)
    prefetch_span(in.rows + s.keys[t] * in.stride, W * sizeof(T));
  float* sc = s.tile.data();  // [H, kTile]: scores, then weights
  const T* row[kTile];
  for (int64_t c0 = 0; c0 < c; c0 += kTile) {
    const int64_t R = std::min(kTile, c - c0);
    for (int64_t t = c0 + kAhead; t < std::min(c, c0 + kAhead + R); ++t)
      prefetch_span(in.rows + s.keys[t] * in.stride, W * sizeof(T));
    for (int64_t t = 0; t < R; ++t) row[t] = in.rows + s.keys[c0 + t] * in.stride;
    int64_t r = 0;
#ifdef PIPESERVE_BF16_PAIRS
    if constexpr (kPairs<T>) {
      const bf16* q = in.q + i * H * W;
      for (; r + kRowTile <= R; r += kRowTile)
        score_rows_bf16<kRowTile>(in, q, row, r, hb, he, sc);
      for (; r < R; ++r) score_rows_bf16<1>(in, q, row, r, hb, he, sc);
    }
#endif
    for (; r + kRowTile <= R; r += kRowTile)
      score_rows<T, kRowTile>(in, s.q.data(), row, r, hb, he, sc);
    for (; r < R; ++r) score_rows<T, 1>(in, s.q.data(), row, r, hb, he, sc);
    for (int64_t h = hb; h < he; ++h) {  // weights against each head's running maximum
      float* w = sc + h * kTile;
      for (int64_t t = R; t < kTile; ++t) w[t] = -std::numeric_limits<float>::infinity();
      float top = s.top[h];
      for (int64_t t = 0; t < R; ++t) top = std::max(top, w[t]);
      if (top > s.top[h]) {  // the maximum grew: what was summed so far shrinks
        const float shrink = std::exp(s.top[h] - top);  // 0 on the first tile
        s.sums[h] *= shrink;
        float* acc = s.acc.data() + h * len;
        for (int64_t j = 0; j < len; ++j) acc[j] *= shrink;
        s.top[h] = top;
      }
      const v8 e = exp8(load8(w) - splat(top));  // kTile = 8 lanes; past R: e^-inf = 0
      store8(w, e);
      s.sums[h] += lanes_sum(e);
    }
#ifdef PIPESERVE_BF16_PAIRS
    if constexpr (kPairs<T>) {
      const auto line = (reinterpret_cast<uintptr_t>(s.pairs.data()) + 63) & ~uintptr_t{63};
      value_tile_bf16(in, row, R, sc, hb, he, s.acc.data(), reinterpret_cast<int16_t*>(line));
      continue;
    }
#endif
    if (R == kTile) {
      value_full_tile(in, row, sc, hb, he, s.acc.data());
    } else {
      for (int64_t t = 0; t < R; ++t) value_tile<T, 1>(in, row + t, sc + t, hb, he, s.acc.data());
    }
  }
  for (int64_t h = hb; h < he; ++h) {
    const float inv = 1.f / s.sums[h];
    const float* acc = s.acc.data() + h * len;
#ifdef PIPESERVE_BF16_PAIRS
    if constexpr (kPairs<T>) {
      for (int64_t j = 0; j < rank; ++j)
        out[h * rank + j] = static_cast<T>(acc[bf16_pairs::lane_of(j)] * inv);
      continue;
    }
#endif
    for (int64_t j = 0; j < rank; ++j) out[h * rank + j] = static_cast<T>(acc[j] * inv);
  }
}

// Tasks of kQueries queries with all heads; when there are too few queries to keep every
// thread busy (decode steps), of one query and a group of heads (each group reads the rows).
template <typename T>
int64_t run(const Inputs<T>& in) {
  if (in.n == 0) return 0;
  const int64_t threads = at::get_num_threads();
  int64_t groups = 1;
  if (in.n < kQueries * threads) {
    const int64_t wanted = (2 * threads + in.n - 1) / in.n;
    groups = std::max<int64_t>(1, std::min(wanted, (in.H + kHeadTile - 1) / kHeadTile));
  }
  const int64_t per_group = ((in.H + groups - 1) / groups + kHeadTile - 1) / kHeadTile * kHeadTile;
  groups = (in.H + per_group - 1) / per_group;
  const int64_t per_task = groups > 1 ? 1 : kQueries;
  std::atomic<int64_t> read{0};
  prefill::run_tasks(
      in.n, groups, per_task,
      [&] {
        Scratch s;
        s.q.resize(in.H * in.W);
        s.acc.resize(in.H * acc_len<T>(in.rank));
        if (kPairs<T>) s.pairs.resize(kTile * ((in.rank + 31) / 32) * 32 + 32);
        s.sums.resize(in.H);
        s.top.resize(in.H);
        s.tile.resize(in.H * kTile);
        s.keys.reserve(in.topk);
        return s;
      },
      [&](Scratch& s, int64_t group, int64_t q0, int64_t q1) {
        const int64_t hb = group * per_group, he = std::min(in.H, hb + per_group);
        for (int64_t i = q0; i < q1; ++i) one_query(in, i, hb, he, s);
        if (group == 0) read += s.read;  // a query's rows count once, whichever heads read them
        s.read = 0;
      });
  return read.load();
}

}  // namespace

at::Tensor sparse_latent_attention(at::Tensor q, at::Tensor rows, at::Tensor slots, int64_t rank,
                                   double scale, at::Tensor keys_read) {
  TORCH_CHECK(q.dim() == 3 && rows.dim() == 2 && slots.dim() == 2,
              "q [n,H,W], rows [N,W], slots [n,topk] expected");
  TORCH_CHECK(rows.scalar_type() == q.scalar_type(), "q and the rows must have one dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "sparse_latent_attention takes float32 or bfloat16");
  TORCH_CHECK(slots.scalar_type() == at::kLong, "slots must be int64");
  TORCH_CHECK(keys_read.scalar_type() == at::kLong && keys_read.numel() == 1 &&
                  keys_read.is_contiguous(),
              "keys_read must be one int64");
  TORCH_CHECK(rows.stride(1) == 1, "each row (of the latent cache) must be contiguous");
  const int64_t n = q.size(0), H = q.size(1), W = q.size(2), N = rows.size(0);
  TORCH_CHECK(rows.size(1) == W, "q and the rows disagree on the width");
  TORCH_CHECK(0 < rank && rank <= W, "the value width must be in (0, W]");
  TORCH_CHECK(slots.size(0) == n, "slots must have one row per query");
  q = q.contiguous();
  slots = slots.contiguous();
  const int64_t topk = slots.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();  // each query's task checks its own
  at::Tensor out = at::empty({n, H, rank}, q.options());
  const float sc = static_cast<float>(scale);
  int64_t read = 0;
  if (q.scalar_type() == at::kFloat) {
    Inputs<float> in{q.data_ptr<float>(), rows.data_ptr<float>(), sp, out.data_ptr<float>(),
                     n, H, W, rank, topk, N, rows.stride(0), sc};
    read = run(in);
  } else {
    using B = c10::BFloat16;
    Inputs<B> in{q.data_ptr<B>(), rows.data_ptr<B>(), sp, out.data_ptr<B>(), n, H, W, rank, topk, N,
                 rows.stride(0), sc};
    read = run(in);
  }
  *keys_read.data_ptr<int64_t>() += read;
  return out;
}
