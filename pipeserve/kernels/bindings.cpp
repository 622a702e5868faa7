// Python bindings of the native CPU kernels. Every kernel runs without the GIL (none touches a
// Python object), so the scheduler's thread works while attention runs, as during any torch op.
#include <torch/csrc/utils/pybind.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention_gemm", &paged_decode_attention_gemm,
        "decode attention over runs of KV slots via BLAS products (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over runs of KV slots (CPU)", py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal attention of a prompt chunk over runs of KV slots (CPU, bfloat16, AVX512-BF16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention_avx2", &paged_prefill_attention_avx2,
        "causal attention of a prompt chunk over runs of KV slots (CPU, float32 or bfloat16 "
        "storage computed in float32, AVX2 + FMA)",
        py::call_guard<py::gil_scoped_release>());
  m.def("index_scores", &index_scores,
        "DeepSeek-V3.2 indexer scores, ReLU and head sum fused, causal (CPU; q and k float32, "
        "or bfloat16 on AVX512-BF16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("index_topk", &index_topk,
        "DeepSeek-V3.2 indexer: each query's topk best positions, the scores never leaving "
        "the kernel (CPU; q and k float32, or bfloat16 on AVX512-BF16); a prompt chunk's "
        "answer may be a view of memory an earlier answer had, once nothing refers to that",
        py::call_guard<py::gil_scoped_release>());
  m.def("index_topk_segments", &index_topk_segments,
        "DeepSeek-V3.2 indexer: index_topk of a batch's segments in one call, each over its "
        "own keys (rows of k), the tasks of all of them on every thread",
        py::call_guard<py::gil_scoped_release>());
  m.def("sparse_latent_attention", &sparse_latent_attention,
        "DeepSeek-V3.2 sparse attention in latent space: each query's heads over its chosen "
        "cache rows only, read in place; adds the rows read to keys_read (CPU, float32 or "
        "bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("sparse_expanded_attention", &sparse_expanded_attention,
        "DeepSeek-V3.2 sparse attention on up-projected keys: each query's heads over its "
        "chosen positions only, swept in blocks that stay in cache; adds the positions read "
        "to keys_read (CPU, float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("skinny_linear", &skinny_linear,
        "a linear layer's product for a few rows (decode steps), each weight byte read once: "
        "x [m, K] . w [N, K]^T (+ bias), float32 or bfloat16 x and w, float32 arithmetic (CPU)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("skinny_linear_blocks", &skinny_linear_blocks,
        "skinny_linear for a weight kept in GGUF blocks of 32 values, each row its blocks' "
        "bytes: format 1 Q4_1 (20 bytes), 2 Q8_0 (34 bytes); x rounded per block in two 8-bit "
        "parts and met by integer dot products (form 0 the best compiled, 1 portable, 2 AVX2, "
        "3 AVX512-VNNI) (CPU)",
        py::arg("x"), py::arg("w"), py::arg("format"), py::arg("bias") = py::none(),
        py::arg("form") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("int8_product_forms", &int8_product_forms,
        "the forms of skinny_linear_blocks' integer products compiled on this CPU");
  m.def("dequantize_blocks", &dequantize_blocks,
        "the float32 values of a weight kept in GGUF blocks (see skinny_linear_blocks), "
        "bitwise as GGUF's reference dequantisation computes them (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("requantize_blocks", &requantize_blocks,
        "a float32 weight as GGUF blocks (format 1 Q4_1, 2 Q8_0) whose values give back every "
        "one of its values bitwise, or None (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, as the torch ops compute it (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm,
        "the pre-norm residual step: (rms_norm(x + residual), x + residual) in one pass (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_store", &rope_store,
        "a GQA layer's rotary embedding of q and k and the write of k and v into the pool "
        "[kv_heads, slots, d] at `slots`, bitwise as the torch ops -> the rotated q (CPU, "
        "float32 or bfloat16)",
        py::call_guard<py::gil_scoped_release>());
  m.def("skinny_linear_max_rows", &skinny_linear_max_rows, "the most rows skinny_linear takes");
  py::class_<ShmAllReduce>(m, "ShmAllReduce")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, bool, double>())
      .def("all_reduce_", &ShmAllReduce::all_reduce_, "sum in place across the ranks",
           py::call_guard<py::gil_scoped_release>())
      .def("unlink", &ShmAllReduce::unlink);
  py::class_<DecodeStack>(m, "DecodeStack",
                          "a decode step through a stage's Llama-family layers in one call (CPU)")
      .def(py::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("run", &DecodeStack::run, py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention_supported", &prefill_attention_supported,
        "whether this build has the native prefill kernel (needs AVX512-BF16)");
  m.def("bf16_pairs_supported", &bf16_pairs_supported,
        "whether this build has the DeepSeek-V3.2 kernels' vdpbf16ps forms for bfloat16 inputs "
        "(the indexer's and both sparse attention kernels'; needs AVX512-BF16)");
  m.def("prefill_attention_avx2_supported", &prefill_attention_avx2_supported,
        "whether this build has the AVX2 prefill kernel (needs AVX2 and FMA)");
}
