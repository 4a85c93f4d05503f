// A step's inputs gathered from the worker's persistent batch (pagedllm/worker/input_batch.py) in one call: the
// input ids, positions, slot mapping, block tables, sequence lengths, query starts and adapter ids of the scheduled
// rows. The same gather as ATen index ops took ~40 dispatcher round trips a step (torch.tensor, repeat_interleave,
// cumsum, index, ...), ~0.15-0.4 ms of a batch-1 decode step's ~9 ms on a 2-core Zen 3 whatever the batch's size;
// this is one, and its loops run over the step's tokens in C++.
#include "ops_common.h"

#include <algorithm>
#include <tuple>

namespace {

using Tensor = torch::Tensor;

// token_ids [R, L] int64, block_table [R, MB] int32, num_blocks [R] int64, lora_id [R] int64: the batch's rows.
// rows / query_lens / starts: the step's sequences in attention order (decodes first), each row's new tokens at
// positions starts[b] .. starts[b] + query_lens[b] - 1. Returns (input_ids [T], positions [T], slot_mapping [T],
// block_tables [B, max(1, max num_blocks)] int32, seq_lens [B] int32, query_start_loc [B + 1] int32, lora_ids [T]
// int64, or [0] where no row has an adapter).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> step_inputs(
    const Tensor& token_ids, const Tensor& block_table, const Tensor& num_blocks, const Tensor& lora_id,
    at::IntArrayRef rows, at::IntArrayRef query_lens, at::IntArrayRef starts, int64_t block_size) {
  TORCH_CHECK(token_ids.dim() == 2 && token_ids.scalar_type() == at::kLong && token_ids.is_contiguous(),
              "step_inputs: token_ids must be a contiguous int64 [rows, max_model_len]");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt && block_table.is_contiguous() &&
                  block_table.size(0) == token_ids.size(0),
              "step_inputs: block_table must be a contiguous int32 [rows, max_blocks]");
  const int64_t R = token_ids.size(0), L = token_ids.size(1), MB = block_table.size(1);
  for (const Tensor* t : {&num_blocks, &lora_id})
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous() && t->size(0) == R,
                "step_inputs: num_blocks and lora_id must be contiguous int64 [rows]");
  const int64_t B = static_cast<int64_t>(rows.size());
  TORCH_CHECK(B >= 1 && query_lens.size() == rows.size() && starts.size() == rows.size() && block_size > 0,
              "step_inputs: rows, query_lens and starts need one entry a sequence (at least one), block_size > 0");
  const int64_t* nb = num_blocks.data_ptr<int64_t>();
  const int64_t* lid = lora_id.data_ptr<int64_t>();
  int64_t T = 0, width = 1;
  bool adapters = false;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t r = rows[b], q = query_lens[b], s = starts[b];
    TORCH_CHECK(0 <= r && r < R, "step_inputs: row ", r, " is not one of the batch's ", R);
    TORCH_CHECK(q >= 1 && s >= 0 && s + q <= L, "step_inputs: tokens ", s, "..", s + q, " of row ", r,
                " are outside its ", L);
    T += q;
    width = std::max(width, nb[r]);
    adapters = adapters || lid[r] != 0;
  }
  TORCH_CHECK(width <= MB, "step_inputs: a row holds ", width, " blocks, more than the table's ", MB);
  const auto i64 = token_ids.options(), i32 = block_table.options();
  Tensor input_ids = torch::empty({T}, i64), positions = torch::empty({T}, i64), slots = torch::empty({T}, i64);
  Tensor tables = torch::empty({B, width}, i32), seq_lens = torch::empty({B}, i32);
  Tensor qsl = torch::empty({B + 1}, i32), lora_ids = torch::empty({adapters ? T : 0}, i64);
  const int64_t* tok = token_ids.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  int64_t *ids = input_ids.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>(), *slot = slots.data_ptr<int64_t>();
  int64_t* lo = lora_ids.data_ptr<int64_t>();
  int32_t *tab = tables.data_ptr<int32_t>(), *sl = seq_lens.data_ptr<int32_t>(), *qs = qsl.data_ptr<int32_t>();
  qs[0] = 0;
  for (int64_t b = 0, t = 0; b < B; ++b) {
    const int64_t r = rows[b], s = starts[b], end = s + query_lens[b];
    const int32_t* row_table = table + r * MB;
    std::copy(row_table, row_table + width, tab + b * width);
    TORCH_CHECK((end - 1) / block_size < width, "step_inputs: position ", end - 1, " of row ", r,
                " is past the step's ", width, " blocks");
    for (int64_t p = s; p < end; ++p, ++t) {
      ids[t] = tok[r * L + p];
      pos[t] = p;
      slot[t] = static_cast<int64_t>(row_table[p / block_size]) * block_size + p % block_size;
      if (adapters) lo[t] = lid[r];
    }
    sl[b] = static_cast<int32_t>(end);
    qs[b + 1] = static_cast<int32_t>(t);
  }
  return {input_ids, positions, slots, tables, seq_lens, qsl, lora_ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("step_inputs(Tensor token_ids, Tensor block_table, Tensor num_blocks, Tensor lora_id, int[] rows, "
        "int[] query_lens, int[] starts, int block_size) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("step_inputs", &step_inputs); }
