// DeepSeek-V3.2's lightning-indexer scores, fused (pipeserve/layers/indexer.py):
//
//   scores[i, j] = sum_h w[i, h] * max(0, scale * q[i, h, :] . k[j, :])   for j <= prefix + i
//   scores[i, j] = -inf                                                    for later keys
//
// q [n, H, d], w [n, H] and k [L, d] in float32 (the caller widens bfloat16), L = prefix + n.
// No [H, n, L] tensor of per-head logits exists: a query's per-head dot products with a block
// of kKeys keys live in registers, are ReLU'd, weighted and summed over the heads there, and
// only the head sum is stored. Keys are packed per block transposed ([d][kKeys]), so the inner
// loop is a fused multiply-add of a broadcast query value into kKeys key lanes, for three
// queries at once (each key vector loaded feeds all three): plain C++ that the compiler vectorises
// for the machine's widest vectors (-march=native: 8 lanes with AVX2, 16 with AVX512). Blocks
// of a query's future are skipped, the rest of its row is masked. Work is split over blocks
// of queries as the prefill kernels split theirs (prefill::run_tasks).
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "prefill_common.h"

namespace {

constexpr int64_t kKeys = 32;     // keys per packed block
constexpr int64_t kPair = 3;      // queries per pass: each key vector loaded serves all three
constexpr int64_t kQueries = 16;  // queries per task

struct Inputs {
  const float* q;
  const float* w;
  const float* packed;  // [blocks][d][kKeys], zero past L
  float* out;
  int64_t n, H, d, L, prefix;
  float scale;
};

// Queries i .. i + P - 1 against one key block: acc[p][j] = sum_h w_ph * max(0, q_ph . k_j).
// Their dot products (P x kKeys floats) stay in registers over the d-loop.
template <int64_t P>
inline void query_block(const Inputs& in, int64_t i, int64_t block, float (*acc)[kKeys]) {
  float dots[P][kKeys];
  for (int64_t p = 0; p < P; ++p)
    for (int64_t j = 0; j < kKeys; ++j) acc[p][j] = 0.f;
  const float* kb = in.packed + block * in.d * kKeys;
  for (int64_t h = 0; h < in.H; ++h) {
    const float* qh[P];
    for (int64_t p = 0; p < P; ++p) {
      qh[p] = in.q + ((i + p) * in.H + h) * in.d;
      for (int64_t j = 0; j < kKeys; ++j) dots[p][j] = 0.f;
    }
    for (int64_t t = 0; t < in.d; ++t) {
      const float* kt = kb + t * kKeys;
      for (int64_t p = 0; p < P; ++p) {
        const float qv = qh[p][t];
        for (int64_t j = 0; j < kKeys; ++j) dots[p][j] += qv * kt[j];
      }
    }
    for (int64_t p = 0; p < P; ++p) {
      const float wh = in.w[(i + p) * in.H + h] * in.scale;  // scale > 0: w relu(s x) = ws relu(x)
      for (int64_t j = 0; j < kKeys; ++j) acc[p][j] += wh * std::max(dots[p][j], 0.f);
    }
  }
}

// Rows i .. i + P - 1 of the scores: each query's visible blocks, its future masked.
template <int64_t P>
void rows(const Inputs& in, int64_t i, float (*acc)[kKeys]) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t last = in.prefix + i + P;  // keys 0 .. last - 1 are visible to some row
  for (int64_t block = 0; block * kKeys < last; ++block) {
    query_block<P>(in, i, block, acc);
    const int64_t j0 = block * kKeys;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t visible = in.prefix + i + p + 1;
      if (j0 < visible)
        std::memcpy(in.out + (i + p) * in.L + j0, acc[p],
                    std::min(kKeys, visible - j0) * sizeof(float));
    }
  }
  for (int64_t p = 0; p < P; ++p) {
    float* row = in.out + (i + p) * in.L;
    std::fill(row + in.prefix + i + p + 1, row + in.L, neg_inf);
  }
}

void run(const Inputs& in) {
  // tasks of kQueries queries on every thread, later (longer) rows first: the prefill
  // kernels' split, with one "head" (the heads are summed inside a task)
  struct Acc {
    float rows[kPair][kKeys];
  };
  prefill::run_tasks(
      in.n, 1, kQueries, [] { return Acc{}; },
      [&](Acc& acc, int64_t, int64_t q0, int64_t q1) {
        int64_t i = q0;
        for (; i + kPair <= q1; i += kPair) rows<kPair>(in, i, acc.rows);
        for (; i < q1; ++i) rows<1>(in, i, acc.rows);
      });
}

}  // namespace

at::Tensor index_scores(at::Tensor q, at::Tensor w, at::Tensor k, int64_t prefix, double scale) {
  TORCH_CHECK(q.dim() == 3 && w.dim() == 2 && k.dim() == 2, "q [n,H,d], w [n,H], k [L,d] expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat &&
                  k.scalar_type() == at::kFloat,
              "index_scores takes float32 (widen bfloat16 first)");
  const int64_t n = q.size(0), H = q.size(1), d = q.size(2), L = k.size(0);
  TORCH_CHECK(w.size(0) == n && w.size(1) == H, "w must be [n, H]");
  TORCH_CHECK(k.size(1) == d, "q and k disagree on the head dim");
  TORCH_CHECK(prefix >= 0 && prefix + n == L, "k must hold the prefix and the queries' own keys");
  TORCH_CHECK(scale > 0, "the score scale must be positive");
  q = q.contiguous();
  w = w.contiguous();
  k = k.contiguous();
  const int64_t blocks = (L + kKeys - 1) / kKeys;
  std::vector<float> packed(static_cast<size_t>(blocks * d * kKeys), 0.f);
  const float* kp = k.data_ptr<float>();
  for (int64_t j = 0; j < L; ++j) {
    float* dst = packed.data() + (j / kKeys) * d * kKeys + j % kKeys;
    for (int64_t t = 0; t < d; ++t) dst[t * kKeys] = kp[j * d + t];
  }
  at::Tensor out = at::empty({n, L}, q.options());
  Inputs in{q.data_ptr<float>(), w.data_ptr<float>(), packed.data(), out.data_ptr<float>(),
            n, H, d, L, prefix, static_cast<float>(scale)};
  run(in);
  return out;
}
