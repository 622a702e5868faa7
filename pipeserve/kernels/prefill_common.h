// What the prefill-attention kernels (AVX512-BF16, AVX2) share: checking the inputs and
// expanding the runs of KV slots, the split of the work into tasks, and the 2^x polynomial.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "kernels.h"

namespace prefill {

constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kTargetRows = 768;   // query rows per task: a block of keys serves them all
constexpr int64_t kTasksPerThread = 4;  // but at least this many tasks per thread, for balance
// 2^f for f in [-0.5, 0.5], Horner from the highest power: relative error ~2e-7
constexpr float kExp2Poly[6] = {1.3333558146e-3f, 9.6181291076e-3f, 5.5504108665e-2f,
                                2.4022650696e-1f, 6.9314718056e-1f, 1.0f};

// The problem's sizes: q [n, H, D], the pool [Hk, N, D], G = H / Hk query heads per KV head.
struct Shape {
  int64_t n, H, Hk, G, D, N;
};

// Checks q, the pool and the runs (int64 [R, 2]: first slot, length), which must cover
// positions 0 .. prefix + n - 1 exactly, inside the pool; returns the shape and fills `slots`
// with the slot of every position.
inline Shape check_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& runs, int64_t prefix,
                          int64_t dim_multiple, std::vector<int64_t>& slots) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3, "q [n,H,D], k_cache [Hk,N,D] expected");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the KV cache must have one dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "k_cache and v_cache differ in shape");
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 2,
              "runs must be int64 [R, 2]");
  Shape s{q.size(0), q.size(1), k_cache.size(0), 0, q.size(2), k_cache.size(1)};
  TORCH_CHECK(s.H % s.Hk == 0 && k_cache.size(2) == s.D, "q and k_cache disagree on heads/dim");
  TORCH_CHECK(s.D % dim_multiple == 0, "head dim must be a multiple of ", dim_multiple);
  s.G = s.H / s.Hk;
  const at::Tensor r = runs.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  slots.clear();
  for (int64_t i = 0; i < r.size(0); ++i)
    for (int64_t j = 0; j < rp[2 * i + 1]; ++j) slots.push_back(rp[2 * i] + j);
  TORCH_CHECK(static_cast<int64_t>(slots.size()) == prefix + s.n,
              "KV runs must cover exactly the prefix and the chunk");
  for (int64_t slot : slots) TORCH_CHECK(0 <= slot && slot < s.N, "KV slot outside the pool");
  return s;
}

// Queries per task: about kTargetRows rows (each block of keys is used by more rows, so the
// cache is read fewer times), fewer when that would leave threads without enough tasks,
// rounded so rows fill whole register tiles of `row_tile`.
inline int64_t queries_per_task(int64_t n, int64_t Hk, int64_t G, int64_t threads,
                                int64_t row_tile) {
  const int64_t blocks = (kTasksPerThread * threads + Hk - 1) / Hk;  // query blocks wanted
  int64_t per = std::min<int64_t>(std::max<int64_t>(1, kTargetRows / G), (n + blocks - 1) / blocks);
  while (per > 1 && (per * G) % row_tile != 0 && per * G > row_tile) --per;
  return std::max<int64_t>(1, std::min(per, n));
}

// Scratch kept per thread between calls (a thread_local returned to run_tasks by reference)
// is released at the end of a task once its vectors hold more than kKeptScratchBytes: long
// contexts then allocate per task as before, and no thread keeps more than this for good.
constexpr int64_t kKeptScratchBytes = int64_t{32} << 20;

template <typename... V>
void trim_scratch(V&... vectors) {
  const int64_t held = (0 + ... + static_cast<int64_t>(vectors.capacity() *
                                                       sizeof(typename V::value_type)));
  if (held > kKeptScratchBytes) (V().swap(vectors), ...);
}

// Runs task(scratch, i) for i = 0 .. count - 1 on all threads: threads take the tasks in that
// order from a shared counter. `make_scratch()` gives each thread its own state.
template <typename MakeScratch, typename Task>
void run_in_order(int64_t count, MakeScratch make_scratch, Task task) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      auto&& scratch = make_scratch();  // a thread's own, or one it keeps between calls
      for (int64_t i = next++; i < count; i = next++) task(scratch, i);
    }
  });
}

// Runs task(head, first query, end query) for every (KV head, block of queries) on all
// threads, longest first (a block's queries see more keys the later it is).
template <typename MakeScratch, typename Task>
void run_tasks(int64_t n, int64_t Hk, int64_t per_task, MakeScratch make_scratch, Task task) {
  const int64_t qblocks = (n + per_task - 1) / per_task;
  run_in_order(Hk * qblocks, make_scratch, [&](auto& scratch, int64_t i) {
    const int64_t head = i / qblocks, qb = qblocks - 1 - i % qblocks;
    const int64_t t0 = qb * per_task;
    task(scratch, head, t0, std::min(n, t0 + per_task));
  });
}

}  // namespace prefill
