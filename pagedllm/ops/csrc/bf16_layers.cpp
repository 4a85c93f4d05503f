// A Llama model's decoder layers over a step of several rows in one call, for quantization="gguf-bf16" (fp32
// activations, GEMMs on the matrices' packed bf16 copies: models/bf16_gemm.py): each layer's op sequence
//   add_rms_norm (bf16 out) -> amx_linear_bf16 (qkv) -> rope_widen -> attend_qkv -> bf16 -> amx_linear_bf16 (o)
//   -> add_rms_norm (bf16 out) -> amx_linear_silu_bf16 (gate/up) -> amx_linear_bf16 (down)
// (steps of at most blocks_max_rows rows: the amx_blocks_* ops on the matrices' GGUF blocks where they are given,
// as bf16_gemm.bf16_linear routes them)
// called from C++ through the dispatcher: the ops the per-op layer (models/llama.py) calls for such a step, in its
// order, so the results are the same bits. Each op keeps its own parallel regions.
//
// The Python around those ops (the layer's checks and dispatch, eight trips through torch.ops with their argument
// parsing) cost ~1.5-2 ms of a ~40 ms decode step of 36 rows on the embedded model (30 layers, Zen 4, 2 threads).
#include "ops_common.h"

namespace {

using Tensor = torch::Tensor;
using OptTensor = std::optional<Tensor>;
using pagedllm_ops::op;

// h: [T, E] fp32 residual stream (updated in place); returns the last layer's MLP output [T, E] in bf16 (the final
// norm's delta). Per layer l: input_norms[l], post_norms[l], its packed copies (amx_pack_bf16) of qkv, o, gate/up and
// down, whose output sizes are rows[0..3]; its pool (k_caches[l], v_caches[l]; k_scales / v_scales: one a layer for
// a quantized pool, else empty). blocks: the four matrices' Q4_1 blocks a layer in the same order (qkv, o, gate/up,
// down; 4 L tensors, or none).
Tensor bf16_layers(Tensor h, OptTensor delta, at::TensorList input_norms, at::TensorList post_norms, double eps,
                   at::TensorList qkv_w, at::TensorList o_w, at::TensorList gate_up_w, at::TensorList down_w,
                   at::IntArrayRef rows, at::TensorList blocks, int64_t blocks_max_rows,
                   Tensor cos, Tensor sin, int64_t num_heads, at::TensorList k_caches,
                   at::TensorList v_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens,
                   Tensor query_start_loc, int64_t block_size, double scale, int64_t q_tile,
                   at::TensorList k_scales, at::TensorList v_scales) {
  const int64_t L = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "bf16_layers: h must be a 2-d float32 [T, E] tensor");
  TORCH_CHECK(L > 0 && post_norms.size() == L && qkv_w.size() == L && o_w.size() == L && gate_up_w.size() == L &&
                  down_w.size() == L && k_caches.size() == L && v_caches.size() == L,
              "bf16_layers: every per-layer list needs one entry a layer");
  TORCH_CHECK(k_scales.size() == v_scales.size() && (k_scales.empty() || k_scales.size() == L),
              "bf16_layers: k_scales and v_scales hold one scale tensor a layer, or none");
  TORCH_CHECK(rows.size() == 4, "bf16_layers: rows gives the output sizes of qkv, o, gate/up and down");
  TORCH_CHECK(blocks.empty() || blocks.size() == 4 * L, "bf16_layers: blocks hold the four matrices of every layer, or none");
  static const auto norm = op<Tensor(Tensor, OptTensor, Tensor, double, bool)>("pagedllm::add_rms_norm");
  static const auto gemm = op<Tensor(Tensor, Tensor, int64_t)>("pagedllm::amx_linear_bf16");
  static const auto gemm_silu = op<Tensor(Tensor, Tensor, int64_t)>("pagedllm::amx_linear_silu_bf16");
  const bool from_blocks = !blocks.empty() && h.size(0) <= blocks_max_rows;
  // matrix i of layer l (rows[i] outputs) times x
  auto mm = [&](const Tensor& x, int64_t l, int64_t i, const Tensor& packed) {
    if (from_blocks) {  // looked up at first use: the amx_blocks library is loaded only where blocks are given
      using Blocks = Tensor(Tensor, Tensor, int64_t);
      static const auto bgemm = op<Blocks>("pagedllm::amx_blocks_linear_bf16");
      static const auto bgemm_silu = op<Blocks>("pagedllm::amx_blocks_linear_silu_bf16");
      return (i == 2 ? bgemm_silu : bgemm).call(x, blocks[4 * l + i], rows[i]);
    }
    return (i == 2 ? gemm_silu : gemm).call(x, packed, rows[i]);
  };
  static const auto rope_widen = op<Tensor(Tensor, Tensor, Tensor, int64_t)>("pagedllm::rope_widen");
  static const auto attend = op<Tensor(Tensor, int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int64_t,
                                       double, int64_t, OptTensor, OptTensor)>("pagedllm::attend_qkv");
  OptTensor d = delta;
  for (int64_t l = 0; l < L; ++l) {
    Tensor x = norm.call(h, d, input_norms[l], eps, true);
    Tensor qkv = rope_widen.call(mm(x, l, 0, qkv_w[l]), cos, sin, num_heads + k_caches[l].size(0));
    const OptTensor ks = k_scales.empty() ? OptTensor() : OptTensor(k_scales[l]);
    const OptTensor vs = v_scales.empty() ? OptTensor() : OptTensor(v_scales[l]);
    Tensor attn = attend.call(qkv, num_heads, k_caches[l], v_caches[l], slot_mapping, block_tables, seq_lens,
                              query_start_loc, block_size, scale, q_tile, ks, vs);
    Tensor o = mm(attn.to(at::kBFloat16), l, 1, o_w[l]);
    x = norm.call(h, o, post_norms[l], eps, true);
    d = mm(mm(x, l, 2, gate_up_w[l]), l, 3, down_w[l]);
  }
  return *d;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("bf16_layers(Tensor(a!) h, Tensor? delta, Tensor[] input_norms, Tensor[] post_norms, float eps, "
        "Tensor[] qkv_w, Tensor[] o_w, Tensor[] gate_up_w, Tensor[] down_w, int[] rows, Tensor[] blocks, "
        "int blocks_max_rows, Tensor cos, Tensor sin, "
        "int num_heads, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int block_size, float scale, int q_tile, Tensor(d!)[] k_scales, "
        "Tensor(e!)[] v_scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("bf16_layers", &bf16_layers); }
