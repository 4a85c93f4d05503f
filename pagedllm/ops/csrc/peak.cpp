// The cores' arithmetic peak: each thread runs one instruction back to back on registers (no loads, 12
// independent accumulators, so neither memory nor latency limits it), the most any kernel of that instruction can
// do here. `bench roofline` measures the GEMM paths against it: a GEMM path is a library's reach, this is the
// hardware's, and W1's floor at it is the one no engine can pass on this CPU.
//
// Units: fp32_fma (AVX-512 or AVX2 FMA, 2 FLOPs a lane), bf16_dot (AVX512-BF16 VDPBF16PS, 2 products a lane),
// int8_dot (AVX512-VNNI VPDPBUSD, 4 products a lane; on AVX2 the VPMADDUBSW + VPMADDWD + VPADDD sequence that
// llama.cpp and quant_a8.cpp use), amx_bf16 (AMX TDPBF16PS on four accumulator tiles, where usable). A unit this
// CPU or build lacks returns 0.
#include "ops_common.h"

#include <omp.h>

#include <string>

namespace {

constexpr int ACC = 12;

// Runs `body(acc)` `iters` times on ACC accumulators kept in registers, and folds them so that nothing is dead code.
template <typename V, typename Body, typename Fold>
double chain(int64_t iters, V init, Body&& body, Fold&& fold) {
  V acc[ACC];
  for (auto& a : acc) a = init;
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < ACC; ++j) acc[j] = body(acc[j]);
  }
  double sink = 0;
  for (auto& a : acc) sink += fold(a);
  return sink;
}

// FLOPs one thread does in `iters` rounds of `unit` (0: not here); `sink` keeps the result live
double run_unit(const std::string& unit, int64_t iters, double& sink) {
#if defined(__AVX512F__)
  if (unit == "fp32_fma") {
    const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-9f);
    sink += chain(iters, _mm512_setzero_ps(), [&](__m512 c) { return _mm512_fmadd_ps(a, b, c); },
                  [](__m512 c) { return static_cast<double>(_mm512_reduce_add_ps(c)); });
    return 32.0 * ACC * iters;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (unit == "fp32_fma") {
    const __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-9f);
    sink += chain(iters, _mm256_setzero_ps(), [&](__m256 c) { return _mm256_fmadd_ps(a, b, c); },
                  [](__m256 c) { return static_cast<double>(pagedllm_ops::hsum8(c)); });
    return 16.0 * ACC * iters;
  }
#endif
#if defined(__AVX512BF16__)
  if (unit == "bf16_dot") {
    const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a;  // bf16 pairs (1, 1)
    sink += chain(iters, _mm512_setzero_ps(), [&](__m512 c) { return _mm512_dpbf16_ps(c, a, b); },
                  [](__m512 c) { return static_cast<double>(_mm512_reduce_add_ps(c)); });
    return 64.0 * ACC * iters;
  }
#endif
#if defined(__AVX512VNNI__)
  if (unit == "int8_dot") {
    const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
    sink += chain(iters, _mm512_setzero_si512(), [&](__m512i c) { return _mm512_dpbusd_epi32(c, a, b); },
                  [](__m512i c) { return static_cast<double>(_mm512_reduce_add_epi32(c)); });
    return 128.0 * ACC * iters;
  }
#elif defined(__AVX2__)
  if (unit == "int8_dot") {
    const __m256i a = _mm256_set1_epi8(1), b = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1);
    sink += chain(iters, _mm256_setzero_si256(),
                  [&](__m256i c) { return _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones)); },
                  [](__m256i c) { return static_cast<double>(_mm256_extract_epi32(c, 0)); });
    return 64.0 * ACC * iters;
  }
#endif
#ifdef PAGEDLLM_AMX
  if (unit == "amx_bf16" && pagedllm_ops::amx_usable()) {
    const pagedllm_ops::TileConfig cfg;
    _tile_loadconfig(&cfg);
    _tile_zero(0);  // tile numbers are immediates: GCC's macros paste them into the instruction
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t i = 0; i < iters; ++i) {  // 4 x 3 = ACC tile products a round: 16 x 16 outputs, 32 products each
      for (int r = 0; r < 3; ++r) {
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 5);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    alignas(64) float out[16 * 16];
    _tile_stored(0, out, 64);
    _tile_release();
    sink += out[0];
    return 2.0 * 16 * 16 * 32 * ACC * iters;
  }
#endif
  (void)iters;
  (void)sink;
  return 0.0;
}

// flops[0] = the FLOPs all torch threads did together, `iters` rounds each (one OpenMP region; time it around the
// call). A tensor to write into, not a returned float: an op needs a tensor argument to dispatch on.
void instruction_peak(at::Tensor& flops, std::string unit, int64_t iters) {
  TORCH_CHECK(unit == "fp32_fma" || unit == "bf16_dot" || unit == "int8_dot" || unit == "amx_bf16",
              "instruction_peak: unit must be fp32_fma, bf16_dot, int8_dot or amx_bf16, got ", unit);
  TORCH_CHECK(iters > 0, "instruction_peak: iters must be positive");
  TORCH_CHECK(flops.scalar_type() == at::kDouble && flops.numel() == 1, "instruction_peak: flops must be one float64");
  double total = 0, sink = 0;
#pragma omp parallel num_threads(at::get_num_threads()) reduction(+ : total, sink)
  total += run_unit(unit, iters, sink);
  flops.fill_(sink == -1.0 ? 0.0 : total);  // sink is never -1: the comparison keeps it live
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.set_python_module("pagedllm.ops.fake");
  // flops[0] = FLOPs `iters` rounds of one instruction took on every torch thread (0: not on this CPU or build)
  m.def("instruction_peak(Tensor(a!) flops, str unit, int iters) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("instruction_peak", &instruction_peak); }
