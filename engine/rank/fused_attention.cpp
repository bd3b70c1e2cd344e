// Causal attention of a prompt (or a prompt chunk after cached keys) on a CPU, fused: scores,
// online softmax and the product with V for a tile of queries stay in the core's caches, and
// the query heads that share a KV head go through each K/V tile together. float32 or bfloat16
// inputs and output; the arithmetic is float32 either way (bf16 K and V are widened once).
// Built and loaded by engine/rank/fused_attention.py, for the CPU it runs on (-march=native).
//
// Queries are the last num_q positions of a context of num_k keys. q [num_q, hq, d],
// k/v [num_k, hkv, d] and out [num_q, hq, d] have contiguous heads; rows may be strided.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
constexpr int W = 16;  // floats per vector register
#else
constexpr int W = 8;
#endif

namespace {

typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

constexpr int64_t QUERY_TOKENS = 16;  // query tokens per work unit (times the group's heads)
constexpr int KEYS = 128;             // keys per tile
constexpr int SCORE_ROWS = 8, SCORE_VECTORS = 2;  // register tile of the scores' product
constexpr int OUT_ROWS = 6;                       // rows of the register tile of P V
// the tile sizes above timed fastest of those tried for SmolLM2's heads on an AVX512 EPYC

inline vf splat(float x) { return vf{} + x; }

// bfloat16 is float32's upper half: widening appends zeros; narrowing rounds to nearest even
struct bf16 { uint16_t bits; };
inline float widen(float x) { return x; }
inline float widen(bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void narrow(float x, float* out) { *out = x; }
inline void narrow(float x, bf16* out) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  out->bits = std::isnan(x) ? 0x7FC0 : static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}
inline vf load(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline float hmax(vf x) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)x);
#else
  float m = x[0];
  for (int w = 1; w < W; ++w) m = std::max(m, x[w]);
  return m;
#endif
}

inline float hsum(vf x) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)x);
#else
  float s = 0.f;
  for (int w = 0; w < W; ++w) s += x[w];
  return s;
#endif
}

// e^x for x <= 0 (shifted scores), within ~2 ulp; 0 below -87 (and for -inf, a masked key).
// x = n ln2 + r, |r| <= ln2/2: e^r by its Taylor polynomial, 2^n by building the exponent.
inline vf vexp(vf x) {
  const vf floor_x = splat(-87.f);
  vf clamped = x < floor_x ? floor_x : x;
  vf t = clamped * 1.44269504088896341f;
  vf n = __builtin_convertvector(__builtin_convertvector(t - 0.5f, vi), vf);  // round: t < 0
  vf r = clamped - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x <= floor_x ? splat(0.f) : p * two_n;
}

// S[rows][KEYS] (cols from 0) = Q[rows][d] K^T, K's tile packed as KT[d][KEYS]
template <int R, int C>
inline void score_tile(const float* Q, int rows, int d, const float* KT, float* S) {
  vf acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = splat(0.f);
  for (int dd = 0; dd < d; ++dd) {
    vf b[C];
    for (int c = 0; c < C; ++c) b[c] = load(KT + dd * KEYS + c * W);
    for (int i = 0; i < R; ++i) {
      if (i < rows) {
        vf a = splat(Q[i * d + dd]);
        for (int c = 0; c < C; ++c) acc[i][c] += a * b[c];
      }
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < C; ++c) store(S + i * KEYS + c * W, acc[i][c]);
}

// the first `span` columns of S[M][KEYS] = Q[M][d] K^T
void scores(const float* Q, int M, int d, const float* KT, int span, float* S) {
  constexpr int R = SCORE_ROWS, C = SCORE_VECTORS;
  for (int j = 0; j < span; j += C * W)
    for (int i = 0; i < M; i += R) {
      if (M - i >= R) score_tile<R, C>(Q + i * d, R, d, KT + j, S + i * KEYS + j);
      else score_tile<R, C>(Q + i * d, M - i, d, KT + j, S + i * KEYS + j);
    }
}

// O[rows][D] += P[rows][nk] V[nk][D] (V's rows `ldv` apart)
template <int D, int R>
inline void pv_tile(const float* P, int rows, int nk, const float* V, int64_t ldv, float* O) {
  constexpr int C = D / W;
  vf acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = i < rows ? load(O + i * D + c * W) : splat(0.f);
  for (int j = 0; j < nk; ++j) {
    vf b[C];
    for (int c = 0; c < C; ++c) b[c] = load(V + j * ldv + c * W);
    for (int i = 0; i < R; ++i) {
      if (i < rows) {
        vf a = splat(P[i * KEYS + j]);
        for (int c = 0; c < C; ++c) acc[i][c] += a * b[c];
      }
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < C; ++c) store(O + i * D + c * W, acc[i][c]);
}

template <int D>
void accumulate(const float* P, int M, int nk, const float* V, int64_t ldv, float* O) {
  constexpr int R = OUT_ROWS;
  for (int i = 0; i < M; i += R) {
    if (M - i >= R) pv_tile<D, R>(P + i * KEYS, R, nk, V, ldv, O + i * D);
    else pv_tile<D, R>(P + i * KEYS, M - i, nk, V, ldv, O + i * D);
  }
}

template <typename T>
struct Problem {
  const T *q, *k, *v;
  T* out;
  int64_t q_stride, k_stride, v_stride, out_stride;
  int64_t num_q, num_k, hq, hkv;
  float scale;
};

// K of every head transposed, one [d][KEYS] tile after another, zero past num_k; and bf16 V
// widened, [hkv][num_k][d] (float32 V is read where it is)
template <typename T, int D>
void pack(const Problem<T>& p, int64_t tiles, float* kt, float* vt) {
#pragma omp for collapse(2) nowait
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      float* dst = kt + (h * tiles + tile) * D * KEYS;
      for (int j = 0; j < KEYS; ++j) {
        const int64_t key = tile * KEYS + j;
        const T* src = p.k + key * p.k_stride + h * D;
        for (int dd = 0; dd < D; ++dd) dst[dd * KEYS + j] = key < p.num_k ? widen(src[dd]) : 0.f;
      }
    }
  if (vt == nullptr) {
#pragma omp barrier
    return;
  }
#pragma omp for collapse(2)
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t key = 0; key < p.num_k; ++key)
      for (int dd = 0; dd < D; ++dd)
        vt[(h * p.num_k + key) * D + dd] = widen(p.v[key * p.v_stride + h * D + dd]);
}

// scores of one tile (times `scale`) -> probabilities, in place, and rounded to bf16 into
// P16 where given; rescales O and the running max/sum
template <int D>
void softmax_tile(float* S, int M, int64_t group, int64_t first_visible, int64_t j0, int nk,
                  float scale, float* O, float* m, float* l, uint16_t* P16) {
  const int span = (nk + SCORE_VECTORS * W - 1) / (SCORE_VECTORS * W) * (SCORE_VECTORS * W);
  for (int r = 0; r < M; ++r) {
    float* s = S + r * KEYS;
    // row r's token sees keys up to first_visible + r / group
    const int64_t visible = std::clamp<int64_t>(first_visible + r / group + 1 - j0, 0, nk);
    if (scale != 1.f)
      for (int j = 0; j < visible; j += W) store(s + j, load(s + j) * scale);  // past: masked
    for (int j = visible; j < span; ++j) s[j] = -INFINITY;
    vf mx = splat(-INFINITY);
    for (int j = 0; j < span; j += W) { vf x = load(s + j); mx = x > mx ? x : mx; }
    const float mnew = std::max(m[r], hmax(mx));
    if (mnew != m[r]) {  // e^(old max - new max) scales what was summed so far (0 at first)
      const float alpha = vexp(splat(m[r] - mnew))[0];
      l[r] *= alpha;
      for (int c = 0; c < D; c += W) store(O + r * D + c, load(O + r * D + c) * alpha);
      m[r] = mnew;
    }
    vf sum = splat(0.f), shift = splat(mnew);
    for (int j = 0; j < span; j += W) {
      vf e = vexp(load(s + j) - shift);
      store(s + j, e);
      sum += e;
#if defined(__AVX512BF16__)
      if (P16 != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(P16 + r * KEYS + j),
                                              (__m256i)_mm512_cvtneps_pbh((__m512)e));
#endif
    }
    l[r] += hsum(sum);
  }
}

// one KV head's queries of QUERY_TOKENS tokens from `t0`, through every key they see
template <typename T, int D>
void attend_unit(const Problem<T>& p, const float* kt_head, const float* v_head, int64_t ldv,
                 int64_t h, int64_t t0, float* Q, float* S, float* O, float* m, float* l) {
  const int64_t group = p.hq / p.hkv, tokens = std::min(QUERY_TOKENS, p.num_q - t0);
  const int M = static_cast<int>(tokens * group);  // rows token-major: token t, head g
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = p.q + (t0 + t) * p.q_stride + (h * group + g) * D;
      for (int dd = 0; dd < D; ++dd) Q[(t * group + g) * D + dd] = widen(src[dd]) * p.scale;
    }
  std::fill(O, O + M * D, 0.f);
  std::fill(m, m + M, -INFINITY);
  std::fill(l, l + M, 0.f);
  const int64_t first_visible = p.num_k - p.num_q + t0;  // the last key token t0 sees
  const int64_t seen = first_visible + tokens;           // keys the last token sees
  for (int64_t j0 = 0; j0 < seen; j0 += KEYS) {
    const int nk = static_cast<int>(std::min<int64_t>(KEYS, seen - j0));
    const int span = (nk + SCORE_VECTORS * W - 1) / (SCORE_VECTORS * W) * (SCORE_VECTORS * W);
    scores(Q, M, D, kt_head + (j0 / KEYS) * D * KEYS, span, S);
    softmax_tile<D>(S, M, group, first_visible, j0, nk, 1.f, O, m, l, nullptr);
    accumulate<D>(S, M, nk, v_head + j0 * ldv, ldv, O);
  }
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int r = static_cast<int>(t * group + g);
      T* dst = p.out + (t0 + t) * p.out_stride + (h * group + g) * D;
      const float inv = 1.f / l[r];
      for (int dd = 0; dd < D; ++dd) narrow(O[r * D + dd] * inv, dst + dd);
    }
}

template <typename T, int D>
void attend(const Problem<T>& p, int threads) {
  constexpr bool widened_v = !std::is_same_v<T, float>;
  const int64_t tiles = (p.num_k + KEYS - 1) / KEYS;
  const int64_t blocks = (p.num_q + QUERY_TOKENS - 1) / QUERY_TOKENS, units = p.hkv * blocks;
  const int64_t rows = QUERY_TOKENS * (p.hq / p.hkv);
  const int64_t per_thread = rows * D * 2 + rows * KEYS + rows * 2;  // Q, O, S, max, sum
  // every buffer before the parallel region: an exception cannot leave one
  std::vector<float> kt(static_cast<size_t>(p.hkv * tiles * D * KEYS));
  std::vector<float> vt(widened_v ? static_cast<size_t>(p.hkv * p.num_k * D) : 0);
  std::vector<float> scratch(static_cast<size_t>(threads * per_thread));
#pragma omp parallel num_threads(threads)
  {
    pack<T, D>(p, tiles, kt.data(), widened_v ? vt.data() : nullptr);  // ends in a barrier
    float* Q = scratch.data() + omp_get_thread_num() * per_thread;
    float *O = Q + rows * D, *S = O + rows * D, *m = S + rows * KEYS, *l = m + rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      // later query blocks see more keys: the costliest start first
      const int64_t h = u % p.hkv, block = blocks - 1 - u / p.hkv;
      const float* v_head = widened_v ? vt.data() + h * p.num_k * D
                                      : reinterpret_cast<const float*>(p.v) + h * D;
      attend_unit<T, D>(p, kt.data() + h * tiles * D * KEYS, v_head, widened_v ? D : p.v_stride,
                        h, block * QUERY_TOKENS, Q, S, O, m, l);
    }
  }
}

#if defined(__AVX512BF16__)
// bf16 inputs on a CPU with bf16 dot products (AVX512-BF16): each instruction multiplies pairs
// of bf16 and adds both products to a float32 lane, so the products read K, V and the rounded
// probabilities as pairs along their sum's index: K as [d/2][KEYS][2] per tile, V as
// [keys/2][d][2]. Scores are float32 sums of exact bf16 products; the probabilities are rounded
// to bf16 for P V, as torch's bf16 attention rounds them.
static_assert(W == 16, "the pairs below fill 512-bit registers");

inline __m512bh pairs(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh pair_splat(const uint16_t* p) {
  uint32_t both;
  std::memcpy(&both, p, sizeof both);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
}

template <int R, int C>
inline void score_tile_dot(const uint16_t* Q, int rows, int d, const uint16_t* KT, float* S) {
  __m512 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int dd = 0; dd < d; dd += 2) {
    __m512bh b[C];
    for (int c = 0; c < C; ++c) b[c] = pairs(KT + (dd / 2 * KEYS + c * W) * 2);
    for (int i = 0; i < R; ++i) {
      if (i < rows) {
        const __m512bh a = pair_splat(Q + i * d + dd);
        for (int c = 0; c < C; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], a, b[c]);
      }
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(S + i * KEYS + c * W, acc[i][c]);
}

void scores_dot(const uint16_t* Q, int M, int d, const uint16_t* KT, int span, float* S) {
  constexpr int R = SCORE_ROWS, C = SCORE_VECTORS;
  for (int j = 0; j < span; j += C * W)
    for (int i = 0; i < M; i += R) {
      const uint16_t* kt = KT + j * 2;  // column j of every pair row
      if (M - i >= R) score_tile_dot<R, C>(Q + i * d, R, d, kt, S + i * KEYS + j);
      else score_tile_dot<R, C>(Q + i * d, M - i, d, kt, S + i * KEYS + j);
    }
}

template <int D, int R>
inline void pv_tile_dot(const uint16_t* P, int rows, int nk, const uint16_t* VT, float* O) {
  constexpr int C = D / W;
  __m512 acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c)
      acc[i][c] = i < rows ? _mm512_loadu_ps(O + i * D + c * W) : _mm512_setzero_ps();
  for (int j = 0; j < nk; j += 2) {  // an odd tail pairs with a zero probability
    __m512bh b[C];
    for (int c = 0; c < C; ++c) b[c] = pairs(VT + (j / 2 * D + c * W) * 2);
    for (int i = 0; i < R; ++i) {
      if (i < rows) {
        const __m512bh a = pair_splat(P + i * KEYS + j);
        for (int c = 0; c < C; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], a, b[c]);
      }
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(O + i * D + c * W, acc[i][c]);
}

template <int D>
void accumulate_dot(const uint16_t* P, int M, int nk, const uint16_t* VT, float* O) {
  constexpr int R = OUT_ROWS;
  for (int i = 0; i < M; i += R) {
    if (M - i >= R) pv_tile_dot<D, R>(P + i * KEYS, R, nk, VT, O + i * D);
    else pv_tile_dot<D, R>(P + i * KEYS, M - i, nk, VT, O + i * D);
  }
}

// K and V of every head as pairs, zero past num_k (to a whole tile)
template <int D>
void pack_pairs(const Problem<bf16>& p, int64_t tiles, uint16_t* kt, uint16_t* vt) {
#pragma omp for collapse(2)
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      uint16_t* kdst = kt + (h * tiles + tile) * D * KEYS;
      uint16_t* vdst = vt + (h * tiles + tile) * D * KEYS;
      for (int j = 0; j < KEYS; ++j) {
        const int64_t key = tile * KEYS + j;
        const bool real = key < p.num_k;
        const bf16* k = p.k + key * p.k_stride + h * D;
        const bf16* v = p.v + key * p.v_stride + h * D;
        for (int dd = 0; dd < D; ++dd) {
          kdst[(dd / 2 * KEYS + j) * 2 + dd % 2] = real ? k[dd].bits : 0;
          vdst[(j / 2 * D + dd) * 2 + j % 2] = real ? v[dd].bits : 0;
        }
      }
    }
}

template <int D>
void attend_unit_dot(const Problem<bf16>& p, const uint16_t* kt_head, const uint16_t* vt_head,
                     int64_t h, int64_t t0, uint16_t* Q, float* S, uint16_t* P, float* O,
                     float* m, float* l) {
  const int64_t group = p.hq / p.hkv, tokens = std::min(QUERY_TOKENS, p.num_q - t0);
  const int M = static_cast<int>(tokens * group);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const bf16* src = p.q + (t0 + t) * p.q_stride + (h * group + g) * D;
      for (int dd = 0; dd < D; ++dd) Q[(t * group + g) * D + dd] = src[dd].bits;
    }
  std::fill(O, O + M * D, 0.f);
  std::fill(m, m + M, -INFINITY);
  std::fill(l, l + M, 0.f);
  const int64_t first_visible = p.num_k - p.num_q + t0, seen = first_visible + tokens;
  for (int64_t j0 = 0; j0 < seen; j0 += KEYS) {
    const int nk = static_cast<int>(std::min<int64_t>(KEYS, seen - j0));
    const int span = (nk + SCORE_VECTORS * W - 1) / (SCORE_VECTORS * W) * (SCORE_VECTORS * W);
    const int64_t tile = j0 / KEYS;
    scores_dot(Q, M, D, kt_head + tile * D * KEYS, span, S);
    softmax_tile<D>(S, M, group, first_visible, j0, nk, p.scale, O, m, l, P);
    accumulate_dot<D>(P, M, nk, vt_head + tile * D * KEYS, O);
  }
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int r = static_cast<int>(t * group + g);
      bf16* dst = p.out + (t0 + t) * p.out_stride + (h * group + g) * D;
      const float inv = 1.f / l[r];
      for (int dd = 0; dd < D; ++dd) narrow(O[r * D + dd] * inv, dst + dd);
    }
}

template <int D>
void attend_dot(const Problem<bf16>& p, int threads) {
  const int64_t tiles = (p.num_k + KEYS - 1) / KEYS;
  const int64_t blocks = (p.num_q + QUERY_TOKENS - 1) / QUERY_TOKENS, units = p.hkv * blocks;
  const int64_t rows = QUERY_TOKENS * (p.hq / p.hkv);
  // per thread, in float32 slots: S, O, max, sum, then Q and P in bf16 (two per slot)
  const int64_t per_thread = rows * KEYS + rows * D + rows * 2 + (rows * D + rows * KEYS) / 2;
  std::vector<uint16_t> kt(static_cast<size_t>(p.hkv * tiles * D * KEYS));
  std::vector<uint16_t> vt(kt.size());
  std::vector<float> scratch(static_cast<size_t>(threads * per_thread));
#pragma omp parallel num_threads(threads)
  {
    pack_pairs<D>(p, tiles, kt.data(), vt.data());  // ends in the loop's barrier
    float* S = scratch.data() + omp_get_thread_num() * per_thread;
    float *O = S + rows * KEYS, *m = O + rows * D, *l = m + rows;
    uint16_t* Q = reinterpret_cast<uint16_t*>(l + rows);
    uint16_t* P = Q + rows * D;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t h = u % p.hkv, block = blocks - 1 - u / p.hkv;
      attend_unit_dot<D>(p, kt.data() + h * tiles * D * KEYS, vt.data() + h * tiles * D * KEYS,
                         h, block * QUERY_TOKENS, Q, S, P, O, m, l);
    }
  }
}
#endif

template <typename T, int D>
void attend_on(const Problem<T>& p, int threads) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    attend_dot<D>(p, threads);
    return;
  }
#endif
  attend<T, D>(p, threads);
}

template <typename T>
int attend_any(const Problem<T>& p, int64_t head_dim, int threads) {
  switch (head_dim) {
    case 16: attend_on<T, 16>(p, threads); return 0;
    case 32: attend_on<T, 32>(p, threads); return 0;
    case 64: attend_on<T, 64>(p, threads); return 0;
    case 96: attend_on<T, 96>(p, threads); return 0;
    case 128: attend_on<T, 128>(p, threads); return 0;
    case 256: attend_on<T, 256>(p, threads); return 0;
    default: return 1;
  }
}

}  // namespace

// `bfloat16`: 0 float32 tensors, 1 bfloat16 ones. Returns 0: done; 1: a head size this build
// has no kernel for; 2: out of memory for its buffers. No C++ exception crosses into the caller
// (ctypes): it would end the process.
extern "C" int fused_causal_attention(
    const void* q, int64_t q_stride, const void* k, int64_t k_stride, const void* v,
    int64_t v_stride, void* out, int64_t out_stride, int64_t num_q, int64_t num_k, int64_t hq,
    int64_t hkv, int64_t head_dim, float scale, int bfloat16, int threads) {
  try {
    if (bfloat16) {
      const Problem<bf16> p{static_cast<const bf16*>(q), static_cast<const bf16*>(k),
                            static_cast<const bf16*>(v), static_cast<bf16*>(out), q_stride,
                            k_stride, v_stride, out_stride, num_q, num_k, hq, hkv, scale};
      return attend_any(p, head_dim, threads);
    }
    const Problem<float> p{static_cast<const float*>(q), static_cast<const float*>(k),
                           static_cast<const float*>(v), static_cast<float*>(out), q_stride,
                           k_stride, v_stride, out_stride, num_q, num_k, hq, hkv, scale};
    return attend_any(p, head_dim, threads);
  } catch (const std::bad_alloc&) {
    return 2;
  }
}
