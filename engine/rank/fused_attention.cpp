// Causal attention of a prompt (or a prompt chunk after cached keys) on a CPU, fused: scores,
// online softmax and the product with V for a tile of queries stay in the core's caches, and
// the query heads that share a KV head go through each K/V tile together. float32 or bfloat16
// inputs and output, float32 sums either way: bf16 products run as pair dot products where the
// CPU has them (AVX512-BF16), else on widened copies.
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

// How the products read their operands: float32 values, or (below) bf16 pairs. `Elem` is what
// Q, K, V and the probabilities are packed as; each multiply takes STEP elements of the sum.
struct Floats {
  using Elem = float;
  static constexpr int STEP = 1;
  static Elem from(float x) { return x; }
  static Elem from(bf16 x) { return widen(x); }
  static vf load_b(const float* p) { return load(p); }
  static vf splat_a(const float* p) { return splat(*p); }
  static vf fma(vf acc, vf a, vf b) { return acc + a * b; }
  static void store_p(float* p, vf e) { store(p, e); }
};

#if defined(__AVX512BF16__)
// bf16 inputs on a CPU with bf16 dot products (AVX512-BF16): one instruction multiplies pairs
// of bf16 and adds both products to a float32 lane, so the products read their operands as
// pairs along the sum's index. Scores are float32 sums of exact bf16 products; the
// probabilities are rounded to bf16 for P V, as torch's bf16 attention rounds them.
static_assert(W == 16, "bf16 pairs fill 512-bit registers");
struct Bf16Pairs {
  using Elem = uint16_t;
  static constexpr int STEP = 2;
  static Elem from(bf16 x) { return x.bits; }
  static __m512bh load_b(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512bh splat_a(const uint16_t* p) {
    uint32_t both;
    std::memcpy(&both, p, sizeof both);
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
  }
  static vf fma(vf acc, __m512bh a, __m512bh b) {
    return (vf)_mm512_dpbf16_ps((__m512)acc, a, b);
  }
  static void store_p(uint16_t* p, vf e) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)e));
  }
};
#endif

// Operands packed STEP-wise: element k of column j of a [depth][cols] matrix sits at
// ((k / STEP) * cols + j) * STEP + k % STEP, so one load takes W columns' STEP elements.
template <typename Mul>
inline int64_t packed(int64_t k, int64_t j, int64_t cols) {
  return ((k / Mul::STEP) * cols + j) * Mul::STEP + k % Mul::STEP;
}

// out[i][:C W] (+)= sum over k < depth of A[i][k] B[k][:C W], for rows i < rows <= R: each
// A element broadcast against C vectors of B's row, R x C accumulators held in registers
template <typename Mul, int R, int C>
inline void tile_product(const typename Mul::Elem* A, int64_t lda, int rows, int depth,
                         const typename Mul::Elem* B, int64_t cols, float* out, int64_t ldo,
                         bool accumulate) {
  vf acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < C; ++c)
      acc[i][c] = accumulate && i < rows ? load(out + i * ldo + c * W) : splat(0.f);
  for (int k = 0; k < depth; k += Mul::STEP) {
    decltype(Mul::load_b(B)) b[C];
    for (int c = 0; c < C; ++c) b[c] = Mul::load_b(B + packed<Mul>(k, c * W, cols));
    for (int i = 0; i < R; ++i) {
      if (i < rows) {
        const auto a = Mul::splat_a(A + i * lda + k);
        for (int c = 0; c < C; ++c) acc[i][c] = Mul::fma(acc[i][c], a, b[c]);
      }
    }
  }
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < C; ++c) store(out + i * ldo + c * W, acc[i][c]);
}

// out[M][:width] (+)= A[M][depth] B[depth][:width], B packed with `cols` columns; width a
// multiple of C W (depth of STEP: an odd tail pairs with zeros)
template <typename Mul, int R, int C>
void product(const typename Mul::Elem* A, int64_t lda, int M, int depth,
             const typename Mul::Elem* B, int64_t cols, int width, float* out, int64_t ldo,
             bool accumulate) {
  for (int j = 0; j < width; j += C * W)
    for (int i = 0; i < M; i += R) {
      const auto* b = B + j * Mul::STEP;
      if (M - i >= R)  // full tiles: `rows` is a constant once inlined
        tile_product<Mul, R, C>(A + i * lda, lda, R, depth, b, cols, out + i * ldo + j, ldo,
                                accumulate);
      else
        tile_product<Mul, R, C>(A + i * lda, lda, M - i, depth, b, cols, out + i * ldo + j,
                                ldo, accumulate);
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

// every head's K as [d][KEYS] tiles and V as [KEYS][d] tiles, packed; zero past num_k
template <typename Mul, typename T, int D>
void pack(const Problem<T>& p, int64_t tiles, typename Mul::Elem* kt,
          typename Mul::Elem* vt) {
#pragma omp for collapse(2)
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      const int64_t offset = (h * tiles + tile) * D * KEYS;
      for (int j = 0; j < KEYS; ++j) {
        const int64_t key = tile * KEYS + j;
        const T* k = p.k + key * p.k_stride + h * D;
        const T* v = p.v + key * p.v_stride + h * D;
        for (int dd = 0; dd < D; ++dd) {
          const bool real = key < p.num_k;
          kt[offset + packed<Mul>(dd, j, KEYS)] = real ? Mul::from(k[dd]) : typename Mul::Elem{};
          vt[offset + packed<Mul>(j, dd, D)] = real ? Mul::from(v[dd]) : typename Mul::Elem{};
        }
      }
    }
}

// scores of one tile -> times `scale`, masked, probabilities into P (in place where P is S);
// rescales O and the running max/sum
template <typename Mul, int D>
void softmax_tile(float* S, int M, int64_t group, int64_t first_visible, int64_t j0, int nk,
                  float scale, float* O, float* m, float* l, typename Mul::Elem* P) {
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
      Mul::store_p(P + r * KEYS + j, e);
      sum += e;
    }
    l[r] += hsum(sum);
  }
}

// per-thread buffers of one work unit
template <typename Mul>
struct Scratch {
  float *S, *O, *m, *l;
  typename Mul::Elem *Q, *P;

  static int64_t floats(int64_t rows, int D) {  // Q and P in float-sized slots, rounded up
    const int64_t packed = rows * (D + KEYS) * sizeof(typename Mul::Elem);
    return rows * KEYS + rows * D + rows * 2 + (packed + 3) / 4;
  }
  Scratch(float* at, int64_t rows, int D)
      : S(at), O(S + rows * KEYS), m(O + rows * D), l(m + rows),
        Q(reinterpret_cast<typename Mul::Elem*>(l + rows)), P(Q + rows * D) {
    if constexpr (std::is_same_v<typename Mul::Elem, float>) P = S;  // in place
  }
};

// one KV head's queries of QUERY_TOKENS tokens from `t0`, through every key they see
template <typename Mul, typename T, int D>
void attend_unit(const Problem<T>& p, const typename Mul::Elem* kt_head,
                 const typename Mul::Elem* vt_head, int64_t h, int64_t t0,
                 const Scratch<Mul>& b) {
  const int64_t group = p.hq / p.hkv, tokens = std::min(QUERY_TOKENS, p.num_q - t0);
  const int M = static_cast<int>(tokens * group);  // rows token-major: token t, head g
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const T* src = p.q + (t0 + t) * p.q_stride + (h * group + g) * D;
      for (int dd = 0; dd < D; ++dd) {
        if constexpr (Mul::STEP == 1)  // float queries take the scale: one multiply per query
          b.Q[(t * group + g) * D + dd] = widen(src[dd]) * p.scale;
        else  // bf16 pairs are multiplied as they are: the scores take it
          b.Q[(t * group + g) * D + dd] = Mul::from(src[dd]);
      }
    }
  std::fill(b.O, b.O + M * D, 0.f);
  std::fill(b.m, b.m + M, -INFINITY);
  std::fill(b.l, b.l + M, 0.f);
  const int64_t first_visible = p.num_k - p.num_q + t0;  // the last key token t0 sees
  const int64_t seen = first_visible + tokens;           // keys the last token sees
  for (int64_t j0 = 0; j0 < seen; j0 += KEYS) {
    const int nk = static_cast<int>(std::min<int64_t>(KEYS, seen - j0));
    const int span = (nk + SCORE_VECTORS * W - 1) / (SCORE_VECTORS * W) * (SCORE_VECTORS * W);
    const int64_t tile = (j0 / KEYS) * D * KEYS;
    product<Mul, SCORE_ROWS, SCORE_VECTORS>(b.Q, D, M, D, kt_head + tile, KEYS, span, b.S,
                                            KEYS, false);
    softmax_tile<Mul, D>(b.S, M, group, first_visible, j0, nk, Mul::STEP == 1 ? 1.f : p.scale,
                         b.O, b.m, b.l, b.P);
    product<Mul, OUT_ROWS, D / W>(b.P, KEYS, M, nk, vt_head + tile, D, D, b.O, D, true);
  }
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int r = static_cast<int>(t * group + g);
      T* dst = p.out + (t0 + t) * p.out_stride + (h * group + g) * D;
      const float inv = 1.f / b.l[r];
      for (int dd = 0; dd < D; ++dd) narrow(b.O[r * D + dd] * inv, dst + dd);
    }
}

template <typename Mul, typename T, int D>
void attend(const Problem<T>& p, int threads) {
  const int64_t tiles = (p.num_k + KEYS - 1) / KEYS;
  const int64_t blocks = (p.num_q + QUERY_TOKENS - 1) / QUERY_TOKENS, units = p.hkv * blocks;
  const int64_t rows = QUERY_TOKENS * (p.hq / p.hkv), per_thread = Scratch<Mul>::floats(rows, D);
  // every buffer before the parallel region: an exception cannot leave one
  std::vector<typename Mul::Elem> kt(static_cast<size_t>(p.hkv * tiles * D * KEYS));
  std::vector<typename Mul::Elem> vt(kt.size());
  std::vector<float> scratch(static_cast<size_t>(threads * per_thread));
#pragma omp parallel num_threads(threads)
  {
    pack<Mul, T, D>(p, tiles, kt.data(), vt.data());  // ends in the loop's barrier
    const Scratch<Mul> buffers(scratch.data() + omp_get_thread_num() * per_thread, rows, D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      // later query blocks see more keys: the costliest start first
      const int64_t h = u % p.hkv, block = blocks - 1 - u / p.hkv, head = h * tiles * D * KEYS;
      attend_unit<Mul, T, D>(p, kt.data() + head, vt.data() + head, h, block * QUERY_TOKENS,
                             buffers);
    }
  }
}

template <typename T, int D>
void attend_on(const Problem<T>& p, int threads) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    attend<Bf16Pairs, T, D>(p, threads);
    return;
  }
#endif
  attend<Floats, T, D>(p, threads);
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
