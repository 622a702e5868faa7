// Declarations shared by the kernel sources and their Python bindings.
#pragma once
#include <torch/extension.h>

#include <atomic>
#include <string>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor runs, torch::Tensor offsets, double scale);
torch::Tensor paged_decode_attention_gemm(torch::Tensor q, torch::Tensor k_cache,
                                          torch::Tensor v_cache, torch::Tensor runs,
                                          torch::Tensor offsets, double scale);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor runs, int64_t prefix,
                                      double scale);
bool prefill_attention_supported();

// Sum all-reduce among the TP ranks of one machine over a POSIX shared-memory segment (see
// shm_allreduce.cpp). Rank 0 creates the segment; the others open it by name.
class ShmAllReduce {
 public:
  ShmAllReduce(const std::string& name, int64_t rank, int64_t world, int64_t slot_bytes,
               bool create, double timeout_s);
  ~ShmAllReduce();
  void all_reduce_(torch::Tensor x);
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
