// Decode's products with quantized weights (weights="int8" | "int4" | "gguf"): a few rows x (r < 4)
// times a weight held as integer codes. Decode steps run them: their rows are few, so a product
// streams the codes once and is bound by reading them; each code is widened in registers and used
// by every row. float32 or bfloat16 x, scales and y; float32 sums. Built against torch and loaded
// by engine/rank/quantized_rows.py, which declares the ops prefill::int8_rows, prefill::q4_rows and
// prefill::quantized_decode_layers (a decode step's layers in one call, or with tp > 1 a layer's
// attention or MLP part per call, below: the products, and RMSNorm, RoPE, the fused attention's
// kernel and SiLU·mul between them); register_ops() gives
// them these CPU kernels. Called straight from torch's dispatcher, eagerly or from a compiled
// graph: through ctypes and a Python op each call cost several us more, and a decode step made
// ~120 of them.
//
// int8 (weights="int8", and the LM head of every mode): codes [n][k], one scale per output
// channel: y[r][n] = s[n] sum_k x[r][k] q[n][k].
//
// int4 (weights="int4" | "gguf"): GGUF's Q4 blocks, 32 inputs a group. codes [n][k/2]: a group's
// 16 bytes hold its code i in the low nibble of byte i and code i + 16 in the high one; d and m
// [n][k/32]: w = d q + m. Each row of x is rounded to int16 per group of 32 (step e = max|x| /
// 32767: an error of at most e/2, 2^-16 of the group's largest value), so a group's 32 products
// are integer multiply-adds (AVX2 vpmaddwd, AVX512-VNNI vpdpwssd); their sum is scaled by d e, and
// m multiplies the group's float sum of x. Needs AVX2 (q4_rows_supported says so).
//
// float (a float32 or bf16 model's decode steps through the layers op, where they timed faster
// than its decode graphs): the weight's own values [n][k], widened as they are read.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <omp.h>

#include "cpu_vectors.h"
#include "layer_rows.h"
#include "torch_ops.h"

namespace {

// A product streams its weight's rows one output after another: each output asks for the codes
// of the output PREFETCH_AHEAD further on, so they arrive while this one computes (the hardware's
// own prefetch left a 1-row product of SmolLM2's int4 gate/up below torch's kernel; with this
// it runs faster: `.venv/bin/python -m bench.cpu_ops --only-quantized`, BENCHMARKS.md session 58)
constexpr int64_t PREFETCH_AHEAD = 4;
inline void prefetch(const void* from, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(from) + b);
}

// A weight's element as a product reads it: int8 codes, or float32 / bf16 values as they are (a
// float model's decode steps through the layers op: engine/rank/quantized_layers.py)
inline vf load_weight(const int8_t* p) { return load_int8(p); }
inline vf load_weight(const float* p) { return load(p); }
inline vf load_weight(const bf16* p) { return load_widened(p); }

// C: int8 codes, each output scaled by its scale; or the activations' own type T, unscaled
template <typename T, typename C>
struct RowsProblem {
  const float* x;  // [rows][k], widened
  const C* codes;  // [n][k]
  const T* scales;  // [n] for int8 codes; a float weight's values are taken as they are
  T* y;             // [rows][n]
  int64_t n, k;
};

template <typename T, typename C, int R>
void rows_product(const RowsProblem<T, C>& p, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t o = 0; o < p.n; ++o) {
    const C* codes = p.codes + o * p.k;
    prefetch(p.codes + std::min(o + PREFETCH_AHEAD, p.n - 1) * p.k, p.k * sizeof(C));
    vf acc[R];
    for (int r = 0; r < R; ++r) acc[r] = splat(0.f);
    for (int64_t i = 0; i < p.k; i += W) {
      const vf w = load_weight(codes + i);
      for (int r = 0; r < R; ++r) acc[r] += load(p.x + r * p.k + i) * w;
    }
    if constexpr (std::is_same_v<C, int8_t>) {
      const float scale = widen(p.scales[o]);
      for (int r = 0; r < R; ++r) narrow(hsum(acc[r]) * scale, p.y + r * p.n + o);
    } else {
      for (int r = 0; r < R; ++r) narrow(hsum(acc[r]), p.y + r * p.n + o);
    }
  }
}

template <typename T, typename C>
void rows_any(const T* x, int64_t x_stride, int64_t rows, const C* codes, const T* scales,
              T* y, int64_t n, int64_t k, int threads) {
  std::vector<float> widened(static_cast<size_t>(rows * k));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) widened[r * k + i] = widen(x[r * x_stride + i]);
  const RowsProblem<T, C> p{widened.data(), codes, scales, y, n, k};
  switch (rows) {
    case 1: return rows_product<T, C, 1>(p, threads);
    case 2: return rows_product<T, C, 2>(p, threads);
    case 3: return rows_product<T, C, 3>(p, threads);
    default: return rows_product<T, C, 4>(p, threads);
  }
}


#if defined(__AVX2__)
constexpr int GROUP = 32;  // inputs per Q4 group

// x rounded to int16 per group: xq [rows][k], each group's step [rows][groups] and float sum
struct RoundedRows {
  std::vector<int16_t> xq;
  std::vector<float> step, sum;
};

// 8 values widened to float32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m256i halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16));
}

inline float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float lanes_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// One group of 32 inputs rounded to int16 (nearest, ties to even) on the step max|x| / 32767;
// returns (step, sum). A NaN or infinite input makes the step NaN, so the outputs it feeds are
// NaN, as a float product's would be, never a silently finite number.
template <typename T>
inline void round_group(const T* x, int16_t* xq, float* step, float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4], largest = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = load8(x + 8 * i);
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v[i]));
    total = _mm256_add_ps(total, v[i]);
  }
  const float most = lanes_max(largest);
  *sum = lanes_sum(total);
  *step = std::isfinite(most) && !std::isnan(*sum) ? most / 32767.f : NAN;
  // 32767 / most overflows for a group below ~1e-34: such values are scaled up by 2^64 first
  const float lift = most < 1e-30f ? 0x1p64f : 1.f;
  const float inverse = most > 0.f && std::isfinite(most) ? 32767.f / (most * lift) : 0.f;
  const __m256 up = _mm256_set1_ps(lift), by = _mm256_set1_ps(inverse);
  for (int i = 0; i < 4; i += 2) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[i], up), by));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(v[i + 1], up), by));
    // packs interleaves 128-bit halves (a0-3 b0-3 a4-7 b4-7): the permute puts them in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 8 * i), packed);
  }
}

// The caller thread's buffers, kept from call to call: a decode step makes ~120 calls, each
// too short to pay for fresh allocations.
template <typename T>
const RoundedRows& round_rows(const T* x, int64_t x_stride, int64_t rows, int64_t k) {
  const int64_t groups = k / GROUP;
  thread_local RoundedRows out;
  out.xq.resize(rows * k);
  out.step.resize(rows * groups);
  out.sum.resize(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      round_group(x + r * x_stride + g * GROUP, &out.xq[r * k + g * GROUP],
                  &out.step[r * groups + g], &out.sum[r * groups + g]);
  return out;
}

template <typename T>
struct Q4Problem {
  const RoundedRows* x;
  const uint8_t* codes;  // [n][k/2]
  const T *d, *m;        // [n][k/32]
  T* y;                  // [rows][n]
  int64_t n, k;
};

// One output's group scales d e into `scale` [groups]; returns sum_g m_g (sum of x over g).
template <typename T>
float output_scales(const T* d, const T* m, const float* step, const float* sum, int64_t groups,
                    float* scale) {
  vf shift = splat(0.f);
  int64_t g = 0;
  for (; g + W <= groups; g += W) {
    store(scale + g, load_widened(d + g) * load(step + g));
    shift += load_widened(m + g) * load(sum + g);
  }
  float total = hsum(shift);
  for (; g < groups; ++g) {
    scale[g] = widen(d[g]) * step[g];
    total += widen(m[g]) * sum[g];
  }
  return total;
}

// A group's products accumulate in float lanes: 16 with AVX512 (BW and VNNI: one group's 32
// int16 products in one vpdpwssd), else 8 (AVX2: two vpmaddwd)
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
using GroupSums = __m512;
inline GroupSums no_sums() { return _mm512_setzero_ps(); }
inline float sums_total(GroupSums a, GroupSums b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
#else
using GroupSums = __m256;
inline GroupSums no_sums() { return _mm256_setzero_ps(); }
inline float sums_total(GroupSums a, GroupSums b) { return lanes_sum(_mm256_add_ps(a, b)); }
#endif

// One group's 16 code bytes against R rows' 32 int16 inputs, into acc[r].
template <int R>
inline void q4_group(const uint8_t* codes, const int16_t* xq, int64_t k, const float* scale,
                     int64_t groups, GroupSums* acc) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i low = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
  const __m256i high = _mm256_srli_epi16(bytes, 4);
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  // codes 0-15 (low nibbles) then 16-31 (high ones): the group's 32 inputs' order
  const __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  for (int r = 0; r < R; ++r) {
    const __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(xq + r * k));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(scale[r * groups]), acc[r]);
  }
#else
  for (int r = 0; r < R; ++r) {
    const __m256i* x = reinterpret_cast<const __m256i*>(xq + r * k);
    const __m256i x_low = _mm256_loadu_si256(x), x_high = _mm256_loadu_si256(x + 1);
    const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(low, x_low),
                                         _mm256_madd_epi16(high, x_high));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale[r * groups]), acc[r]);
  }
#endif
}

template <typename T, int R>
void q4_product(const Q4Problem<T>& p, int threads) {
  const int64_t n = p.n, k = p.k, groups = k / GROUP;
  const int16_t* const xq = p.x->xq.data();
  const float *const step = p.x->step.data(), *const sum = p.x->sum.data();
#pragma omp parallel num_threads(threads)
  {
    thread_local std::vector<float> buffer;
    buffer.resize(R * groups);
    float* const scale = buffer.data();  // a thread_local is found through a call, once
#pragma omp for schedule(static)
    for (int64_t o = 0; o < n; ++o) {
      const uint8_t* codes = p.codes + o * (k / 2);
      prefetch(p.codes + std::min(o + PREFETCH_AHEAD, n - 1) * (k / 2), k / 2);
      float shift[R];
      for (int r = 0; r < R; ++r)
        shift[r] = output_scales(p.d + o * groups, p.m + o * groups, step + r * groups,
                                 sum + r * groups, groups, scale + r * groups);
      // even and odd groups sum apart: two chains of adds instead of one
      GroupSums even[R], odd[R];
      for (int r = 0; r < R; ++r) even[r] = odd[r] = no_sums();
      int64_t g = 0;
      for (; g + 2 <= groups; g += 2) {
        q4_group<R>(codes + g * 16, xq + g * GROUP, k, scale + g, groups, even);
        q4_group<R>(codes + g * 16 + 16, xq + g * GROUP + GROUP, k, scale + g + 1, groups, odd);
      }
      if (g < groups) q4_group<R>(codes + g * 16, xq + g * GROUP, k, scale + g, groups, even);
      for (int r = 0; r < R; ++r)
        narrow(sums_total(even[r], odd[r]) + shift[r], p.y + r * n + o);
    }
  }
}

template <typename T>
void q4_any(const T* x, int64_t x_stride, int64_t rows, const uint8_t* codes, const T* d,
            const T* m, T* y, int64_t n, int64_t k, int threads) {
  const RoundedRows& rounded = round_rows(x, x_stride, rows, k);
  const Q4Problem<T> p{&rounded, codes, d, m, y, n, k};
  switch (rows) {
    case 1: return q4_product<T, 1>(p, threads);
    case 2: return q4_product<T, 2>(p, threads);
    case 3: return q4_product<T, 3>(p, threads);
    default: return q4_product<T, 4>(p, threads);
  }
}
#endif

constexpr int64_t MOST_ROWS = 4;

// x as the kernels read it: rows of the weight's dtype, each row's inputs contiguous
at::Tensor rows_of(const at::Tensor& x, at::ScalarType dtype, int64_t k, int64_t multiple,
                   const char* op) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(0) <= MOST_ROWS && x.size(1) == k && k % multiple == 0,
                    op, ": x ", x.sizes(), " for a weight of ", k, " inputs; it takes 1-",
                    MOST_ROWS, " rows of a multiple of ", multiple);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": float32 or bfloat16 "
              "scales, got ", dtype);
  return x.scalar_type() == dtype && x.stride(1) == 1 ? x : x.to(dtype).contiguous();
}

at::Tensor int8_rows(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar &&
              scales.is_contiguous() && scales.numel() == codes.size(0),
              "int8_rows: codes [n, k] int8 and scales [n], contiguous");
  const int64_t n = codes.size(0), k = codes.size(1);
  const at::Tensor x = rows_of(x_in, scales.scalar_type(), k, W, "int8_rows");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const int threads = at::get_num_threads();
  if (x.scalar_type() == at::kBFloat16)
    rows_any(static_cast<const bf16*>(x.data_ptr()), x.stride(0), x.size(0),
             codes.const_data_ptr<int8_t>(), static_cast<const bf16*>(scales.data_ptr()),
             static_cast<bf16*>(y.data_ptr()), n, k, threads);
  else
    rows_any(x.const_data_ptr<float>(), x.stride(0), x.size(0), codes.const_data_ptr<int8_t>(),
             scales.const_data_ptr<float>(), y.mutable_data_ptr<float>(), n, k, threads);
  return y;
}

at::Tensor q4_rows(const at::Tensor& x_in, const at::Tensor& nibbles, const at::Tensor& steps) {
  const int64_t n = nibbles.size(0), k = 2 * nibbles.size(1);
  TORCH_CHECK(nibbles.dim() == 2 && nibbles.is_contiguous() &&
              nibbles.scalar_type() == at::kByte && steps.is_contiguous() &&
              steps.numel() == 2 * n * (k / 32),
              "q4_rows: nibbles [n, k/2] uint8 and steps [2, n, k/32, 1], contiguous");
#if defined(__AVX2__)
  const at::Tensor x = rows_of(x_in, steps.scalar_type(), k, GROUP, "q4_rows");
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return y;
  const int threads = at::get_num_threads();
  const int64_t half = n * (k / GROUP);  // steps[1]: each group's m, after every d
  if (x.scalar_type() == at::kBFloat16) {
    const bf16* d = static_cast<const bf16*>(steps.data_ptr());
    q4_any(static_cast<const bf16*>(x.data_ptr()), x.stride(0), x.size(0),
           nibbles.const_data_ptr<uint8_t>(), d, d + half, static_cast<bf16*>(y.data_ptr()), n,
           k, threads);
  } else {
    const float* d = steps.const_data_ptr<float>();
    q4_any(x.const_data_ptr<float>(), x.stride(0), x.size(0), nibbles.const_data_ptr<uint8_t>(),
           d, d + half, y.mutable_data_ptr<float>(), n, k, threads);
  }
  return y;
#else
  TORCH_CHECK_NOT_IMPLEMENTED(false, "q4_rows: not built for this CPU (it needs AVX2)");
#endif
}

// ---- A decode step's layers (engine/rank/quantized_layers.py) ----

// A projection's weight as the layers take it: int8 codes [n][k] with scales [n], int4 nibbles
// [n][k/2] with steps [2][n][k/32][1], or (a float model's) values [n][k] of the activations'
// dtype with no scales (an empty tensor). Its outputs n; checks it multiplies rows of `k_expected`.
int64_t weight_outputs(const at::Tensor& codes, const at::Tensor& scales, at::ScalarType dtype,
                       int64_t k_expected, const char* name) {
  const bool int4 = codes.scalar_type() == at::kByte, dense = codes.scalar_type() == dtype;
  TORCH_CHECK_VALUE(codes.dim() == 2 && codes.is_contiguous() && scales.is_contiguous() &&
                        (int4 || dense || codes.scalar_type() == at::kChar) &&
                        (dense ? scales.numel() == 0 : scales.scalar_type() == dtype),
                    "quantized decode layers: ", name, " must be int8 codes [n, k] with scales [n] "
                    "or int4 nibbles [n, k/2] with steps [2, n, k/32, 1], of the activations' "
                    "dtype ", dtype, ", or values [n, k] of that dtype with an empty tensor for "
                    "scales; got ", codes.scalar_type(), " ", codes.sizes(), " and ",
                    scales.scalar_type(), " ", scales.sizes());
  const int64_t n = codes.size(0), k = int4 ? 2 * codes.size(1) : codes.size(1);
  TORCH_CHECK_VALUE(k == k_expected && (dense || scales.numel() == (int4 ? 2 * n * (k / 32) : n)) &&
                        k % (int4 ? 32 : W) == 0,
                    "quantized decode layers: ", name, " takes ", k, " inputs, the layer gives it ",
                    k_expected, " (a multiple of ", int4 ? 32 : W, ")");
#if !defined(__AVX2__)
  TORCH_CHECK_NOT_IMPLEMENTED(!int4, "quantized decode layers: int4 products need AVX2");
#endif
  return n;
}

// y [rows][n] = x [rows][k] times the weight, MOST_ROWS rows at a time
template <typename T>
void project(const T* x, int64_t rows, int64_t k, const at::Tensor& codes,
             const at::Tensor& scales, T* y, int threads) {
  const int64_t n = codes.size(0);
  const T* s = static_cast<const T*>(scales.data_ptr());
  const bool dense = codes.scalar_type() != at::kChar && codes.scalar_type() != at::kByte;
  for (int64_t r = 0; r < rows; r += MOST_ROWS) {
    const int64_t take = std::min(MOST_ROWS, rows - r);
    if (dense) {
      rows_any(x + r * k, k, take, static_cast<const T*>(codes.data_ptr()),
               static_cast<const T*>(nullptr), y + r * n, n, k, threads);
      continue;
    }
#if defined(__AVX2__)
    if (codes.scalar_type() == at::kByte) {
      q4_any(x + r * k, k, take, codes.const_data_ptr<uint8_t>(), s, s + n * (k / GROUP),
             y + r * n, n, k, threads);
      continue;
    }
#endif
    rows_any(x + r * k, k, take, codes.const_data_ptr<int8_t>(), s, y + r * n, n, k, threads);
  }
}

// residual += x (the next residual, in place) and normed = weight * RMSNorm(residual)
template <typename T>
void add_norm(const T* x, T* residual, const T* weight, float eps, int64_t rows, int64_t d,
              T* normed) {
  for (int64_t r = 0; r < rows; ++r) {
    T* const sum = residual + r * d;  // in place
    add_rmsnorm_row(x + r * d, sum, weight, normed + r * d, sum, d, eps);
  }
}

// y [rows][n] += bias [n], rounded to T
template <typename T>
void add_bias(T* y, const T* bias, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) narrow(widen(y[r * n + i]) + widen(bias[i]), y + r * n + i);
}

// The first `heads` heads of each row of qkv [rows][width] (q's, then k's) rotated in place by
// the row's position (rotate-half layout; cos/sin [positions][d/2] float32)
template <typename T>
void rotate(T* qkv, int64_t rows, int64_t width, int64_t heads, int64_t head_dim,
            const float* cos, const float* sin, const int32_t* positions) {
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < heads; ++h) {
      T* v = qkv + r * width + h * head_dim;
      rotate_head(v, cos + positions[r] * half, sin + positions[r] * half, v, half);
    }
  }
}

// out [rows][ffn] = SiLU(gate) * up from gate_up [rows][2 ffn]
template <typename T>
void silu_mul(const T* gate_up, int64_t rows, int64_t ffn, T* out) {
  for (int64_t r = 0; r < rows; ++r) {
    silu_mul_row(gate_up + r * 2 * ffn, gate_up + r * 2 * ffn + ffn, out + r * ffn, ffn);
  }
}

// The attention's kernel (engine/rank/fused_attention.cpp's), through torch's dispatcher
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& cache, int64_t layer, const at::Tensor& slots,
                  const at::Tensor& table, const at::Tensor& lens, double scale) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("prefill::fused_paged_decode", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, c10::SymInt, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double)>();
  return op.call(q, k, v, cache, c10::SymInt(layer), slots, table, lens, scale);
}

template <typename T>
const T* elems(const at::Tensor& t) { return static_cast<const T*>(t.data_ptr()); }
template <typename T>
T* elems_mut(at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// One layer's tensors, as the op's lists hold them
struct Layer {
  const at::Tensor &input_norm, &post_norm;
  const at::Tensor &qkv, &qkv_scales, &o, &o_scales, &gate_up, &gate_up_scales, &down,
      &down_scales;
  std::optional<at::Tensor> qkv_bias, gate_up_bias;
};

// The step's shapes and tensors besides the layers' own
struct Step {
  const at::Tensor &cos, &sin, &positions, &cache, &slots, &table, &lens;
  int64_t first_layer;  // the cache's layer of the op's first listed layer
  int64_t rows, d, q_heads, hkv, head_dim;
  float eps;
  double scale;
};

void check_bias(const std::optional<at::Tensor>& bias, int64_t n, at::ScalarType dtype,
                const char* name) {
  TORCH_CHECK_VALUE(!bias.has_value() || (bias->is_contiguous() && bias->numel() == n &&
                                          bias->scalar_type() == dtype),
                    "quantized decode layers: the ", name, " bias must be [", n, "] of ", dtype);
}

void check_layer(const Layer& l, const Step& s, at::ScalarType dtype) {
  for (const at::Tensor* norm : {&l.input_norm, &l.post_norm})
    TORCH_CHECK_VALUE(norm->dim() == 1 && norm->size(0) == s.d && norm->scalar_type() == dtype &&
                          norm->is_contiguous(),
                      "quantized decode layers: a norm's weight must be [", s.d, "] of ", dtype,
                      "; got ", norm->sizes(), " ", norm->scalar_type());
  const int64_t width = weight_outputs(l.qkv, l.qkv_scales, dtype, s.d, "qkv_proj");
  TORCH_CHECK_VALUE(width == (s.q_heads + 2 * s.hkv) * s.head_dim,
                    "quantized decode layers: qkv_proj gives ", width, " outputs, not (",
                    s.q_heads, " + 2 x ", s.hkv, ") heads of ", s.head_dim);
  check_bias(l.qkv_bias, width, dtype, "qkv_proj");
  TORCH_CHECK_VALUE(weight_outputs(l.o, l.o_scales, dtype, s.q_heads * s.head_dim, "o_proj") ==
                        s.d,
                    "quantized decode layers: o_proj must give the hidden size ", s.d);
  const int64_t gate_up = weight_outputs(l.gate_up, l.gate_up_scales, dtype, s.d, "gate_up_proj");
  TORCH_CHECK_VALUE(gate_up % 2 == 0, "quantized decode layers: gate_up_proj gives ", gate_up,
                    " outputs, not gate's and up's alike");
  check_bias(l.gate_up_bias, gate_up, dtype, "gate_up_proj");
  TORCH_CHECK_VALUE(weight_outputs(l.down, l.down_scales, dtype, gate_up / 2, "down_proj") == s.d,
                    "quantized decode layers: down_proj must give the hidden size ", s.d);
}

// A step's buffers, which every layer uses in turn: the hidden rows and the residual (the op's
// outputs), the normed rows, and the products' outputs
struct Buffers {
  at::Tensor hidden, residual, normed, qkv, o, gate_up, act;
};

// Layer i's tensors out of the op's lists
Layer layer_at(at::TensorList norms, at::TensorList weights,
               const c10::List<std::optional<at::Tensor>>& biases, int64_t i) {
  const at::Tensor* w = weights.data() + 8 * i;
  return Layer{norms[2 * i], norms[2 * i + 1], w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7],
               biases.get(2 * i), biases.get(2 * i + 1)};
}

// A layer's attention part, from x (the op's input, or the previous part's output): the residual
// updated in place, the O product's output into b.o
template <typename T>
void attention_part(const Layer& l, const Step& s, int64_t index, const at::Tensor& x,
                    Buffers& b) {
  const int64_t rows = s.rows, d = s.d, width = l.qkv.size(0);
  const int threads = at::get_num_threads();
  add_norm(elems<T>(x), elems_mut<T>(b.residual), elems<T>(l.input_norm), s.eps, rows, d,
           elems_mut<T>(b.normed));
  project(elems<T>(b.normed), rows, d, l.qkv, l.qkv_scales, elems_mut<T>(b.qkv), threads);
  if (l.qkv_bias.has_value()) add_bias(elems_mut<T>(b.qkv), elems<T>(*l.qkv_bias), rows, width);
  rotate(elems_mut<T>(b.qkv), rows, width, s.q_heads + s.hkv, s.head_dim,
         s.cos.const_data_ptr<float>(), s.sin.const_data_ptr<float>(),
         s.positions.const_data_ptr<int32_t>());
  const at::Tensor heads = b.qkv.view({rows, s.q_heads + 2 * s.hkv, s.head_dim});
  const at::Tensor attended =
      attend(heads.narrow(1, 0, s.q_heads), heads.narrow(1, s.q_heads, s.hkv),
             heads.narrow(1, s.q_heads + s.hkv, s.hkv), s.cache, index, s.slots, s.table, s.lens,
             s.scale);
  project(elems<T>(attended), rows, s.q_heads * s.head_dim, l.o, l.o_scales, elems_mut<T>(b.o),
          threads);
}

// A layer's MLP part, from x (the O product's output, or its sum over ranks): the residual
// updated in place, the down product's output into b.hidden
template <typename T>
void mlp_part(const Layer& l, const Step& s, const at::Tensor& x, Buffers& b) {
  const int64_t rows = s.rows, d = s.d, ffn = l.gate_up.size(0) / 2;
  const int threads = at::get_num_threads();
  add_norm(elems<T>(x), elems_mut<T>(b.residual), elems<T>(l.post_norm), s.eps, rows, d,
           elems_mut<T>(b.normed));
  project(elems<T>(b.normed), rows, d, l.gate_up, l.gate_up_scales, elems_mut<T>(b.gate_up),
          threads);
  if (l.gate_up_bias.has_value())
    add_bias(elems_mut<T>(b.gate_up), elems<T>(*l.gate_up_bias), rows, 2 * ffn);
  silu_mul(elems<T>(b.gate_up), rows, ffn, elems_mut<T>(b.act));
  project(elems<T>(b.act), rows, ffn, l.down, l.down_scales, elems_mut<T>(b.hidden), threads);
}

// Parts [first, last) (part 2i: layer i's attention, 2i + 1: its MLP), each from the one before
template <typename T>
void run_parts(at::TensorList norms, at::TensorList weights,
               const c10::List<std::optional<at::Tensor>>& biases, const Step& s,
               const at::Tensor& x, int64_t first, int64_t last, Buffers& b) {
  for (int64_t part = first; part < last; ++part) {
    const Layer l = layer_at(norms, weights, biases, part / 2);
    if (part % 2 == 0)
      attention_part<T>(l, s, s.first_layer + part / 2, part == first ? x : b.hidden, b);
    else
      mlp_part<T>(l, s, part == first ? x : b.o, b);
  }
}

void check_step(const at::Tensor& x, const Step& s, int64_t layers, int64_t norms,
                int64_t weights, int64_t biases) {
  const int64_t end = s.first_layer + layers;
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous() &&
                        (dtype == at::kFloat || dtype == at::kBFloat16),
                    "quantized decode layers: x [rows, d] contiguous, float32 or bfloat16; got ",
                    x.sizes(), " ", dtype);
  TORCH_CHECK_VALUE(norms == 2 * layers && weights == 8 * layers && biases == 2 * layers &&
                        layers > 0,
                    "quantized decode layers: per layer 2 norms, 8 weight tensors and 2 biases; "
                    "got ", norms, ", ", weights, " and ", biases, " for ", layers, " layers");
  TORCH_CHECK_VALUE(s.cache.dim() == 6 && s.cache.scalar_type() == dtype && s.q_heads > 0 &&
                        s.q_heads % s.hkv == 0 && s.head_dim % 2 == 0 && s.first_layer >= 0 &&
                        s.cache.size(1) >= end,
                    "quantized decode layers: a KV cache [2, layers, blocks, block, kv heads, d] "
                    "of the activations' dtype holding the listed layers [", s.first_layer, ", ",
                    end, "), and whole query groups per KV head; got ", s.cache.sizes(), " ",
                    s.cache.scalar_type(), " for ", s.q_heads, " query heads");
  TORCH_CHECK_VALUE(s.cos.scalar_type() == at::kFloat && s.sin.scalar_type() == at::kFloat &&
                        s.cos.is_contiguous() && s.sin.is_contiguous() && s.cos.dim() == 2 &&
                        s.cos.sizes() == s.sin.sizes() && s.cos.size(1) == s.head_dim / 2 &&
                        s.positions.scalar_type() == at::kInt && s.positions.is_contiguous() &&
                        s.positions.numel() == s.rows,
                    "quantized decode layers: cos and sin [positions, d/2] float32 and int32 "
                    "positions [rows]");
  const int32_t* position = s.positions.const_data_ptr<int32_t>();
  for (int64_t r = 0; r < s.rows; ++r)
    TORCH_CHECK_INDEX(position[r] >= 0 && position[r] < s.cos.size(0), "quantized decode "
                      "layers: position ", position[r], " outside the rotary tables' ",
                      s.cos.size(0));
}

// prefill::quantized_decode_layers: parts [first_part, first_part + parts) of the listed layers of
// a decode step (part 2i: listed layer i's attention, 2i + 1: its MLP; listed layer i is the
// cache's layer first_layer + i), from x [rows, d], the embedded rows or
// the part before's output (summed over ranks, with tp > 1), and the residual (zeros before the
// first layer), which it updates in place. Layer i's tensors are norms[2i : 2i + 2] (input,
// post-attention), weights[8i : 8i + 8] (qkv, o, gate/up and down, each as its two tensors) and
// biases[2i : 2i + 2] (qkv's, gate/up's, or None); a weight's two tensors are int8 codes and
// scales, int4 nibbles and steps, or float values and an empty tensor (weight_outputs). An
// attention part: RMSNorm, the QKV product (+ bias), RoPE, the new K/V stored and each row's
// attention over the cache, the O product. An MLP part: RMSNorm of x plus the residual, the
// gate/up product (+ bias), SiLU·mul, the down product. Returns the last part's output.
at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& residual, at::TensorList norms,
                         double eps, at::TensorList weights,
                         const c10::List<std::optional<at::Tensor>>& biases,
                         const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& positions, const at::Tensor& cache,
                         const at::Tensor& slots, const at::Tensor& table, const at::Tensor& lens,
                         int64_t q_heads, double scale, int64_t first_layer, int64_t first_part,
                         int64_t parts) {
  const int64_t layers = static_cast<int64_t>(norms.size()) / 2;
  const Step s{cos, sin, positions, cache, slots, table, lens, first_layer,
               x.size(0), x.dim() == 2 ? x.size(1) : 0,
               q_heads, cache.dim() == 6 ? cache.size(4) : 1, cache.dim() == 6 ? cache.size(5) : 0,
               static_cast<float>(eps), scale};
  check_step(x, s, layers, static_cast<int64_t>(norms.size()),
             static_cast<int64_t>(weights.size()), static_cast<int64_t>(biases.size()));
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                        residual.is_contiguous(),
                    "quantized decode layers: the residual must be contiguous, like x ",
                    x.sizes(), " ", x.scalar_type(), "; got ", residual.sizes(), " ",
                    residual.scalar_type());
  TORCH_CHECK_VALUE(first_part >= 0 && parts >= 1 && first_part + parts <= 2 * layers,
                    "quantized decode layers: parts [", first_part, ", ", first_part + parts,
                    ") of the ", 2 * layers, " (two a layer)");
  const int64_t last = first_part + parts;
  const Layer first = layer_at(norms, weights, biases, first_part / 2);
  for (int64_t i = first_part / 2; i < (last + 1) / 2; ++i) {  // the layers the parts touch
    const Layer l = layer_at(norms, weights, biases, i);
    check_layer(l, s, x.scalar_type());
    TORCH_CHECK_VALUE(l.gate_up.size(0) == first.gate_up.size(0),
                      "quantized decode layers: every layer's gate_up_proj must give ",
                      first.gate_up.size(0), " outputs, as the first's; layer ", s.first_layer + i,
                      "'s gives ",
                      l.gate_up.size(0));
  }
  const auto rows = [&](int64_t n) { return at::empty({s.rows, n}, x.options()); };
  Buffers b{rows(s.d), residual, rows(s.d), rows(first.qkv.size(0)), rows(s.d),
            rows(first.gate_up.size(0)), rows(first.gate_up.size(0) / 2)};
  if (x.scalar_type() == at::kBFloat16)
    run_parts<bf16>(norms, weights, biases, s, x, first_part, last, b);
  else
    run_parts<float>(norms, weights, biases, s, x, first_part, last, b);
  return last % 2 == 0 ? b.hidden : b.o;
}

}  // namespace

// 1 where this build has the int4 product (an AVX2 CPU or better), else 0.
extern "C" int q4_rows_supported() {
#if defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

// The ops' CPU kernels (engine/rank/quantized_rows.py calls this after loading the library; a
// build loaded only to be looked at registers nothing). 0: done; 1: registering threw.
extern "C" int register_ops() {
  return register_cpu_kernels([](torch::Library& library) {
    library.impl("int8_rows", TORCH_FN(int8_rows));
    library.impl("q4_rows", TORCH_FN(q4_rows));
    library.impl("quantized_decode_layers", TORCH_FN(decode_layers));
  });
}
