// A Llama model's decoder layers for one step in one call (a decode step, or prefill chunks on the paged kernel;
// named for the batch-1 decode step it was first written for): each layer's op sequence
//   add_rms_norm -> GEMM (qkv) -> rope -> attend_qkv -> GEMM (o) -> add_rms_norm -> GEMM (gate/up) -> silu_mul
//   -> GEMM (down)
// with the GEMMs of quantization="gguf" (quant_gemv for one token, quant_linear for more), "gguf-a8"
// (linear_a8_packed) or dense fp32 matrices (linear), called from C++ through the dispatcher, so the results are
// those of the separate ops, bit for bit. At batch 1 the kernels of a layer take ~0.4 ms of CPU on SmolLM2-135M;
// the Python between them (argument checks, wrappers, nine trips through torch.ops with their argument parsing)
// took a further ~0.07 ms (2.1 ms of a token's CPU over 30 layers, measured). A step of several rows (a decode
// batch) pays the same Python a layer, and between two ops it leaves the other OpenMP thread spinning or asleep
// (one call: decode steps of 4-64 rows 1.07-1.20x faster on a 2-core Zen 3, alternating in one process). The other
// libraries (fused_ops, paged_attention) must be loaded before the first call, and the GEMMs' (gemv and gemm, or
// quant_a8) before the first call in that format (pagedllm/models/decode_layer.py checks).
//
// All the layers in one call (not one call a layer): the Python between the layers' calls (the layer loop, the
// fused path's checks, 27 arguments parsed a call) cost ~1 ms of a ~10 ms token on a Zen 4 at 2 threads, and each
// call's parallel region started and joined the team again.
// One token on more than one thread (one_region): the layers are one OpenMP parallel region instead of one per GEMV
// and one in attention: each GEMV is split by rows into pieces the team's threads claim (quant_gemv_part /
// linear_a8_packed_part: the same bits as the whole call), attention by kv head (attend_qkv_part, each piece
// rotating its heads first), and no barrier in between (Relay). The norms and the MLP activation are no phases of
// their own: each thread computes the normed row (on a copy of h + delta) or the activation itself, with its first
// piece of the GEMV that reads it (fused_rows.h: the ops' bits), and a residual add lands in h slice by slice in the
// next GEMV phase, when no piece reads h. Five phases a layer instead of eight, none left to one thread: with the
// norms, rope + attention and silu each on one thread while the other spun, attention alone took 2.4-3.1 Mcycles of
// a token's ~15, 1.4-1.8 by kv head; the token 1.065x faster (Zen 3, 2 threads, paired medians of 30, same tokens).
// Every region's start wakes the other thread and its end joins it; the per-op calls made ~150 such round trips a
// token on SmolLM2 (a wake from a sleeping thread costs 25-45 us), and split gguf-a8's layer matrices so badly
// that linear_a8_packed keeps them on one thread. Several rows run op by op (each op's own parallel regions).
#include "fused_rows.h"
#include "ops_common.h"

#include <ATen/ThreadLocalState.h>
#include <linux/futex.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <climits>
#include <ctime>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

namespace {

using Tensor = torch::Tensor;
using OptTensor = std::optional<Tensor>;
using pagedllm_ops::add_rms_norm_row;
using pagedllm_ops::op;
using pagedllm_ops::rotate_head;
using pagedllm_ops::silu_mul_row;

constexpr int64_t kF32 = 0;  // ggml's type number for fp32: a dense matrix
constexpr int64_t kActRows = 1024;  // rows of a prompt step's gate/up GEMM at a time (see mlp_act)

// The team's phases without barriers: a phase's work is cut into pieces claimed from an atomic counter, so the
// threads that are running do all of it, and a thread waits only for pieces another has claimed and not finished
// (spinning, then asleep on the counter: see kSpinFor). A thread the OS has parked (another process on its core) holds
// nothing up unless it was parked mid-piece; at a barrier every thread would wait for it (for whole time slices).
// The first error is kept for the caller and the phases after it are skipped, each piece still counted done: no
// thread hangs.
class Relay {
 public:
  explicit Relay(int64_t phases) : counters_(new Counter[phases]) {}

  // Phase i of the layers (phases run in order of i): pieces of work, piece(p) does piece p.
  template <typename F>
  void phase(int i, int64_t pieces, F&& piece) {
    Counter& c = counters_[i];
    for (int32_t p; (p = c.next.fetch_add(1, std::memory_order_relaxed)) < pieces;) {
      if (!failed_.load(std::memory_order_acquire)) {
        try {
          piece(p);
        } catch (...) {
          std::lock_guard<std::mutex> lock(mutex_);
          if (!error_) error_ = std::current_exception();
          failed_.store(true, std::memory_order_release);
        }
      }
      c.done.fetch_add(1, std::memory_order_seq_cst);
      if (c.sleepers.load(std::memory_order_seq_cst) > 0) futex(c.done, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr);
    }
    const auto sleep_from = std::chrono::steady_clock::now() + kSpinFor;
    for (int spins = 0;; ++spins) {
      const int32_t done = c.done.load(std::memory_order_acquire);
      if (done >= pieces) return;
      if (spins % 64 || std::chrono::steady_clock::now() < sleep_from) {
        _mm_pause();
        continue;
      }
      // asleep until done moves (the kernel compares it with `done` first; a finisher that saw no sleeper was seen
      // here), or 1 ms as a guard
      c.sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (c.done.load(std::memory_order_seq_cst) == done) {
        const timespec guard{0, 1000000};
        futex(c.done, FUTEX_WAIT_PRIVATE, done, &guard);
      }
      c.sleepers.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  void rethrow() const {
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // Spun before sleeping: longer than a layer's longest phase (attention; at 4k tokens one thread's 2 kv heads to
  // the other's 1 outlast 0.1 ms). A wait past it is for a thread parked mid-piece: yielding kept this core busy, so
  // the scheduler left the parked thread queued behind the other process for its time slice; asleep, this core is
  // idle and takes it over.
  static constexpr std::chrono::microseconds kSpinFor{1000};
  struct alignas(64) Counter {
    std::atomic<int32_t> next{0}, done{0}, sleepers{0};
  };
  static void futex(std::atomic<int32_t>& word, int op, int32_t value, const timespec* timeout) {
    syscall(SYS_futex, reinterpret_cast<int32_t*>(&word), op, value, timeout, nullptr, 0);
  }
  std::unique_ptr<Counter[]> counters_;
  std::atomic<bool> failed_{false};
  std::mutex mutex_;
  std::exception_ptr error_;
};

}  // namespace

// h: [T, E] residual stream (updated in place: each layer adds its delta, then its attention output); returns the last
// layer's MLP output [T, E] (the final norm's delta). Per layer l: input_norms[l], post_norms[l], its matrices
// (qkv_wq[l], ...), qtypes[4 l .. 4 l + 3] their GGUF formats, its pool (k_caches[l], v_caches[l]; k_scales /
// v_scales: one a layer for a quantized pool, else empty); rows: the matrices' output sizes; int8_activations: the
// matrices are pack_a8's (gguf-a8), else GGUF block rows, or dense fp32 matrices where their qtype is F32 (0).
// one_region: one token's layers on GGUF blocks in one parallel region on torch's threads (the same bits), else (and
// for more than one token or dense matrices) op by op.
Tensor decode_layer(Tensor h, OptTensor delta, at::TensorList input_norms, at::TensorList post_norms, double eps,
                    at::TensorList qkv_wq, at::TensorList o_wq, at::TensorList gate_up_wq, at::TensorList down_wq,
                    at::IntArrayRef qtypes, at::IntArrayRef rows, bool int8_activations, Tensor cos, Tensor sin,
                    int64_t num_heads, at::TensorList k_caches, at::TensorList v_caches, Tensor slot_mapping,
                    Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int64_t block_size, double scale,
                    int64_t q_tile, at::TensorList k_scales, at::TensorList v_scales, bool one_region) {
  const int64_t L = static_cast<int64_t>(input_norms.size());
  TORCH_CHECK(h.dim() == 2 && h.size(0) >= 1, "decode_layer: h must be [T, E] with T >= 1, got ", h.sizes());
  TORCH_CHECK(L > 0 && post_norms.size() == L && qkv_wq.size() == L && o_wq.size() == L && gate_up_wq.size() == L &&
                  down_wq.size() == L && k_caches.size() == L && v_caches.size() == L,
              "decode_layer: every per-layer list needs one entry a layer");
  TORCH_CHECK(k_scales.size() == v_scales.size() && (k_scales.empty() || k_scales.size() == L),
              "decode_layer: k_scales and v_scales hold one scale tensor a layer, or none");
  TORCH_CHECK(static_cast<int64_t>(qtypes.size()) == 4 * L && rows.size() == 4,
              "qtypes must give the formats of each layer's qkv, o, gate_up and down, rows their output sizes");
  static const auto norm = op<Tensor(Tensor, OptTensor, Tensor, double, bool)>("pagedllm::add_rms_norm");
  static const auto rope = op<void(Tensor, Tensor, Tensor, int64_t)>("pagedllm::rope");
  static const auto attend = op<Tensor(Tensor, int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int64_t,
                                       double, int64_t, OptTensor, OptTensor)>("pagedllm::attend_qkv");
  static const auto silu_mul = op<Tensor(Tensor, bool)>("pagedllm::silu_mul");
  const std::array<at::TensorList, 4> matrices{qkv_wq, o_wq, gate_up_wq, down_wq};
  const auto wq = [&](int64_t l, size_t i) -> const Tensor& { return matrices[i][l]; };
  auto attention = [&](int64_t l, const Tensor& qkv) {
    rope.call(qkv, cos, sin, num_heads + k_caches[l].size(0));
    const OptTensor ks = k_scales.empty() ? OptTensor() : OptTensor(k_scales[l]);
    const OptTensor vs = v_scales.empty() ? OptTensor() : OptTensor(v_scales[l]);
    return attend.call(qkv, num_heads, k_caches[l], v_caches[l], slot_mapping, block_tables, seq_lens,
                       query_start_loc, block_size, scale, q_tile, ks, vs);
  };
  const bool dense = std::any_of(qtypes.begin(), qtypes.end(), [](int64_t t) { return t == kF32; });
  const int nthreads = one_region && h.size(0) == 1 && !dense ? at::get_num_threads() : 1;
  if (nthreads <= 1) {
    auto linear = [&](const Tensor& x, int64_t l, size_t i) {  // looked up on first use: one format's library
      if (int8_activations) {
        static const auto a8 = op<Tensor(Tensor, Tensor, int64_t, int64_t, OptTensor)>("pagedllm::linear_a8_packed");
        return a8.call(x, wq(l, i), qtypes[4 * l + i], rows[i], std::nullopt);
      }
      if (qtypes[4 * l + i] == kF32) {
        static const auto dense_gemm = op<Tensor(Tensor, Tensor, OptTensor)>("pagedllm::linear");
        return dense_gemm.call(x, wq(l, i), std::nullopt);
      }
      if (x.size(0) == 1) {
        static const auto gemv = op<Tensor(Tensor, Tensor, int64_t, OptTensor)>("pagedllm::quant_gemv");
        return gemv.call(x, wq(l, i), qtypes[4 * l + i], std::nullopt);
      }
      static const auto gemm = op<Tensor(Tensor, Tensor, int64_t, OptTensor)>("pagedllm::quant_linear");
      return gemm.call(x, wq(l, i), qtypes[4 * l + i], std::nullopt);
    };
    // silu(gate) * up of x's rows, in chunks of at most kActRows rows: a prompt step's whole [T, 2I] (48 MB for 4,096
    // rows of SmolLM2) is past glibc's largest mmap threshold (32 MB), so every layer mapped it afresh, its 2 MB pages
    // zeroed in the page faults, and unmapped it; a chunk's is heap memory used again chunk after chunk, read back
    // from L3. Chunks of at least PANEL_MIN_ROWS rows: gemm.cpp's panels, the bits of the whole call.
    auto mlp_act = [&](const Tensor& x, int64_t l) {
      const int64_t T = x.size(0), chunks = (T + kActRows - 1) / kActRows;
      if (chunks == 1) return silu_mul.call(linear(x, l, 2), false);
      Tensor act = torch::empty({T, rows[2] / 2}, x.options());
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t b = T * c / chunks, e = T * (c + 1) / chunks;
        act.narrow(0, b, e - b).copy_(silu_mul.call(linear(x.narrow(0, b, e - b), l, 2), false));
      }
      return act;
    };
    OptTensor d = delta;
    for (int64_t l = 0; l < L; ++l) {
      Tensor x = norm.call(h, d, input_norms[l], eps, false);
      Tensor o = linear(attention(l, linear(x, l, 0)), l, 1);
      x = norm.call(h, o, post_norms[l], eps, false);
      d = linear(mlp_act(x, l), l, 3);
    }
    return *d;
  }
  // the norms and the activation run inline on each thread (fused_rows.h): their ops' checks, once
  const int64_t E = h.size(1);
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous(), "decode_layer: h must be contiguous float32");
  TORCH_CHECK(!delta.has_value() || !delta->defined() ||
                  (delta->scalar_type() == at::kFloat && delta->is_contiguous() && delta->sizes() == h.sizes()),
              "decode_layer: delta must be None or a contiguous float32 tensor shaped like h");
  TORCH_CHECK(rows[1] == E && rows[3] == E && rows[2] % 2 == 0,
              "decode_layer: o and down must output E values, gate_up an even number");
  std::vector<const float*> in_w(L), post_w(L);
  for (int64_t l = 0; l < L; ++l) {
    for (const Tensor* w : {&input_norms[l], &post_norms[l]})
      TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == E,
                  "decode_layer: norm weights must be contiguous float32 [E]");
    in_w[l] = input_norms[l].data_ptr<float>(), post_w[l] = post_norms[l].data_ptr<float>();
  }
  // thread t's share of a GEMV into y
  auto part = [&](const Tensor& x, int64_t l, size_t i, const Tensor& y, int64_t t, int64_t n) {
    if (int8_activations) {
      static const auto a8 = op<void(Tensor, Tensor, int64_t, int64_t, Tensor, int64_t, int64_t)>(
          "pagedllm::linear_a8_packed_part");
      a8.call(x, wq(l, i), qtypes[4 * l + i], rows[i], y, t, n);
    } else {
      static const auto gemv = op<void(Tensor, Tensor, int64_t, Tensor, int64_t, int64_t)>("pagedllm::quant_gemv_part");
      gemv.call(x, wq(l, i), qtypes[4 * l + i], y, t, n);
    }
  };
  // the shared outputs, reused by every layer: a layer's first phase has read the last one's down before its own is
  // written; each thread's own normed rows (x) and MLP activation (act)
  auto out = [&](int64_t n) { return torch::empty({1, n}, h.options()); };
  const Tensor qkv = out(rows[0]), o = out(rows[1]), gate_up = out(rows[2]), down = out(rows[3]);
  std::vector<Tensor> xs, acts;
  for (int t = 0; t < nthreads; ++t) xs.push_back(out(E)), acts.push_back(out(rows[2] / 2));
  float* hp = h.data_ptr<float>();
  const float* const d0 = delta.has_value() && delta->defined() ? delta->data_ptr<float>() : nullptr;
  const float *ob = o.data_ptr<float>(), *downp = down.data_ptr<float>(), *gup = gate_up.data_ptr<float>();
  const float ep = static_cast<float>(eps);
  // attention by kv head: each piece rotates its query and key heads, writes its K/V rows and attends its heads
  const int64_t Hkv = k_caches[0].size(0), group = num_heads / Hkv, half = cos.size(1), ld = qkv.size(1);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == 1 && sin.sizes() == cos.sizes() &&
                  (num_heads + Hkv) * 2 * half <= ld && num_heads % Hkv == 0,
              "decode_layer: cos and sin must be contiguous float32 [1, D/2] for the qkv heads");
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* qkvp = qkv.data_ptr<float>();
  const Tensor attn = out(num_heads * 2 * half);
  auto attend_part = [&](int64_t l, int64_t p) {
    static const auto attend = op<void(Tensor, int64_t, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int64_t,
                                       double, int64_t, OptTensor, OptTensor, Tensor, int64_t, int64_t)>(
        "pagedllm::attend_qkv_part");
    for (int64_t n : {p * group, num_heads + p})  // the first of its q heads and its k head
      for (int64_t j = 0; j < (n < num_heads ? group : 1); ++j) {
        float* x1 = qkvp + (n + j) * 2 * half;
        rotate_head(x1, x1 + half, x1, x1 + half, cp, sp, half);
      }
    const OptTensor ks = k_scales.empty() ? OptTensor() : OptTensor(k_scales[l]);
    const OptTensor vs = v_scales.empty() ? OptTensor() : OptTensor(v_scales[l]);
    attend.call(qkv, num_heads, k_caches[l], v_caches[l], slot_mapping, block_tables, seq_lens, query_start_loc,
                block_size, scale, q_tile, ks, vs, attn, p, Hkv);
  };
  Relay relay(5 * L);
  const int64_t pieces = 2 * nthreads;  // per GEMV: a parked thread's share is taken by the others
  const at::ThreadLocalState tls;  // the caller's (inference mode, dispatch keys) for the team's dispatcher calls
#pragma omp parallel num_threads(nthreads)
  {
    at::ThreadLocalStateGuard guard(tls);
    const int t = omp_get_thread_num();
    const Tensor &x = xs[t], &act = acts[t];
    float *xp = x.data_ptr<float>(), *ap = act.data_ptr<float>();
    std::vector<float> hd(E);
    int64_t ready = -1;  // the phase whose input x / act holds
    // x = rms_norm(h + d) * w, h itself unchanged: the first piece of a phase this thread claims computes it
    auto norm_once = [&](int64_t phase, const float* d, const float* w) {
      if (ready == phase) return;
      std::copy(hp, hp + E, hd.data());
      if (d) add_rms_norm_row<true>(hd.data(), d, w, xp, E, ep);
      else add_rms_norm_row<false>(hd.data(), d, w, xp, E, ep);
      ready = phase;
    };
    // h += d on piece p's slice of h, in a phase after the last one reading h
    auto add_slice = [&](const float* d, int64_t p) {
      if (d)
        for (int64_t e = E * p / pieces, end = E * (p + 1) / pieces; e < end; ++e) hp[e] += d[e];
    };
    for (int64_t l = 0, b = 0; l < L; ++l, b += 5) {
      const float* d = l ? downp : d0;
      relay.phase(b, pieces, [&](int64_t p) {
        norm_once(b, d, in_w[l]);
        part(x, l, 0, qkv, p, pieces);
      });
      relay.phase(b + 1, Hkv, [&](int64_t p) { attend_part(l, p); });
      relay.phase(b + 2, pieces, [&](int64_t p) {
        add_slice(d, p);
        part(attn, l, 1, o, p, pieces);
      });
      relay.phase(b + 3, pieces, [&](int64_t p) {
        norm_once(b + 3, ob, post_w[l]);
        part(x, l, 2, gate_up, p, pieces);
      });
      relay.phase(b + 4, pieces, [&](int64_t p) {
        if (ready != b + 4) silu_mul_row(gup, ap, rows[2] / 2), ready = b + 4;
        add_slice(ob, p);
        part(act, l, 3, down, p, pieces);
      });
    }
  }
  relay.rethrow();
  return down;
}

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  m.def("decode_layer(Tensor(a!) h, Tensor? delta, Tensor[] input_norms, Tensor[] post_norms, float eps, "
        "Tensor[] qkv_wq, Tensor[] o_wq, Tensor[] gate_up_wq, Tensor[] down_wq, int[] qtypes, int[] rows, "
        "bool int8_activations, Tensor cos, Tensor sin, int num_heads, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int block_size, "
        "float scale, int q_tile, Tensor(d!)[] k_scales, Tensor(e!)[] v_scales, bool one_region=False) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("decode_layer", &decode_layer); }
