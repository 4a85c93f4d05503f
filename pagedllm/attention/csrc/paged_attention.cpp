// Paged attention for x86 CPUs, reading K/V in place from the block pool.
//
// One work item = (sequence, query tile, kv head).  All `group` query heads that share the kv
// head are computed together, so every K/V row is read once per tile.  Keys are visited in
// chunks of up to CHUNK logical positions through the block table; softmax is online
// (flash-decoding style) with fp32 accumulation.  Works for decodes (tile = the single query)
// and prefill chunks (tile = up to q_tile queries, causal: query at position p sees keys 0..p).
// Caches may be fp32 or bf16; q/out may be fp32 or bf16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t CHUNK = 64;

inline void row_to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void row_to_float(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  int64_t d = 0;
#ifdef __AVX2__
  for (; d + 8 <= n; d += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d));
    __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(w));
  }
#endif
  for (; d < n; ++d) {
    uint32_t u = static_cast<uint32_t>(s[d]) << 16;
    std::memcpy(dst + d, &u, 4);
  }
}
inline void float_to_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void float_to_row(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<at::BFloat16>(src[d]);
}

// s[o] = dot(q, k[o]) * scale for o < n
inline void scores_row(const float* q, const float* const* k, int64_t n, int64_t D, float scale, float* s) {
  int64_t o = 0;
#ifdef __AVX2__
  if (D % 8 == 0) {
    for (; o + 4 <= n; o += 4) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      const float *k0 = k[o], *k1 = k[o + 1], *k2 = k[o + 2], *k3 = k[o + 3];
      for (int64_t d = 0; d < D; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
      }
      __m256 ab = _mm256_hadd_ps(a0, a1), cd = _mm256_hadd_ps(a2, a3);
      __m256 abcd = _mm256_hadd_ps(ab, cd);
      __m128 r = _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
      _mm_storeu_ps(s + o, _mm_mul_ps(r, _mm_set1_ps(scale)));
    }
  }
#endif
  for (; o < n; ++o) {
    float acc = 0.f;
    const float* kr = k[o];
    for (int64_t d = 0; d < D; ++d) acc += q[d] * kr[d];
    s[o] = acc * scale;
  }
}

// acc[:] += sum_o p[o] * v[o][:]
inline void pv_row(const float* p, const float* const* v, int64_t n, int64_t D, float* acc) {
  int64_t d = 0;
#ifdef __AVX2__
  for (; d + 32 <= D; d += 32) {
    __m256 c0 = _mm256_loadu_ps(acc + d), c1 = _mm256_loadu_ps(acc + d + 8);
    __m256 c2 = _mm256_loadu_ps(acc + d + 16), c3 = _mm256_loadu_ps(acc + d + 24);
    for (int64_t o = 0; o < n; ++o) {
      if (p[o] == 0.f) continue;
      __m256 pv = _mm256_set1_ps(p[o]);
      const float* vr = v[o] + d;
      c0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr), c0);
      c1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8), c1);
      c2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 16), c2);
      c3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 24), c3);
    }
    _mm256_storeu_ps(acc + d, c0);
    _mm256_storeu_ps(acc + d + 8, c1);
    _mm256_storeu_ps(acc + d + 16, c2);
    _mm256_storeu_ps(acc + d + 24, c3);
  }
#endif
  for (; d < D; ++d) {
    float c = acc[d];
    for (int64_t o = 0; o < n; ++o) c += p[o] * v[o][d];
    acc[d] = c;
  }
}

struct Item {
  int32_t seq, q_begin, q_end, kv_head;  // q_begin/q_end: offsets inside the sequence's queries
};

template <typename qscalar_t, typename kvscalar_t>
void run_items(const std::vector<Item>& items, const torch::Tensor& q, const torch::Tensor& k_cache,
               const torch::Tensor& v_cache, torch::Tensor& out, const int32_t* tables, int64_t table_stride,
               const int32_t* seq_lens, const int32_t* qsl, int64_t block_size, float scale, int64_t max_rows) {
  const int64_t H = q.size(1), D = q.size(2), Hkv = k_cache.size(0), group = H / Hkv;
  const qscalar_t* qp = q.data_ptr<qscalar_t>();
  qscalar_t* op = out.data_ptr<qscalar_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const kvscalar_t* kp = k_cache.data_ptr<kvscalar_t>();
  const kvscalar_t* vp = v_cache.data_ptr<kvscalar_t>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  constexpr bool kv_is_float = std::is_same_v<kvscalar_t, float>;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int nthreads = std::max<int>(1, std::min<int64_t>(at::get_num_threads(), n_items));

#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> qbuf(max_rows * D), acc(max_rows * D), m(max_rows), l(max_rows), s(max_rows * CHUNK);
    std::vector<float> kbuf(kv_is_float ? 0 : CHUNK * D), vbuf(kv_is_float ? 0 : CHUNK * D), obuf(D);
    std::vector<int64_t> pos(max_rows);
    const float* krow[CHUNK];
    const float* vrow[CHUNK];
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[it];
      const int64_t q_len = qsl[w.seq + 1] - qsl[w.seq];
      const int64_t seq_len = seq_lens[w.seq];
      const int64_t first_pos = seq_len - q_len;
      const int64_t nq = w.q_end - w.q_begin, R = nq * group;
      const int32_t* table = tables + w.seq * table_stride;
      // rows: r = qi * group + g  ->  token qsl[seq] + q_begin + qi, head kv_head * group + g
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t t = qsl[w.seq] + w.q_begin + qi;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = qi * group + g;
          row_to_float(qp + t * qs0 + (w.kv_head * group + g) * qs1, qbuf.data() + r * D, D);
          pos[r] = first_pos + w.q_begin + qi;
        }
      }
      std::fill(acc.begin(), acc.begin() + R * D, 0.f);
      std::fill(m.begin(), m.begin() + R, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + R, 0.f);
      const int64_t kv_end = first_pos + w.q_end;  // keys 0 .. last query's position
      for (int64_t c0 = 0; c0 < kv_end; c0 += CHUNK) {
        const int64_t n = std::min(CHUNK, kv_end - c0);
        for (int64_t o = 0; o < n; ++o) {
          const int64_t lp = c0 + o;
          const int64_t slot = static_cast<int64_t>(table[lp / block_size]) * block_size + lp % block_size;
          const kvscalar_t* kr = kp + w.kv_head * ks0 + slot * ks1;
          const kvscalar_t* vr = vp + w.kv_head * vs0 + slot * vs1;
          if constexpr (kv_is_float) {
            krow[o] = reinterpret_cast<const float*>(kr);
            vrow[o] = reinterpret_cast<const float*>(vr);
          } else {
            row_to_float(kr, kbuf.data() + o * D, D);
            row_to_float(vr, vbuf.data() + o * D, D);
            krow[o] = kbuf.data() + o * D;
            vrow[o] = vbuf.data() + o * D;
          }
        }
        for (int64_t r = 0; r < R; ++r) {
          if (pos[r] < c0) continue;  // causal: nothing in this chunk is visible to the row
          const int64_t nv = std::min(n, pos[r] - c0 + 1);  // visible keys of the chunk
          float* sr = s.data() + r * CHUNK;
          scores_row(qbuf.data() + r * D, krow, nv, D, scale, sr);
          float mx = m[r];
          for (int64_t o = 0; o < nv; ++o) mx = std::max(mx, sr[o]);
          const float corr = std::exp(m[r] - mx);  // m[r] = -inf on the first chunk -> 0
          float sum = 0.f;
          for (int64_t o = 0; o < nv; ++o) {
            sr[o] = std::exp(sr[o] - mx);
            sum += sr[o];
          }
          float* ar = acc.data() + r * D;
          if (corr != 1.f)
            for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
          l[r] = l[r] * corr + sum;
          m[r] = mx;
          pv_row(sr, vrow, nv, D, ar);
        }
      }
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t t = qsl[w.seq] + w.q_begin + qi;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = qi * group + g;
          const float inv = 1.f / l[r];
          for (int64_t d = 0; d < D; ++d) obuf[d] = acc[r * D + d] * inv;
          float_to_row(obuf.data(), op + t * os0 + (w.kv_head * group + g) * os1, D);
        }
      }
    }
  }
}

}  // namespace

// Attend the queries of sequences [seq_begin, seq_end) of the flat batch; writes their rows of `out`.
void paged_attention_out(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                         int64_t block_size, double scale, int64_t seq_begin, int64_t seq_end, int64_t q_tile) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "last dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out dtypes differ");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v cache dtypes differ");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "num heads must be a multiple of num kv heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt, "metadata must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() && query_start_loc.is_contiguous());
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t Hkv = k_cache.size(0), group = q.size(1) / Hkv;
  q_tile = std::max<int64_t>(1, q_tile);
  std::vector<Item> items;
  for (int64_t b = seq_begin; b < seq_end; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b];
    for (int64_t t0 = 0; t0 < q_len; t0 += q_tile)
      for (int64_t h = 0; h < Hkv; ++h)
        items.push_back({(int32_t)b, (int32_t)t0, (int32_t)std::min(q_len, t0 + q_tile), (int32_t)h});
  }
  if (items.empty()) return;
  const int64_t max_rows = q_tile * group;
  pybind11::gil_scoped_release no_gil;
  auto dispatch = [&](auto qdummy, auto kvdummy) {
    using QT = decltype(qdummy);
    using KT = decltype(kvdummy);
    run_items<QT, KT>(items, q, k_cache, v_cache, out, block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                      seq_lens.data_ptr<int32_t>(), qsl, block_size, static_cast<float>(scale), max_rows);
  };
  const bool q_f = q.scalar_type() == at::kFloat, kv_f = k_cache.scalar_type() == at::kFloat;
  TORCH_CHECK(q_f || q.scalar_type() == at::kBFloat16, "q must be float32 or bfloat16");
  TORCH_CHECK(kv_f || k_cache.scalar_type() == at::kBFloat16, "kv cache must be float32 or bfloat16");
  if (q_f && kv_f) dispatch(float{}, float{});
  else if (q_f) dispatch(float{}, at::BFloat16{});
  else if (kv_f) dispatch(at::BFloat16{}, float{});
  else dispatch(at::BFloat16{}, at::BFloat16{});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_out", &paged_attention_out, "paged attention over the block pool (in place)");
}
