// A whole Llama decoder layer for one decode token (batch 1) in one call: the model's op sequence
//   add_rms_norm -> GEMV (qkv) -> rope -> attend_qkv -> GEMV (o) -> add_rms_norm -> GEMV (gate/up) -> silu_mul
//   -> GEMV (down)
// with the GEMVs of quantization="gguf" (quant_gemv) or "gguf-a8" (linear_a8_packed), called from C++ through the
// dispatcher, so the results are those of the separate ops, bit for bit.
// At batch 1 the kernels of a layer take ~0.4 ms of CPU on SmolLM2-135M; the Python between them (argument checks,
// wrappers, nine trips through torch.ops with their argument parsing) took a further ~0.07 ms (2.1 ms of a token's
// CPU over 30 layers, measured). The other libraries (fused_ops, paged_attention) must be loaded
// before the first call, and the GEMVs' (gemv or quant_a8) before the first call in that format
// (pagedllm/models/decode_layer.py checks).
#include "ops_common.h"

#include <ATen/core/dispatch/Dispatcher.h>

namespace {

using Tensor = torch::Tensor;
using OptTensor = std::optional<Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

}  // namespace

// h: [1, E] residual stream (updated in place: += delta, then += the attention output); returns the MLP output
// [1, E] (the next layer's delta). qtypes: the GGUF formats of qkv, o, gate_up and down, rows their output
// sizes; int8_activations: the matrices are pack_a8's (gguf-a8), else GGUF block rows.
Tensor decode_layer(Tensor h, OptTensor delta, Tensor input_norm, Tensor post_norm, double eps, Tensor qkv_wq,
                    Tensor o_wq, Tensor gate_up_wq, Tensor down_wq, at::IntArrayRef qtypes, at::IntArrayRef rows,
                    bool int8_activations, Tensor cos, Tensor sin,
                    int64_t num_heads, Tensor k_cache, Tensor v_cache, Tensor slot_mapping, Tensor block_tables,
                    Tensor seq_lens, Tensor query_start_loc, int64_t block_size, double scale, int64_t q_tile,
                    OptTensor k_scale, OptTensor v_scale) {
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1, "decode_layer runs one token: h must be [1, E], got ", h.sizes());
  TORCH_CHECK(qtypes.size() == 4 && rows.size() == 4, "qtypes and rows must give the formats and output sizes of "
              "qkv, o, gate_up and down");
  static const auto norm = op<Tensor(Tensor, OptTensor, Tensor, double)>("pagedllm::add_rms_norm");
  static const auto rope = op<void(Tensor, Tensor, Tensor, int64_t)>("pagedllm::rope");
  static const auto attend = op<Tensor(Tensor, int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int64_t,
                                       double, int64_t, OptTensor, OptTensor)>("pagedllm::attend_qkv");
  static const auto silu_mul = op<Tensor(Tensor)>("pagedllm::silu_mul");
  auto linear = [&](const Tensor& x, const Tensor& w, size_t i) {  // looked up on first use: one format's library
    if (int8_activations) {
      static const auto a8 = op<Tensor(Tensor, Tensor, int64_t, int64_t, OptTensor)>("pagedllm::linear_a8_packed");
      return a8.call(x, w, qtypes[i], rows[i], std::nullopt);
    }
    static const auto gemv = op<Tensor(Tensor, Tensor, int64_t, OptTensor)>("pagedllm::quant_gemv");
    return gemv.call(x, w, qtypes[i], std::nullopt);
  };
  const int64_t num_kv_heads = k_cache.size(0);
  Tensor x = norm.call(h, delta, input_norm, eps);
  Tensor qkv = linear(x, qkv_wq, 0);
  rope.call(qkv, cos, sin, num_heads + num_kv_heads);
  Tensor attn = attend.call(qkv, num_heads, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                            block_size, scale, q_tile, k_scale, v_scale);
  Tensor o = linear(attn, o_wq, 1);
  x = norm.call(h, o, post_norm, eps);
  return linear(silu_mul.call(linear(x, gate_up_wq, 2)), down_wq, 3);
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("decode_layer(Tensor(a!) h, Tensor? delta, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv_wq, "
        "Tensor o_wq, Tensor gate_up_wq, Tensor down_wq, int[] qtypes, int[] rows, bool int8_activations, Tensor cos, "
        "Tensor sin, int num_heads, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, int block_size, float scale, int q_tile, Tensor(d!)? k_scale=None, "
        "Tensor(e!)? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("decode_layer", &decode_layer); }
