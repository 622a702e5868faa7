// DeepSeek-V3.2's lightning-indexer scores, fused (pipeserve/layers/indexer.py):
//
//   scores[i, j] = sum_h w[i, h] * max(0, scale * q[i, h, :] . k[j, :])   for j <= prefix + i
//   scores[i, j] = -inf                                                    for later keys
//
// q [n, H, d], w [n, H] and k [L, d] in float32 (the caller widens bfloat16), L = prefix + n.
// No [H, n, L] tensor of per-head logits exists: a query's per-head dot products with a block
// of kKeys keys live in registers, are ReLU'd, weighted and summed over the heads there, and
// only the head sum is stored. Keys are packed per block transposed ([d][kKeys]), so the inner
// loop is a fused multiply-add of a broadcast query value into the block's two key vectors,
// for kPair queries at once: a register tile of kPair x 2 vectors of dot products (12 of 16
// AVX2 registers), each key vector loaded feeding kPair multiply-adds. GCC's vector extension,
// 8 float lanes, compiled for the machine (AVX2 here; AVX512 machines run the same 8-lane
// code). Blocks of a query's future are skipped, the rest of its row is masked. Work is split
// over blocks of queries as the prefill kernels split theirs (prefill::run_tasks).
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "prefill_common.h"
#include "vec8.h"

namespace {

constexpr int64_t kLanes = vec8::kLanes;
constexpr int64_t kKeys = 2 * kLanes;  // keys per packed block: two vectors
constexpr int64_t kPair = 6;           // queries per register tile
constexpr int64_t kQueries = 24;       // queries per task

using vec8::load8;
using vec8::splat;
using vec8::v8;

struct Inputs {
  const float* q;
  const float* w;
  const float* packed;  // [blocks][d][kKeys], zero past L
  int64_t n, H, d, L, prefix;
  float scale;
};

// Where a task's score rows go: row i at base + (i - row0) * L (the output tensor, or a
// thread's scratch rows when only the top-k leave the kernel).
struct Rows {
  float* base;
  int64_t row0;
  float* row(const Inputs& in, int64_t i) const { return base + (i - row0) * in.L; }
};

// Queries i .. i + P - 1 against one key block: acc[p] = sum_h w_ph * max(0, q_ph . k_block),
// kKeys floats per query. Their dot products (P x 2 vectors) stay in registers over the d-loop.
template <int P>
inline void query_block(const Inputs& in, int64_t i, int64_t block, float (*acc)[kKeys]) {
  v8 sum[P][2];
  for (int p = 0; p < P; ++p) sum[p][0] = sum[p][1] = splat(0.f);
  const float* kb = in.packed + block * in.d * kKeys;
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

// One key block's scores for rows i .. i + P - 1, up to each query's own position.
template <int P>
void tile(const Inputs& in, const Rows& out, int64_t i, int64_t block, float (*acc)[kKeys]) {
  query_block<P>(in, i, block, acc);
  const int64_t j0 = block * kKeys;
  for (int p = 0; p < P; ++p) {
    const int64_t visible = in.prefix + i + p + 1;
    if (j0 < visible)
      std::memcpy(out.row(in, i + p) + j0, acc[p], std::min(kKeys, visible - j0) * sizeof(float));
  }
}

// The last rows of a task, fewer than kPair of them, in one tile.
void rest(const Inputs& in, const Rows& out, int64_t i, int64_t count, int64_t block,
          float (*acc)[kKeys]) {
  switch (count) {
    case 5: return tile<5>(in, out, i, block, acc);
    case 4: return tile<4>(in, out, i, block, acc);
    case 3: return tile<3>(in, out, i, block, acc);
    case 2: return tile<2>(in, out, i, block, acc);
    case 1: return tile<1>(in, out, i, block, acc);
    default: return;
  }
}

// Rows q0 .. q1 - 1 up to each query's own position: key block by key block (a block, d x
// kKeys floats, stays in L1 while every tile of the task's queries uses it), tiles whose
// queries all precede the block skipped. Nothing past a query's position is written.
void task_rows(const Inputs& in, const Rows& out, int64_t q0, int64_t q1, float (*acc)[kKeys]) {
  const int64_t last = in.prefix + q1;  // keys 0 .. last - 1 are visible to some row
  for (int64_t block = 0; block * kKeys < last; ++block) {
    // the first tile some of whose queries see the block (visible = prefix + i + 1)
    const int64_t seen = std::max<int64_t>(q0, block * kKeys - in.prefix - kPair + 1);
    int64_t i = q0 + (seen - q0) / kPair * kPair;
    for (; i + kPair <= q1; i += kPair) tile<kPair>(in, out, i, block, acc);
    rest(in, out, i, q1 - i, block, acc);
  }
}

struct Acc {
  float rows[kPair][kKeys];
};

// Every score row, its future -inf, into out [n, L].
void run_scores(const Inputs& in, float* out) {
  // tasks of kQueries queries on every thread, later (longer) rows first: the prefill
  // kernels' split, with one "head" (the heads are summed inside a task)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  prefill::run_tasks(
      in.n, 1, kQueries, [] { return Acc{}; },
      [&](Acc& acc, int64_t, int64_t q0, int64_t q1) {
        task_rows(in, Rows{out, 0}, q0, q1, acc.rows);
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
// `copy` holds `visible` floats, `tags` each score's bin, `bins` kBins counters.
constexpr int64_t kBins = 2048;

void select_row(float* row, int64_t visible, int64_t topk, float* copy, int64_t* pick,
                int64_t* bins, uint16_t* tags) {
  std::fill(pick, pick + topk, int64_t{-1});
  if (visible <= topk) {
    for (int64_t j = 0; j < visible; ++j) pick[j] = j;
    return;
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float inf = std::numeric_limits<float>::infinity();
  float lo = inf, hi = -inf;
  for (int64_t j = 0; j < visible; ++j) {
    const float x = std::isnan(row[j]) ? neg_inf : row[j];
    row[j] = x;
    if (std::isfinite(x)) {
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
  }
  // bin(x): 0 at lo and below, kBins - 1 at hi and above, equal widths between; a weakly
  // increasing function of x (a subtraction and a product by a positive constant round
  // monotonically), so every score of a higher bin is at least every score of a lower one
  const float scale = hi > lo ? (kBins - 1) / (hi - lo) : 0.f;
  const auto bin = [&](float x) -> int64_t {
    if (!(x > lo)) return 0;
    if (!(x < hi)) return kBins - 1;
    const float t = (x - lo) * scale;  // +inf where hi - lo is too small for 1 / it
    return t < kBins - 1 ? static_cast<int64_t>(t) : kBins - 1;
  };
  std::fill(bins, bins + kBins, int64_t{0});
  for (int64_t j = 0; j < visible; ++j) ++bins[tags[j] = static_cast<uint16_t>(bin(row[j]))];
  int64_t above = 0, b = kBins - 1;
  while (above + bins[b] < topk) above += bins[b--];  // some bin holds the topk-th: visible > topk
  int64_t c = 0;
  for (int64_t j = 0; j < visible; ++j)
    if (tags[j] == b) copy[c++] = row[j];  // the bins counted (fast-math may round twice apart)
  const int64_t need = topk - above;  // in 1 .. bins[b]
  std::nth_element(copy, copy + need - 1, copy + c, std::greater<float>());
  const float kth = copy[need - 1];
  for (int64_t t = 0; t < c; ++t) above += copy[t] > kth;
  int64_t ties = topk - above, taken = 0;
  for (int64_t j = 0; j < visible && taken < topk; ++j) {
    if (row[j] > kth || (row[j] == kth && ties > 0)) {
      ties -= row[j] == kth;
      pick[taken++] = j;
    }
  }
}

// Each row's top-k positions into pick [n, topk]; the scores of a task's rows live only in
// its thread's scratch (a task's rows x L floats: 16 MiB at most, fewer rows per task when L
// is long, and at least one tile of kPair rows, 24 MiB at a million keys).
void run_topk(const Inputs& in, int64_t topk, int64_t* pick) {
  if (in.n == 0) return;
  constexpr int64_t kScratchFloats = int64_t{1} << 22;  // 16 MiB of score rows per thread
  const int64_t per = std::max<int64_t>(
      kPair, std::min<int64_t>(kQueries, kScratchFloats / in.L / kPair * kPair));
  struct Scratch {
    Acc acc;
    std::vector<float> rows, copy;
    std::vector<int64_t> bins = std::vector<int64_t>(kBins);
    std::vector<uint16_t> tags;
  };
  prefill::run_tasks(
      in.n, 1, per, [] { return Scratch{}; },
      [&](Scratch& s, int64_t, int64_t q0, int64_t q1) {
        // a decode step's one query: one row, not a whole task's
        s.rows.resize(std::max(s.rows.size(), static_cast<size_t>((q1 - q0) * in.L)));
        s.copy.resize(static_cast<size_t>(in.L));
        s.tags.resize(static_cast<size_t>(in.L));
        task_rows(in, Rows{s.rows.data(), q0}, q0, q1, s.acc.rows);
        for (int64_t i = q0; i < q1; ++i)
          select_row(s.rows.data() + (i - q0) * in.L, in.prefix + i + 1, topk, s.copy.data(),
                     pick + i * topk, s.bins.data(), s.tags.data());
      });
}

// Checks and the keys packed per block; the queries' inputs.
Inputs prepare(at::Tensor& q, at::Tensor& w, at::Tensor& k, int64_t prefix, double scale,
               std::vector<float>& packed) {
  TORCH_CHECK(q.dim() == 3 && w.dim() == 2 && k.dim() == 2, "q [n,H,d], w [n,H], k [L,d] expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  k.scalar_type() == at::kFloat,
              "the indexer kernels take float32 (widen bfloat16 first)");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2), L = k.size(0);
  TORCH_CHECK(w.size(0) == n && w.size(1) == H, "w must be [n, H]");
  TORCH_CHECK(k.size(1) == d, "q and k disagree on the head dim");
  TORCH_CHECK(prefix >= 0 && prefix + n == L, "k must hold the prefix and the queries' own keys");
  TORCH_CHECK(scale > 0, "the score scale must be positive");
  q = q.contiguous();
  w = w.contiguous();
  k = k.contiguous();
  const int64_t blocks = (L + kKeys - 1) / kKeys;
  packed.assign(static_cast<size_t>(blocks * d * kKeys), 0.f);
  const float* kp = k.data_ptr<float>();
  for (int64_t j = 0; j < L; ++j) {
    float* dst = packed.data() + (j / kKeys) * d * kKeys + j % kKeys;
    for (int64_t t = 0; t < d; ++t) dst[t * kKeys] = kp[j * d + t];
  }
  return Inputs{q.data_ptr<float>(), w.data_ptr<float>(), packed.data(), n, H, d, L, prefix,
                static_cast<float>(scale)};
}

}  // namespace

at::Tensor index_scores(at::Tensor q, at::Tensor w, at::Tensor k, int64_t prefix, double scale) {
  std::vector<float> packed;
  const Inputs in = prepare(q, w, k, prefix, scale, packed);
  at::Tensor out = at::empty({in.n, in.L}, q.options());
  run_scores(in, out.data_ptr<float>());
  return out;
}

at::Tensor index_topk(at::Tensor q, at::Tensor w, at::Tensor k, int64_t prefix, double scale,
                      int64_t topk) {
  TORCH_CHECK(topk > 0, "topk must be positive");
  std::vector<float> packed;
  const Inputs in = prepare(q, w, k, prefix, scale, packed);
  at::Tensor pick = at::empty({in.n, topk}, q.options().dtype(at::kLong));
  run_topk(in, topk, pick.data_ptr<int64_t>());
  return pick;
}
