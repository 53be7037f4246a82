// Few-row products over GGUF-style quantized weights, AVX2/FMA/F16C (cipherlm's CPU decode kernels).
// f32_mm: few-row fp32 products over the weight as torch keeps it ([N, K], rows contiguous), one weight row
// at a time with four independent accumulators (on the AVX-512 Zen 4 EPYC box one sequential stream
// per row reads DRAM at 19-29 GB/s at one thread where MKL's GEMV made 13-21; several rows at once, 10-17).
//
// Weights, as the GGUF blocks are laid out (struct of arrays, rows contiguous):
//   q4_1: qs uint8 [N, K/2] (per block of 32: byte j holds weight j in its low nibble and weight j+16 in
//         its high nibble), d and m fp16 [N, K/32];   w = d * u + m
//   q8_0: qs int8  [N, K],  d fp16 [N, K/32];         w = d * q
// Activations are quantized per block of 32 to int8 (llama.cpp's q8_1 / q8_0): dx = amax / 127,
// qx = round(x / dx), and sx = dx * sum(qx) for q4_1's min term. A block's product is then one integer
// dot product: d * dx * <u, qx> + m * sx (q4_1) or d * dx * <q, qx> (q8_0).
// Rows of the output are split over torch's intra-op threads (at::parallel_for).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t QK = 32;

// x [M, K] fp32 -> qx [M, K] int8, dx [M, K/32], sx [M, K/32] (dx * sum of the block's qx)
void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* qx, float* dx, float* sx) {
  const int64_t g = k / QK;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < g; ++b) {
      const float* src = x + r * k + b * QK;
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(src[j]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      int8_t* dst = qx + r * k + b * QK;
      for (int j = 0; j < QK; ++j) {
        const int q = static_cast<int>(std::nearbyint(src[j] * inv));
        dst[j] = static_cast<int8_t>(q);
        sum += q;
      }
      dx[r * g + b] = d;
      sx[r * g + b] = d * static_cast<float>(sum);
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 nibbles of one q4_1 block as bytes, in weight order (low nibbles = weights 0..15, high = 16..31)
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// <u, q> of 32 unsigned (0..15) and 32 signed bytes, as 8 int32 lanes converted to float
inline __m256 dot_u8_i8(__m256i u, __m256i q) {
  const __m256i p16 = _mm256_maddubs_epi16(u, q);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

inline __m256 dot_i8_i8(__m256i a, __m256i b) {
  return dot_u8_i8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

inline float f16(const at::Half* p) {
  return _cvtsh_ss(reinterpret_cast<const uint16_t*>(p)[0]);
}

// Per weight row: the block scale products d * dx (and q4_1's min term, sum of m * sx) are computed 8
// blocks at a time first, then the integer dot products run over the blocks. q4_1 takes two weight rows
// together (each activation block loaded once for both: 13.7 vs 9.8 GB/s streaming the 49152 x 576 head
// from DRAM at one thread); q8_0 one (16.4 GB/s; two rows measured 9.0). Activation rows are few
// (decode: 1) and stay in L1.
inline void scales_row(const at::Half* wd, const float* ad, int64_t g, float* out) {
  int64_t b = 0;
  for (; b + 8 <= g; b += 8) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b)));
    _mm256_storeu_ps(out + b, _mm256_mul_ps(d, _mm256_loadu_ps(ad + b)));
  }
  for (; b < g; ++b) out[b] = f16(wd + b) * ad[b];
}

inline float mins_row(const at::Half* wm, const float* as, int64_t g) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= g; b += 8) {
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wm + b)));
    acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(as + b), acc);
  }
  float s = hsum(acc);
  for (; b < g; ++b) s += f16(wm + b) * as[b];
  return s;
}

void q4_1_rows(const uint8_t* qs, const at::Half* d, const at::Half* mn, const int8_t* qx, const float* dx,
               const float* sx, float* out, int64_t n0, int64_t n1, int64_t m, int64_t k, int64_t n) {
  const int64_t g = k / QK;
  std::vector<float> buf(2 * g);
  float *s0 = buf.data(), *s1 = buf.data() + g;
  int64_t row = n0;
  for (; row + 2 <= n1; row += 2) {
    const uint8_t* w0 = qs + row * (k / 2);
    const uint8_t* w1 = w0 + k / 2;
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* aq = qx + r * k;
      scales_row(d + row * g, dx + r * g, g, s0);
      scales_row(d + (row + 1) * g, dx + r * g, g, s1);
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      for (int64_t b = 0; b < g; ++b) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + b * QK));
        acc0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s0 + b), dot_u8_i8(unpack_nibbles(w0 + b * 16), q), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_broadcast_ss(s1 + b), dot_u8_i8(unpack_nibbles(w1 + b * 16), q), acc1);
      }
      out[r * n + row] = hsum(acc0) + mins_row(mn + row * g, sx + r * g, g);
      out[r * n + row + 1] = hsum(acc1) + mins_row(mn + (row + 1) * g, sx + r * g, g);
    }
  }
  for (; row < n1; ++row) {
    const uint8_t* w0 = qs + row * (k / 2);
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* aq = qx + r * k;
      scales_row(d + row * g, dx + r * g, g, s0);
      __m256 acc0 = _mm256_setzero_ps();
      for (int64_t b = 0; b < g; ++b) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + b * QK));
        acc0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s0 + b), dot_u8_i8(unpack_nibbles(w0 + b * 16), q), acc0);
      }
      out[r * n + row] = hsum(acc0) + mins_row(mn + row * g, sx + r * g, g);
    }
  }
}

void q8_0_rows(const int8_t* qs, const at::Half* d, const int8_t* qx, const float* dx, float* out,
               int64_t n0, int64_t n1, int64_t m, int64_t k, int64_t n) {
  const int64_t g = k / QK;
  std::vector<float> buf(g);
  float* s0 = buf.data();
  int64_t row = n0;
  for (; row < n1; ++row) {
    const int8_t* w0 = qs + row * k;
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* aq = qx + r * k;
      scales_row(d + row * g, dx + r * g, g, s0);
      __m256 acc0 = _mm256_setzero_ps();
      for (int64_t b = 0; b < g; ++b) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + b * QK));
        const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + b * QK));
        acc0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s0 + b), dot_i8_i8(a0, q), acc0);
      }
      out[r * n + row] = hsum(acc0);
    }
  }
}

// out[r, j] = <w[j, :], x[r, :]> for rows j of [n0, n1): each weight row streamed once, x's rows (few) in L1
void f32_rows(const float* w, const float* x, float* out, int64_t n0, int64_t n1, int64_t rows, int64_t k,
              int64_t n) {
  for (int64_t j = n0; j < n1; ++j) {
    const float* wj = w + j * k;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * k;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      int64_t c = 0;
      for (; c + 32 <= k; c += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + c), _mm256_loadu_ps(xr + c), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + c + 8), _mm256_loadu_ps(xr + c + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + c + 16), _mm256_loadu_ps(xr + c + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + c + 24), _mm256_loadu_ps(xr + c + 24), a3);
      }
      for (; c + 8 <= k; c += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wj + c), _mm256_loadu_ps(xr + c), a0);
      float acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      for (; c < k; ++c) acc += wj[c] * xr[c];
      out[r * n + j] = acc;
    }
  }
}

void check_x(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous fp32 CPU [M, K] tensor");
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
}

constexpr int64_t GRAIN = 16;  // output rows per task

at::Tensor q4_1_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  const int64_t n = qs.size(0), k = qs.size(1) * 2, g = k / QK;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && k % QK == 0, "qs: uint8 [N, K/2]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.is_contiguous() &&
              m.is_contiguous() && d.numel() == n * g && m.numel() == n * g, "d, m: fp16 [N, K/32]");
  check_x(x, k);
  const int64_t rows = x.size(0);
  auto qx = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto dx = at::empty({rows, g}, x.options()), sx = at::empty({rows, g}, x.options());
  quantize_rows(x.data_ptr<float>(), rows, k, qx.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>());
  auto out = at::empty({rows, n}, x.options());
  const uint8_t* pq = qs.data_ptr<uint8_t>();
  const at::Half* pd = d.data_ptr<at::Half>();
  const at::Half* pm = m.data_ptr<at::Half>();
  const int8_t* px = qx.data_ptr<int8_t>();
  const float *pdx = dx.data_ptr<float>(), *psx = sx.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) {
    q4_1_rows(pq, pd, pm, px, pdx, psx, po, n0, n1, rows, k, n);
  });
  return out;
}

at::Tensor q8_0_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  const int64_t n = qs.size(0), k = qs.size(1), g = k / QK;
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous() && k % QK == 0, "qs: int8 [N, K]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == n * g, "d: fp16 [N, K/32]");
  check_x(x, k);
  const int64_t rows = x.size(0);
  auto qx = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto dx = at::empty({rows, g}, x.options()), sx = at::empty({rows, g}, x.options());
  quantize_rows(x.data_ptr<float>(), rows, k, qx.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>());
  auto out = at::empty({rows, n}, x.options());
  const int8_t* pq = qs.data_ptr<int8_t>();
  const at::Half* pd = d.data_ptr<at::Half>();
  const int8_t* px = qx.data_ptr<int8_t>();
  const float* pdx = dx.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) {
    q8_0_rows(pq, pd, px, pdx, po, n0, n1, rows, k, n);
  });
  return out;
}

at::Tensor f32_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.device().is_cpu(),
              "w: contiguous fp32 CPU [N, K]");
  const int64_t n = w.size(0), k = w.size(1);
  check_x(x, k);
  const int64_t rows = x.size(0);
  auto out = at::empty({rows, n}, x.options());
  const float *pw = w.data_ptr<float>(), *px = x.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) { f32_rows(pw, px, po, n0, n1, rows, k, n); });
  return out;
}

// the activation quantization alone (tests compare the kernels with a torch reference on these numbers)
std::vector<at::Tensor> quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % QK == 0,
              "x must be a contiguous fp32 [M, K] tensor, K a multiple of 32");
  const int64_t rows = x.size(0), k = x.size(1), g = k / QK;
  auto qx = at::empty({rows, k}, x.options().dtype(at::kChar));
  auto dx = at::empty({rows, g}, x.options()), sx = at::empty({rows, g}, x.options());
  quantize_rows(x.data_ptr<float>(), rows, k, qx.data_ptr<int8_t>(), dx.data_ptr<float>(), sx.data_ptr<float>());
  return {qx, dx, sx};
}

}  // namespace

TORCH_LIBRARY(cipherlm_cpu, lib) {
  lib.def("q4_1_mm(Tensor x, Tensor qs, Tensor d, Tensor m) -> Tensor", &q4_1_mm);
  lib.def("q8_0_mm(Tensor x, Tensor qs, Tensor d) -> Tensor", &q8_0_mm);
  lib.def("f32_mm(Tensor x, Tensor w) -> Tensor", &f32_mm);
  lib.def("quantize_q8(Tensor x) -> Tensor[]", &quantize_q8);
}
