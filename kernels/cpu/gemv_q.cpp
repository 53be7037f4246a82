// Few-row products over GGUF-style quantized weights, AVX2/FMA/F16C (cipherlm's CPU decode kernels).
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

// Both kernels: for each output row n and each activation row r, a loop over the K/32 blocks with two
// accumulators (the block scale product in one FMA). Activation rows are few (decode: 1) and stay in L1.
void q4_1_rows(const uint8_t* qs, const at::Half* d, const at::Half* mn, const int8_t* qx, const float* dx,
               const float* sx, float* out, int64_t n0, int64_t n1, int64_t m, int64_t k, int64_t n) {
  const int64_t g = k / QK;
  for (int64_t row = n0; row < n1; ++row) {
    const uint8_t* wq = qs + row * (k / 2);
    const at::Half* wd = d + row * g;
    const at::Half* wm = mn + row * g;
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* aq = qx + r * k;
      const float* ad = dx + r * g;
      const float* as = sx + r * g;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      float mins = 0.f;
      int64_t b = 0;
      for (; b + 1 < g; b += 2) {
        const __m256i u0 = unpack_nibbles(wq + b * 16), u1 = unpack_nibbles(wq + (b + 1) * 16);
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + b * QK));
        const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + (b + 1) * QK));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(f16(wd + b) * ad[b]), dot_u8_i8(u0, q0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(f16(wd + b + 1) * ad[b + 1]), dot_u8_i8(u1, q1), acc1);
        mins += f16(wm + b) * as[b] + f16(wm + b + 1) * as[b + 1];
      }
      for (; b < g; ++b) {
        const __m256i u0 = unpack_nibbles(wq + b * 16);
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + b * QK));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(f16(wd + b) * ad[b]), dot_u8_i8(u0, q0), acc0);
        mins += f16(wm + b) * as[b];
      }
      out[r * n + row] = hsum(_mm256_add_ps(acc0, acc1)) + mins;
    }
  }
}

void q8_0_rows(const int8_t* qs, const at::Half* d, const int8_t* qx, const float* dx, float* out,
               int64_t n0, int64_t n1, int64_t m, int64_t k, int64_t n) {
  const int64_t g = k / QK;
  for (int64_t row = n0; row < n1; ++row) {
    const int8_t* wq = qs + row * k;
    const at::Half* wd = d + row * g;
    for (int64_t r = 0; r < m; ++r) {
      const int8_t* aq = qx + r * k;
      const float* ad = dx + r * g;
      __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
      int64_t b = 0;
      for (; b + 1 < g; b += 2) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * QK));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (b + 1) * QK));
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + b * QK));
        const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + (b + 1) * QK));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(f16(wd + b) * ad[b]), dot_i8_i8(w0, q0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(f16(wd + b + 1) * ad[b + 1]), dot_i8_i8(w1, q1), acc1);
      }
      for (; b < g; ++b) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + b * QK));
        const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(aq + b * QK));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(f16(wd + b) * ad[b]), dot_i8_i8(w0, q0), acc0);
      }
      out[r * n + row] = hsum(_mm256_add_ps(acc0, acc1));
    }
  }
}

// fp32 GEMV rows: out[r, n] = <w[n], x[r]>, four 8-wide accumulators
void f32_rows(const float* w, const float* x, float* out, int64_t n0, int64_t n1, int64_t m, int64_t k,
              int64_t n) {
  for (int64_t row = n0; row < n1; ++row) {
    const float* wr = w + row * k;
    for (int64_t r = 0; r < m; ++r) {
      const float* xr = x + r * k;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
             a3 = _mm256_setzero_ps();
      int64_t j = 0;
      for (; j + 32 <= k; j += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + j), _mm256_loadu_ps(xr + j), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + j + 8), _mm256_loadu_ps(xr + j + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + j + 16), _mm256_loadu_ps(xr + j + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(wr + j + 24), _mm256_loadu_ps(xr + j + 24), a3);
      }
      float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      for (; j < k; ++j) s += wr[j] * xr[j];
      out[r * n + row] = s;
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
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(), "w: contiguous fp32 [N, K]");
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
