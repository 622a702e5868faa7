// A decode step through a stage's Llama-family layers in one native call.
//
// A decode step of a small model is a chain of small kernels: per layer two norms, four
// products, the rotary embedding with the KV write, and the attention, ~10 calls that each
// cost a few microseconds of Python and torch dispatch around tens of microseconds of work.
// On the built-in model (30 layers), at two threads that dispatch was about a third of the
// step. Here the chain runs in C++, calling the same kernels the Python layers call, in the
// same order, so the step's results are bitwise those of the layer-by-layer path
// (models/llama.py LlamaDecoderLayer, backends/native_backend.py):
//
//   h, residual = add_rms_norm(x, residual)        (rms_norm(x), x on the stage's first layer)
//   q, k, v     = qkv(h) split by heads
//   q           = rope_store(q, k, v)              (rotary; k and v written to the pool)
//                 (Qwen3: q and k normed per head first)
//   o           = o_proj(paged_decode_attention(q))
//   h, residual = add_rms_norm(o, residual)
//   x           = down(silu(gate) * up),  gate | up = gate_up(h)
//
// Products: skinny_linear for float32/bfloat16 weights, skinny_linear_blocks (form 0, the
// best compiled) for weights kept in GGUF blocks. Norms, Qwen3's q/k norms included: the
// compiled norm (bitwise the torch ops), as NativeNorms and NativeBackend.rope_and_store run
// it. Which layers, weights and batches qualify is decided in Python
// (NativeBackend.decode_stack); this file checks only what it indexes.
#include <ATen/ops/silu.h>

#include "kernels.h"

namespace {

at::Tensor product(const StackLinear& l, const at::Tensor& x) {
  if (l.format == 0) return skinny_linear(x, l.weight, l.bias);
  return skinny_linear_blocks(x, l.weight, l.format, l.bias, 0);
}

// Qwen3's q/k norms over each head (the compiled norm, as the native backend's rope_and_store
// runs them), then the rotary and the KV write (rope_store: bitwise the torch ops)
at::Tensor norm_rope_store(const StackLayer& l, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& slots) {
  return rope_store(rms_norm(q.contiguous(), l.q_norm, l.q_eps),
                    rms_norm(k.contiguous(), l.k_norm, l.k_eps), v, cos, sin, l.k_cache,
                    l.v_cache, slots);
}

// (norm(x + residual), x + residual); (norm(x), x) without a residual
std::tuple<at::Tensor, at::Tensor> add_norm(const at::Tensor& x,
                                            const std::optional<at::Tensor>& residual,
                                            const at::Tensor& w, double eps) {
  if (!residual) return {rms_norm(x, w, eps), x};
  return add_rms_norm(x, *residual, w, eps);
}

}  // namespace

void DecodeStack::add_layer(at::Tensor input_norm, double input_eps, at::Tensor post_norm,
                            double post_eps,
                            std::vector<at::Tensor> weights, std::vector<int64_t> formats,
                            std::optional<at::Tensor> qkv_bias,
                            std::optional<at::Tensor> q_norm, double q_eps,
                            std::optional<at::Tensor> k_norm, double k_eps, int64_t heads,
                            int64_t kv_heads, int64_t head_dim, double scale, at::Tensor k_cache,
                            at::Tensor v_cache) {
  TORCH_CHECK(weights.size() == 4 && formats.size() == 4,
              "a layer's four products: qkv, o, gate_up, down");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "heads: a multiple of kv_heads");
  TORCH_CHECK(weights[0].size(0) == (heads + 2 * kv_heads) * head_dim,
              "qkv's rows: (heads + 2 kv_heads) head_dim");
  TORCH_CHECK(weights[2].size(0) % 2 == 0, "gate_up's rows: gate's then up's");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms: both or neither");
  StackLayer layer{input_norm,
                   input_eps,
                   post_norm,
                   post_eps,
                   {},
                   q_norm.value_or(at::Tensor()),
                   k_norm.value_or(at::Tensor()),
                   q_eps,
                   k_eps,
                   heads,
                   kv_heads,
                   head_dim,
                   scale,
                   k_cache,
                   v_cache};
  for (size_t i = 0; i < 4; ++i) {
    layer.linears[i] = {weights[i], formats[i], i == 0 ? qkv_bias : std::nullopt};
  }
  layers_.push_back(std::move(layer));
}

std::tuple<at::Tensor, at::Tensor> DecodeStack::run(at::Tensor x,
                                                    std::optional<at::Tensor> residual,
                                                    at::Tensor cos, at::Tensor sin,
                                                    at::Tensor slots, at::Tensor runs,
                                                    at::Tensor offsets) {
  TORCH_CHECK(!layers_.empty(), "a stack without layers");
  TORCH_CHECK(x.dim() == 2, "x: [tokens, hidden]");
  const int64_t b = x.size(0);
  x = x.contiguous();  // the compiled norm reads rows in place
  if (residual) residual = residual->contiguous();
  for (const StackLayer& l : layers_) {
    const int64_t h = l.heads, kv = l.kv_heads, d = l.head_dim;
    auto [normed, sum] = add_norm(x, residual, l.input_norm, l.input_eps);
    at::Tensor qkv = product(l.linears[0], normed);
    at::Tensor q = qkv.narrow(1, 0, h * d).view({b, h, d});
    at::Tensor k = qkv.narrow(1, h * d, kv * d).view({b, kv, d});
    at::Tensor v = qkv.narrow(1, (h + kv) * d, kv * d).view({b, kv, d});
    at::Tensor rotated = l.q_norm.defined()
                             ? norm_rope_store(l, q, k, v, cos, sin, slots)
                             : rope_store(q, k, v, cos, sin, l.k_cache, l.v_cache, slots);
    at::Tensor o = paged_decode_attention(rotated.view({b, kv, h / kv, d}), l.k_cache, l.v_cache,
                                          runs, offsets, l.scale);
    at::Tensor attended = product(l.linears[1], o.view({b, h * d}));
    std::tie(normed, sum) = add_norm(attended, sum, l.post_norm, l.post_eps);
    std::vector<at::Tensor> gate_up = product(l.linears[2], normed).chunk(2, -1);
    x = product(l.linears[3], at::silu(gate_up[0]).mul(gate_up[1]));
    residual = sum;
  }
  return {x, *residual};
}
