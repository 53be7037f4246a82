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
#include <algorithm>
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

// One linear's weight as the kernels read it, in one of the three layouts of the header. The few-row
// products below (q4_1_mm, q8_0_mm, f32_mm) and the fused decode step share it, so both run the same code.
struct Lin {
  enum Kind { F32, Q4_1, Q8_0 } kind;
  int64_t n, k;
  const float* w = nullptr;       // F32: [N, K]
  const uint8_t* q4 = nullptr;    // Q4_1: qs [N, K/2]
  const int8_t* q8 = nullptr;     // Q8_0: qs [N, K]
  const at::Half* d = nullptr;    // Q4_1 / Q8_0: [N, K/32]
  const at::Half* m = nullptr;    // Q4_1: [N, K/32]
};

Lin lin_f32(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.device().is_cpu(),
              "w: contiguous fp32 CPU [N, K]");
  Lin l{Lin::F32, w.size(0), w.size(1)};
  l.w = w.data_ptr<float>();
  return l;
}

Lin lin_q4_1(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  const int64_t n = qs.size(0), k = qs.size(1) * 2, g = k / QK;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && k % QK == 0, "qs: uint8 [N, K/2]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.is_contiguous() &&
              m.is_contiguous() && d.numel() == n * g && m.numel() == n * g, "d, m: fp16 [N, K/32]");
  Lin l{Lin::Q4_1, n, k};
  l.q4 = qs.data_ptr<uint8_t>();
  l.d = d.data_ptr<at::Half>();
  l.m = m.data_ptr<at::Half>();
  return l;
}

Lin lin_q8_0(const at::Tensor& qs, const at::Tensor& d) {
  const int64_t n = qs.size(0), k = qs.size(1), g = k / QK;
  TORCH_CHECK(qs.scalar_type() == at::kChar && qs.is_contiguous() && k % QK == 0, "qs: int8 [N, K]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.numel() == n * g, "d: fp16 [N, K/32]");
  Lin l{Lin::Q8_0, n, k};
  l.q8 = qs.data_ptr<int8_t>();
  l.d = d.data_ptr<at::Half>();
  return l;
}

// A linear from a list of tensors starting at t[i] (its dtype says the layout: fp32 -> [w], uint8 ->
// [qs, d, m], int8 -> [qs, d]); i moves past it.
Lin lin_from(at::TensorList t, size_t& i) {
  TORCH_CHECK(i < t.size(), "decode_step: the weight list ends inside a layer");
  const auto dt = t[i].scalar_type();
  if (dt == at::kFloat) return lin_f32(t[i++]);
  if (dt == at::kByte) {
    TORCH_CHECK(i + 3 <= t.size(), "decode_step: a q4_1 linear needs qs, d, m");
    i += 3;
    return lin_q4_1(t[i - 3], t[i - 2], t[i - 1]);
  }
  TORCH_CHECK(dt == at::kChar && i + 2 <= t.size(), "decode_step: a linear is fp32 [w], uint8 [qs, d, m] or int8 [qs, d]");
  i += 2;
  return lin_q8_0(t[i - 2], t[i - 1]);
}

// out [rows, n] = x [rows, k] @ W.T; qx/dx/sx: room for the quantized activations (quantized layouts)
void lin_apply(const Lin& l, const float* x, int64_t rows, float* out, int8_t* qx, float* dx, float* sx) {
  const int64_t n = l.n, k = l.k;
  if (l.kind == Lin::F32) {
    at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) { f32_rows(l.w, x, out, n0, n1, rows, k, n); });
    return;
  }
  quantize_rows(x, rows, k, qx, dx, sx);
  if (l.kind == Lin::Q4_1) {
    at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) {
      q4_1_rows(l.q4, l.d, l.m, qx, dx, sx, out, n0, n1, rows, k, n);
    });
  } else {
    at::parallel_for(0, n, GRAIN, [&](int64_t n0, int64_t n1) { q8_0_rows(l.q8, l.d, qx, dx, out, n0, n1, rows, k, n); });
  }
}

at::Tensor lin_mm(const Lin& l, const at::Tensor& x) {
  check_x(x, l.k);
  const int64_t rows = x.size(0), g = l.k / QK;
  auto out = at::empty({rows, l.n}, x.options());
  std::vector<int8_t> qx(l.kind == Lin::F32 ? 0 : rows * l.k);
  std::vector<float> dx(rows * g), sx(rows * g);
  lin_apply(l, x.data_ptr<float>(), rows, out.data_ptr<float>(), qx.data(), dx.data(), sx.data());
  return out;
}

at::Tensor q4_1_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m) {
  return lin_mm(lin_q4_1(qs, d, m), x);
}

at::Tensor q8_0_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d) {
  return lin_mm(lin_q8_0(qs, d), x);
}

at::Tensor f32_mm(const at::Tensor& x, const at::Tensor& w) { return lin_mm(lin_f32(w), x); }

// ---- the fused batch-1 decode step (EngineConfig.cpu_fused_decode) -----------------------------------
//
// One call runs every decoder layer of one token (engine/cpu_decode.py): per layer
//   x = rmsnorm(h) * ln1;  qkv = x @ Wqkv.T;  RoPE(q, k) (rotate-half, cos/sin rows of the position);
//   store k, v at the position's slot of the paged pools [NB, BS, Hkv, D] (block table -> slot);
//   attention of the Hq query heads over positions 0..pos (GQA: head h reads KV head h / (Hq / Hkv)),
//   fp32 softmax;  h += attn @ Wo.T;  x = rmsnorm(h) * ln2;  gu = x @ Wgu.T;  a = silu(g) * u;  h += a @ Wd.T
// with the products of lin_apply (the same code as the one-row products of the unfused path). RMSNorm
// follows engine.model.RMSNorm: x * rsqrt(mean(x^2) + eps), then the gain.

void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// rotate-half RoPE of `heads` rows of D in place: out = x * cos + rot(x) * sin, rot(x) = cat(-x2, x1)
void rope_rows(float* x, int64_t heads, int64_t dim, const float* cs, const float* sn) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* r = x + h * dim;
    for (int64_t i = 0; i < half; ++i) {
      const float a = r[i], b = r[i + half];
      r[i] = a * cs[i] + (-b) * sn[i];
      r[i + half] = b * cs[i + half] + a * sn[i + half];
    }
  }
}

inline float dot_row(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// exp of 8 floats (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp), for the softmax
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// s[0..n) := exp(s - max s); returns 1 / sum
inline float softmax_row(float* s, int64_t n) {
  float mx = -INFINITY;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m8));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  return 1.f / sum;
}

// sc[t] = <q, k row t> * scale for the n rows k, k + row, ...: four rows at a time (four independent FMA chains)
inline void scores_rows(const float* q, const float* k, int64_t row, int64_t n, int64_t dim, float scale, float* sc) {
  int64_t o = 0;
  if (dim % 8 == 0) {
    for (; o + 4 <= n; o += 4) {
      const float *k0 = k + o * row, *k1 = k0 + row, *k2 = k1 + row, *k3 = k2 + row;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t i = 0; i < dim; i += 8) {
        const __m256 qv = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
      }
      sc[o] = hsum(a0) * scale;
      sc[o + 1] = hsum(a1) * scale;
      sc[o + 2] = hsum(a2) * scale;
      sc[o + 3] = hsum(a3) * scale;
    }
  }
  for (; o < n; ++o) sc[o] = dot_row(q, k + o * row, dim) * scale;
}

// out [Hq, D] = softmax(q k^T * scale) v over context positions 0..ctx-1, walking the block table block by
// block. Per KV head, each of its G = Hq / Hkv query heads (heads kvh * G .. kvh * G + G - 1) scores four
// K rows at a time; the probability-weighted V sum keeps 64 output columns in registers over the whole
// context. KV heads are split over torch's threads. scores: room for Hq * ctx floats.
void attend_one(const float* q, const float* kc, const float* vc, const int64_t* table, int64_t ctx,
                int64_t bs, int64_t hq, int64_t hkv, int64_t dim, float scale, float* scores, float* out) {
  const int64_t grp = hq / hkv, row = hkv * dim, nblk = (ctx + bs - 1) / bs;
  at::parallel_for(0, hkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t kvh = h0; kvh < h1; ++kvh) {
      for (int64_t g = 0; g < grp; ++g) {
        const float* qh = q + (kvh * grp + g) * dim;
        float* sc = scores + (kvh * grp + g) * ctx;
        float* oh = out + (kvh * grp + g) * dim;
        for (int64_t b = 0; b < nblk; ++b) {
          const int64_t t0 = b * bs;
          scores_rows(qh, kc + table[b] * bs * row + kvh * dim, row, std::min(bs, ctx - t0), dim, scale, sc + t0);
        }
        const float inv = softmax_row(sc, ctx);
        for (int64_t c = 0; c < dim; c += 64) {
          const int64_t w = std::min<int64_t>(64, dim - c);
          if (w == 64) {
            __m256 a[8];
            for (auto& r : a) r = _mm256_setzero_ps();
            for (int64_t b = 0; b < nblk; ++b) {
              const int64_t t0 = b * bs, n = std::min(bs, ctx - t0);
              const float* vb = vc + table[b] * bs * row + kvh * dim + c;
              for (int64_t o = 0; o < n; ++o) {
                const __m256 pv = _mm256_set1_ps(sc[t0 + o] * inv);
                const float* vr = vb + o * row;
                for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * j), a[j]);
              }
            }
            for (int j = 0; j < 8; ++j) _mm256_storeu_ps(oh + c + 8 * j, a[j]);
          } else {
            std::fill(oh + c, oh + c + w, 0.f);
            for (int64_t b = 0; b < nblk; ++b) {
              const int64_t t0 = b * bs, n = std::min(bs, ctx - t0);
              const float* vb = vc + table[b] * bs * row + kvh * dim + c;
              for (int64_t o = 0; o < n; ++o) {
                const float p = sc[t0 + o] * inv;
                for (int64_t i = 0; i < w; ++i) oh[c + i] += p * vb[o * row + i];
              }
            }
          }
        }
      }
    }
  });
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// weights: per layer, in order: ln1 [H], ln2 [H], k_cache, v_cache ([NB, BS, Hkv, D] fp32), then the
// q/k/v, o, gate/up and down linears (see lin_from). h [1, H] is updated in place.
void decode_step(const at::Tensor& h, at::TensorList weights, int64_t num_layers, int64_t num_heads,
                 int64_t num_kv_heads, int64_t pos, at::IntArrayRef block_table,
                 const at::Tensor& cos, const at::Tensor& sin, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1 && h.scalar_type() == at::kFloat && h.is_contiguous(),
              "h: contiguous fp32 [1, hidden]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.sizes() == sin.sizes() && pos < cos.size(0),
              "cos, sin: contiguous fp32 [positions, D] covering pos");
  const int64_t hid = h.size(1), hq = num_heads, hkv = num_kv_heads, dim = cos.size(1), ctx = pos + 1;
  TORCH_CHECK(hq % hkv == 0 && pos >= 0, "decode_step: bad heads or position");
  float* hp = h.data_ptr<float>();
  const int64_t* table = block_table.data();
  const float* cs = cos.data_ptr<float>() + pos * dim;
  const float* sn = sin.data_ptr<float>() + pos * dim;
  const float scale = 1.f / std::sqrt(static_cast<float>(dim));
  std::vector<float> x, qkv, att, y, gu, scores(hq * ctx), dx, sx;
  std::vector<int8_t> qx;
  struct Layer {
    const float *ln1, *ln2;
    float *kc, *vc;
    int64_t bs;
    Lin qkv, o, gu, down;
  };
  // every layer is parsed and checked before anything is computed: a bad call changes neither h nor a cache
  std::vector<Layer> layers;
  size_t i = 0;
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    TORCH_CHECK(i + 4 <= weights.size(), "decode_step: too few weights for ", num_layers, " layers");
    const at::Tensor &ln1 = weights[i], &ln2 = weights[i + 1], &kc = weights[i + 2], &vc = weights[i + 3];
    i += 4;
    const Lin wqkv = lin_from(weights, i), wo = lin_from(weights, i), wgu = lin_from(weights, i),
              wd = lin_from(weights, i);
    const int64_t bs = kc.size(1);
    TORCH_CHECK(kc.scalar_type() == at::kFloat && vc.scalar_type() == at::kFloat && kc.is_contiguous() &&
                vc.is_contiguous() && kc.dim() == 4 && kc.size(2) == hkv && kc.size(3) == dim &&
                vc.sizes() == kc.sizes(), "decode_step: caches must be contiguous fp32 [NB, BS, Hkv, D]");
    TORCH_CHECK(pos / bs < static_cast<int64_t>(block_table.size()), "decode_step: block table shorter than the context");
    for (int64_t b = 0; b <= pos / bs; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < kc.size(0), "decode_step: block ", table[b], " out of range");
    TORCH_CHECK(ln1.numel() == hid && ln2.numel() == hid && ln1.scalar_type() == at::kFloat &&
                ln2.scalar_type() == at::kFloat && ln1.is_contiguous() && ln2.is_contiguous() && wqkv.k == hid &&
                wqkv.n == (hq + 2 * hkv) * dim && wo.k == hq * dim && wo.n == hid && wgu.k == hid &&
                wgu.n % 2 == 0 && wd.k == wgu.n / 2 && wd.n == hid,
                "decode_step: layer ", layer, "'s shapes do not fit");
    layers.push_back({ln1.data_ptr<float>(), ln2.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                      bs, wqkv, wo, wgu, wd});
  }
  TORCH_CHECK(i == weights.size(), "decode_step: ", weights.size() - i, " weights left over");
  for (const Layer& l : layers) {
    const int64_t inter = l.gu.n / 2, kmax = std::max(hid, inter);
    x.resize(kmax); qkv.resize(l.qkv.n); att.resize(hq * dim); y.resize(hid); gu.resize(l.gu.n);
    qx.resize(kmax); dx.resize(kmax / QK + 1); sx.resize(kmax / QK + 1);
    // attention half
    rms_norm_row(hp, l.ln1, hid, static_cast<float>(eps), x.data());
    lin_apply(l.qkv, x.data(), 1, qkv.data(), qx.data(), dx.data(), sx.data());
    rope_rows(qkv.data(), hq + hkv, dim, cs, sn);
    const int64_t slot = table[pos / l.bs] * l.bs + pos % l.bs, row = hkv * dim;
    std::copy(qkv.data() + hq * dim, qkv.data() + (hq + hkv) * dim, l.kc + slot * row);
    std::copy(qkv.data() + (hq + hkv) * dim, qkv.data() + (hq + 2 * hkv) * dim, l.vc + slot * row);
    attend_one(qkv.data(), l.kc, l.vc, table, ctx, l.bs, hq, hkv, dim, scale, scores.data(), att.data());
    lin_apply(l.o, att.data(), 1, y.data(), qx.data(), dx.data(), sx.data());
    for (int64_t j = 0; j < hid; ++j) hp[j] += y[j];
    // MLP half
    rms_norm_row(hp, l.ln2, hid, static_cast<float>(eps), x.data());
    lin_apply(l.gu, x.data(), 1, gu.data(), qx.data(), dx.data(), sx.data());
    for (int64_t j = 0; j < inter; ++j) x[j] = silu(gu[j]) * gu[inter + j];
    lin_apply(l.down, x.data(), 1, y.data(), qx.data(), dx.data(), sx.data());
    for (int64_t j = 0; j < hid; ++j) hp[j] += y[j];
  }
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
  lib.def("decode_step(Tensor(a!) h, Tensor[] weights, int num_layers, int num_heads, int num_kv_heads, "
          "int pos, int[] block_table, Tensor cos, Tensor sin, float eps) -> ()", &decode_step);
}
