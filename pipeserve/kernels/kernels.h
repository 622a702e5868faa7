// Declarations shared by the kernel sources and their Python bindings. The kernel sources
// include ATen's tensor and the operators they call, not <torch/extension.h>: that header
// (all of libtorch and pybind11) takes ~45 s to compile per source, ATen's tensor ~4 s;
// only bindings.cpp needs it.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor runs, at::Tensor offsets, double scale);
at::Tensor paged_decode_attention_gemm(at::Tensor q, at::Tensor k_cache,
                                          at::Tensor v_cache, at::Tensor runs,
                                          at::Tensor offsets, double scale);
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor k_cache,
                                      at::Tensor v_cache, at::Tensor runs, int64_t prefix,
                                      double scale);
bool prefill_attention_supported();
at::Tensor paged_prefill_attention_avx2(at::Tensor q, at::Tensor k_cache,
                                           at::Tensor v_cache, at::Tensor runs,
                                           int64_t prefix, double scale);
bool prefill_attention_avx2_supported();
at::Tensor sparse_latent_attention(at::Tensor q, at::Tensor rows, at::Tensor slots, int64_t rank,
                                   double scale, at::Tensor keys_read);
at::Tensor sparse_expanded_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor rope,
                                     at::Tensor positions, double scale, at::Tensor keys_read);
at::Tensor index_scores(at::Tensor q, at::Tensor w, at::Tensor k, int64_t prefix, double scale);
at::Tensor skinny_linear(at::Tensor x, at::Tensor w, std::optional<at::Tensor> bias);
int64_t skinny_linear_max_rows();
at::Tensor skinny_linear_blocks(at::Tensor x, at::Tensor w, int64_t format,
                                std::optional<at::Tensor> bias, int64_t form);
std::vector<int64_t> int8_product_forms();
at::Tensor rope_store(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                      at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots);
at::Tensor dequantize_blocks(at::Tensor w, int64_t format);
std::optional<at::Tensor> requantize_blocks(at::Tensor w, int64_t format);
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w,
                                                double eps);
at::Tensor index_topk(at::Tensor q, at::Tensor w, at::Tensor k, int64_t prefix, double scale,
                      int64_t topk);
// index_topk of a batch's segments in one call, each over its own slots of the key cache:
// segments [S, 5] int64 rows of (q_start, q_len, prefix, first run, runs), the segment's keys
// at the slots of runs [R, 2] (first slot, slots) in order (no runs: it sees no more than topk
// positions and keeps them all) -> [n, topk], -1 in rows no segment holds
at::Tensor index_topk_segments(at::Tensor q, at::Tensor w, at::Tensor cache, at::Tensor runs,
                               at::Tensor segments, double scale, int64_t topk);
bool bf16_pairs_supported();  // index_scores.cpp: the V3.2 kernels' vdpbf16ps forms

// One decode step through a stage's Llama-family layers in one call (decode_stack.cpp): the
// products, norms, rotary with the KV write and the attention of each layer, chained here.
struct StackLinear {
  at::Tensor weight;
  int64_t format;  // 0: float32/bfloat16 rows (skinny_linear); else GGUF blocks (1 Q4_1, 2 Q8_0)
  std::optional<at::Tensor> bias;
};

struct StackLayer {
  at::Tensor input_norm;
  double input_eps;
  at::Tensor post_norm;
  double post_eps;
  StackLinear linears[4];  // qkv, o, gate_up, down
  at::Tensor q_norm, k_norm;  // Qwen3's RMSNorms over each query and key head (undefined: none)
  double q_eps, k_eps;
  int64_t heads, kv_heads, head_dim;
  double scale;
  at::Tensor k_cache, v_cache;  // the pool's: [kv_heads, slots, head_dim]
};

class DecodeStack {
 public:
  void add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps,
                 std::vector<at::Tensor> weights, std::vector<int64_t> formats,
                 std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm,
                 double q_eps, std::optional<at::Tensor> k_norm, double k_eps, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, double scale, at::Tensor k_cache,
                 at::Tensor v_cache);
  // x [tokens, hidden] (one decode step per row), residual (none on the model's first layer),
  // cos/sin [tokens, 1, head_dim], slots [tokens], runs/offsets as paged_decode_attention's
  // -> (the last layer's output, the residual stream)
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor x, std::optional<at::Tensor> residual,
                                         at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                         at::Tensor runs, at::Tensor offsets);

 private:
  std::vector<StackLayer> layers_;
};

// Sum all-reduce among the TP ranks of one machine over a POSIX shared-memory segment (see
// shm_allreduce.cpp). Rank 0 creates the segment; the others open it by name.
class ShmAllReduce {
 public:
  ShmAllReduce(const std::string& name, int64_t rank, int64_t world, int64_t slot_bytes,
               bool create, double timeout_s);
  ~ShmAllReduce();
  void all_reduce_(at::Tensor x);
  void unlink();  // the name goes; mappings stay valid until every rank has closed

 private:
  template <typename T>
  void reduce_slice(T* data, int64_t count);
  void barrier(int which);
  std::atomic<uint64_t>* flag(int64_t rank, int which) const;
  char* buffer(int64_t rank) const;

  std::string name_;
  int64_t rank_, world_, slot_, size_ = 0;
  double timeout_s_;
  char* base_ = nullptr;
  uint64_t seq_ = 0;
};
