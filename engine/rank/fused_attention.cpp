// Attention on a CPU, fused. A prompt's (or a prompt chunk's after cached keys) causal
// attention (fused_causal_attention), and a decode step's over the paged KV cache
// (fused_paged_decode, below).
//
// The prompt's: scores, online softmax and the product with V for a tile of queries stay in the
// core's caches, and the query heads that share a KV head go through each K/V tile together.
// float32 or bfloat16 inputs and output, float32 sums either way: bf16 products run in AMX tiles
// where the CPU has them (Xeons from Sapphire Rapids on; heads of a multiple of 32), else as pair
// dot products (AVX512-BF16), else on widened copies.
// Built against torch and loaded by engine/rank/fused_attention.py, for the CPU it runs on
// (-march=native). The decode step's is also the CPU kernel of the op prefill::fused_paged_decode
// (register_ops, below), which compiled decode graphs call once a layer: called through Python
// that checks and converts its arguments, a call cost more than the kernel's work.
//
// Queries are the last num_q positions of a context of num_k keys. q [num_q, hq, d],
// k/v [num_k, hkv, d] and out [num_q, hq, d] have contiguous heads; rows may be strided.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <omp.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_vectors.h"
#include "torch_ops.h"

namespace {

constexpr int64_t QUERY_TOKENS = 16;  // query tokens per work unit (times the group's heads)
constexpr int KEYS = 128;             // keys per tile
constexpr int SCORE_ROWS = 8, SCORE_VECTORS = 2;  // register tile of the scores' product
constexpr int OUT_ROWS = 6;                       // rows of the register tile of P V
// the tile sizes above timed fastest of those tried for SmolLM2's heads on an AVX512 EPYC


// How the products read their operands: float32 values, or (below) bf16 pairs. `Elem` is what
// Q, K, V and the probabilities are packed as; each multiply takes STEP elements of the sum.
struct Floats {
  using Elem = float;
  static constexpr int STEP = 1;
  static constexpr bool TILES = false;  // products in registers (below), not AMX tiles
  static constexpr int EXP_DEGREE = 5;
  static Elem from(float x) { return x; }
  static Elem from(bf16 x) { return widen(x); }
  static vf load_b(const float* p) { return load(p); }
  static vf splat_a(const float* p) {  // a load that broadcasts, not a load then a shuffle
#if defined(__AVX512F__)
    return (vf)_mm512_set1_ps(*p);
#elif defined(__AVX2__)
    return (vf)_mm256_set1_ps(*p);
#else
    return splat(*p);
#endif
  }
  static vf fma(vf acc, vf a, vf b) { return acc + a * b; }
  static void store_p(float* p, vf e) { store(p, e); }
};

#if defined(__AVX512BF16__)
// bf16 inputs on a CPU with bf16 dot products (AVX512-BF16): one instruction multiplies pairs
// of bf16 and adds both products to a float32 lane, so the products read their operands as
// pairs along the sum's index. Scores are float32 sums of exact bf16 products; the
// probabilities are rounded to bf16 for P V, as torch's bf16 attention rounds them (so their
// exp takes a degree-3 polynomial: 2 FMAs fewer a vector; with softmax_tile's single pass a
// 2048-token SmolLM2 layer timed 1.05x faster on the AMX Xeon, `.venv/bin/python -m
// bench.cpu_ops --only-prompt-attention --fused-from 5a73958`).
static_assert(W == 16, "bf16 pairs fill 512-bit registers");
struct Bf16Pairs {
  using Elem = uint16_t;
  static constexpr int STEP = 2;
  static constexpr bool TILES = false;
  static constexpr int EXP_DEGREE = 3;
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
// (always inlined: a call keeps `rows` a variable, and a test of it beside every FMA)
__attribute__((always_inline)) inline void tile_product(
    const typename Mul::Elem* A, int64_t lda, int rows, int depth, const typename Mul::Elem* B,
    int64_t cols, float* out, int64_t ldo, bool accumulate) {
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// bf16 products on AMX's tile registers (Intel Xeons from Sapphire Rapids on): one instruction
// multiplies a 16x32 bf16 tile by a 32x16 one into 16x16 float32 sums, the B tile in pairs along
// the sum's index, which is how Bf16Pairs packs K and V already. The scores, the softmax and P
// stay as Bf16Pairs has them; only the two products change.
struct AmxPairs : Bf16Pairs {
  static constexpr bool TILES = true;
};

// Linux gives a process AMX's tile state only once it asks (arch_prctl); where it refuses (an
// older kernel, a hypervisor that hides it) the kernel keeps Bf16Pairs
bool amx_granted() {
  static const bool granted = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

constexpr int TILE_ROWS = 16, TILE_DEPTH = 32, TILE_COLS = 16;  // bf16 A tile 16 x 32, C 16 x 16

// a tile's depth is 32 bf16: the tiles take heads of whole tiles (others run the pairs)
constexpr bool amx_takes(int64_t head_dim) { return head_dim % TILE_DEPTH == 0; }

// each thread's tile registers: all eight 16 rows of 64 bytes (C: 0-3, A: 4-5, B: 6-7)
void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = TILE_ROWS;
  _tile_loadconfig(&config);
}

// out[16 or 32 rows][32] (+)= A[rows][depth] B[depth][32 columns from B], B packed in pairs
// with `cols` columns; depth a multiple of TILE_DEPTH
template <bool TwoRowTiles>
inline void tile_block(const uint16_t* A, int64_t lda, int depth, const uint16_t* B,
                       int64_t cols, float* out, int64_t ldo, bool accumulate) {
  const int64_t a_bytes = lda * 2, b_bytes = cols * 4, out_bytes = ldo * 4;
  float* out2 = out + TILE_ROWS * ldo;
  if (accumulate) {
    _tile_loadd(0, out, out_bytes);
    _tile_loadd(1, out + TILE_COLS, out_bytes);
    if constexpr (TwoRowTiles) {
      _tile_loadd(2, out2, out_bytes);
      _tile_loadd(3, out2 + TILE_COLS, out_bytes);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (TwoRowTiles) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int k = 0; k < depth; k += TILE_DEPTH) {
    const uint16_t* b = B + k * cols;  // pair row k / 2: (k / 2) * cols pairs in
    _tile_loadd(6, b, b_bytes);
    _tile_loadd(7, b + 2 * TILE_COLS, b_bytes);
    _tile_loadd(4, A + k, a_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TwoRowTiles) {
      _tile_loadd(5, A + TILE_ROWS * lda + k, a_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, out_bytes);
  _tile_stored(1, out + TILE_COLS, out_bytes);
  if constexpr (TwoRowTiles) {
    _tile_stored(2, out2, out_bytes);
    _tile_stored(3, out2 + TILE_COLS, out_bytes);
  }
}

// `product` in AMX tiles: rows a multiple of TILE_ROWS (A's rows past the real ones finite), width
// a multiple of 2 TILE_COLS, depth of TILE_DEPTH (A's and B's elements past the real depth zero)
void amx_product(const uint16_t* A, int64_t lda, int rows, int depth, const uint16_t* B,
                 int64_t cols, int width, float* out, int64_t ldo, bool accumulate) {
  for (int j = 0; j < width; j += 2 * TILE_COLS) {
    int i = 0;
    for (; i + 2 * TILE_ROWS <= rows; i += 2 * TILE_ROWS)
      tile_block<true>(A + i * lda, lda, depth, B + 2 * j, cols, out + i * ldo + j, ldo,
                       accumulate);
    if (i < rows)
      tile_block<false>(A + i * lda, lda, depth, B + 2 * j, cols, out + i * ldo + j, ldo,
                        accumulate);
  }
}
#endif

template <typename T>
struct Problem {
  const T *q, *k, *v;
  T* out;
  int64_t q_stride, k_stride, v_stride, out_stride;
  int64_t num_q, num_k, hq, hkv;
  float scale;
};

// every head's K as [d][KEYS] tiles and V as [KEYS][d] tiles, packed; zero past num_k. K and V
// in loops of their own: V's rows copy as vectors (for float32; bf16 pairs interleave two rows)
template <typename Mul, typename T, int D>
void pack(const Problem<T>& p, int64_t tiles, typename Mul::Elem* kt,
          typename Mul::Elem* vt) {
  using Elem = typename Mul::Elem;
#pragma omp for collapse(2)
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t tile = 0; tile < tiles; ++tile) {
      Elem* ko = kt + (h * tiles + tile) * D * KEYS;
      Elem* vo = vt + (h * tiles + tile) * D * KEYS;
      const int real = static_cast<int>(std::clamp<int64_t>(p.num_k - tile * KEYS, 0, KEYS));
      const T* k = p.k + tile * KEYS * p.k_stride + h * D;
      const T* v = p.v + tile * KEYS * p.v_stride + h * D;
      for (int j = 0; j < real; ++j)
        for (int dd = 0; dd < D; ++dd)
          vo[packed<Mul>(j, dd, D)] = Mul::from(v[j * p.v_stride + dd]);
      for (int dd = 0; dd < D; ++dd)
        for (int j = 0; j < real; ++j)
          ko[packed<Mul>(dd, j, KEYS)] = Mul::from(k[j * p.k_stride + dd]);
      for (int j = real; j < KEYS; ++j)
        for (int dd = 0; dd < D; ++dd) {
          vo[packed<Mul>(j, dd, D)] = Elem{};
          ko[packed<Mul>(dd, j, KEYS)] = Elem{};
        }
    }
}

// Lanes of a vector: AVX512's mask registers, or elsewhere all-ones lanes of an integer vector.
#if defined(__AVX512F__)
using Lanes = __mmask16;
inline Lanes first_lanes(int n) {  // lanes 0 .. n - 1
  return n >= W ? Lanes(0xFFFF) : Lanes((1u << std::max(n, 0)) - 1);
}
#else
using Lanes = vi;
inline Lanes first_lanes(int n) {
  vi lane;
  for (int w = 0; w < W; ++w) lane[w] = w;
  return lane < n;
}
#endif

// 2^t in the lanes kept (0 in the others), for t <= RESCALE_ABOVE (scaled scores less a running
// max, or a row's max; larger t only in a pass whose results softmax_tile drops):
// t = n + f, |f| <= 1/2, 2^f by a polynomial fitted for relative error on that range (degree 5:
// ~2 ulp; degree 3: 7.5e-5, for probabilities rounded to bf16 next, whose steps are 2^-8),
// times 2^n (AVX512's scalef, which also zeroes the lanes not kept and flushes t < -149 to 0;
// elsewhere the exponent's bits). A base-2 exp takes the log2(e) into the scale the scores
// already get, so it costs one FMA less than e^x's Cody-Waite reduction.
template <int Degree = 5>
inline vf vexp2(vf t, Lanes keep) {
#if defined(__AVX512F__)
  const vf n =
      (vf)_mm512_roundscale_ps((__m512)t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  t = t < -127.f ? splat(-127.f) : t;  // 2^n stays a normal float
  // to the nearest integer: the conversion truncates toward 0
  const vf n = __builtin_convertvector(
      __builtin_convertvector(t + (t < 0.f ? splat(-0.5f) : splat(0.5f)), vi), vf);
#endif
  const vf f = t - n;
  vf p;
  if constexpr (Degree == 5) {
    p = splat(1.327722683e-3f);
    p = p * f + 9.675547481e-3f;
    p = p * f + 5.550710857e-2f;
    p = p * f + 2.402212024e-1f;
  } else {
    static_assert(Degree == 3);
    p = splat(5.517150e-2f);
    p = p * f + 2.4261096e-1f;
  }
  p = p * f + (Degree == 5 ? 6.931469440e-1f : 6.9326099e-1f);
  p = p * f + (Degree == 5 ? 1.000000119e+0f : 9.9992808e-1f);
#if defined(__AVX512F__)
  return (vf)_mm512_maskz_scalef_ps(keep, (__m512)p, (__m512)n);
#else
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return keep ? p * two_n : splat(0.f);
#endif
}

// the lane-wise max of `mx` and x's lanes kept
inline vf max_kept(vf mx, vf x, Lanes keep) {
#if defined(__AVX512F__)
  return (vf)_mm512_mask_max_ps((__m512)mx, keep, (__m512)mx, (__m512)x);
#else
  return keep && x > mx ? x : mx;
#endif
}

constexpr float LOG2E = 1.44269504088896341f;
// The running max a row's probabilities are taken against moves only when a tile's scores exceed
// it by more than this (in powers of 2): probabilities up to 2^8 lose nothing in float32 (nor in
// bf16, whose relative precision is the same at any size), and rows rarely pay for rescaling
// their output
constexpr float RESCALE_ABOVE = 8.f;

// e^(scale (s - row_max)) of one row's scores s (2^(scale2 (s - row_max))) into its P, keys from
// `visible` on as 0, added to the row's `sum`; returns the lane-wise max of the scores kept
// (`Max`; else -inf)
template <typename Mul, bool Max>
inline vf exponentiate(const float* s, int span, int visible, float scale2, float row_max,
                       typename Mul::Elem* p, vf& sum) {
  vf mx = splat(-INFINITY);
  const vf scaled = splat(scale2), shift = splat(-row_max * scale2);
  for (int j = 0; j < span; j += W) {
    const Lanes keep = first_lanes(visible - j);
    const vf x = load(s + j);
    if constexpr (Max) mx = max_kept(mx, x, keep);
    const vf e = vexp2<Mul::EXP_DEGREE>(x * scaled + shift, keep);
    Mul::store_p(p + j, e);
    sum += e;
  }
  return mx;
}

// scores of one tile -> probabilities e^(scale (score - m)) into P (in place where P is S),
// keys past a row's last visible one masked, where m is the row's running max (moved only past
// RESCALE_ABOVE, when O and the running sum are rescaled). m is kept in unscaled scores (scale > 0
// keeps their order), so the scale costs no pass of its own. A row's running sum is a vector (l
// holds W floats a row), added across its lanes once at the end, not once a tile.
// Where P is apart from S, a row that has a max takes one pass, against that max, and a second
// only where the tile's scores pass it by more than RESCALE_ABOVE (rare after a row's first
// tiles): the probabilities are those of the two passes, bit for bit, without the pass that
// finds the tile's max first.
template <typename Mul, int D>
void softmax_tile(float* S, int M, int64_t group, int64_t first_visible, int64_t j0, int nk,
                  float scale, float* O, float* m, float* l, typename Mul::Elem* P) {
  constexpr bool in_place = std::is_same_v<typename Mul::Elem, float>;  // Scratch's P is S
  const int span = (nk + W - 1) / W * W;  // the scores computed
  const float scale2 = scale * LOG2E;  // e^(scale x) = 2^(scale2 x)
  for (int r = 0; r < M; ++r) {
    const float* s = S + r * KEYS;
    typename Mul::Elem* p = P + r * KEYS;
    // row r's token sees keys up to first_visible + r / group
    const int visible =
        static_cast<int>(std::clamp<int64_t>(first_visible + r / group + 1 - j0, 0, nk));
    vf sum = load(l + r * W);
    float top;  // the tile's max of the scores the row sees
    if (!in_place && m[r] != -INFINITY) {
      vf with_tile = sum;
      top = hmax(exponentiate<Mul, true>(s, span, visible, scale2, m[r], p, with_tile));
      if (!((top - m[r]) * scale2 > RESCALE_ABOVE)) {
        store(l + r * W, with_tile);
        continue;
      }
    } else {
      vf mx = splat(-INFINITY);
      for (int j = 0; j < span; j += W) mx = max_kept(mx, load(s + j), first_lanes(visible - j));
      top = hmax(mx);
    }
    if (m[r] == -INFINITY) {  // the first tile: nothing summed yet
      m[r] = top;
    } else if ((top - m[r]) * scale2 > RESCALE_ABOVE) {
      // 2^(scale2 (old max - new max)) scales what was summed so far
      const float alpha = vexp2(splat((m[r] - top) * scale2), first_lanes(1))[0];
      sum = sum * alpha;
      for (int c = 0; c < D; c += W) store(O + r * D + c, load(O + r * D + c) * alpha);
      m[r] = top;
    }
    exponentiate<Mul, false>(s, span, visible, scale2, m[r], p, sum);
    store(l + r * W, sum);
  }
}

// per-thread buffers of one work unit
template <typename Mul>
struct Scratch {
  float *S, *O, *m, *l;
  typename Mul::Elem *Q, *P;

  static int64_t floats(int64_t rows, int D) {  // Q and P in float-sized slots, rounded up
    const int64_t packed = rows * (D + KEYS) * sizeof(typename Mul::Elem);
    return rows * KEYS + rows * D + rows * (1 + W) + (packed + 3) / 4;
  }
  Scratch(float* at, int64_t rows, int D)
      : S(at), O(S + rows * KEYS), m(O + rows * D), l(m + rows),
        Q(reinterpret_cast<typename Mul::Elem*>(l + rows * W)), P(Q + rows * D) {
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
  std::fill(b.m, b.m + M, -INFINITY);
  std::fill(b.l, b.l + M * W, 0.f);
  // tiles take whole 16-row blocks: the rows past M multiply zeros, and nothing reads them
  const int tile_rows = Mul::TILES ? (M + 15) / 16 * 16 : M;
  if constexpr (Mul::TILES) {
    std::fill(b.Q + M * D, b.Q + tile_rows * D, typename Mul::Elem{});
    std::fill(b.P + M * KEYS, b.P + tile_rows * KEYS, typename Mul::Elem{});
  }
  const int64_t first_visible = p.num_k - p.num_q + t0;  // the last key token t0 sees
  const int64_t seen = first_visible + tokens;           // keys the last token sees
  for (int64_t j0 = 0; j0 < seen; j0 += KEYS) {
    const int nk = static_cast<int>(std::min<int64_t>(KEYS, seen - j0));
    // scores of whole vectors of keys: register tiles SCORE_VECTORS wide, then one at a time
    const int span = (nk + W - 1) / W * W;
    const int64_t tile = (j0 / KEYS) * D * KEYS;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (Mul::TILES) {
      const int depth = (nk + TILE_DEPTH - 1) / TILE_DEPTH * TILE_DEPTH;  // keys, in whole tiles
      amx_product(b.Q, D, tile_rows, D, kt_head + tile, KEYS, depth, b.S, KEYS, false);
      softmax_tile<Mul, D>(b.S, M, group, first_visible, j0, nk, p.scale, b.O, b.m, b.l, b.P);
      for (int r = 0; r < M; ++r)  // keys past the scores' vectors: P's zeros (V's are packed)
        std::fill(b.P + r * KEYS + span, b.P + r * KEYS + depth, typename Mul::Elem{});
      amx_product(b.P, KEYS, tile_rows, depth, vt_head + tile, D, D, b.O, D, j0 > 0);
      continue;
    }
#endif
    const int wide = span / (SCORE_VECTORS * W) * (SCORE_VECTORS * W);
    product<Mul, SCORE_ROWS, SCORE_VECTORS>(b.Q, D, M, D, kt_head + tile, KEYS, wide, b.S,
                                            KEYS, false);
    product<Mul, SCORE_ROWS, 1>(b.Q, D, M, D, kt_head + tile + wide * Mul::STEP, KEYS,
                                span - wide, b.S + wide, KEYS, false);
    softmax_tile<Mul, D>(b.S, M, group, first_visible, j0, nk, Mul::STEP == 1 ? 1.f : p.scale,
                         b.O, b.m, b.l, b.P);
    // the first tile's P V is the output so far (nothing to rescale: O is not read)
    product<Mul, OUT_ROWS, D / W>(b.P, KEYS, M, nk, vt_head + tile, D, D, b.O, D, j0 > 0);
  }
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < group; ++g) {
      const int r = static_cast<int>(t * group + g);
      T* dst = p.out + (t0 + t) * p.out_stride + (h * group + g) * D;
      const float inv = 1.f / hsum(load(b.l + r * W));
      for (int dd = 0; dd < D; ++dd) narrow(b.O[r * D + dd] * inv, dst + dd);
    }
}

template <typename Mul, typename T, int D>
void attend(const Problem<T>& p, int threads) {
  const int64_t tiles = (p.num_k + KEYS - 1) / KEYS;
  const int64_t blocks = (p.num_q + QUERY_TOKENS - 1) / QUERY_TOKENS, units = p.hkv * blocks;
  const int64_t rows = QUERY_TOKENS * (p.hq / p.hkv), per_thread = Scratch<Mul>::floats(rows, D);
  // every buffer before the parallel region: an exception cannot leave one
  // left unset (pack writes every element, and a unit's buffers are written before read)
  const size_t packed_size = static_cast<size_t>(p.hkv * tiles * D * KEYS);
  const std::unique_ptr<typename Mul::Elem[]> kt(new typename Mul::Elem[packed_size]);
  const std::unique_ptr<typename Mul::Elem[]> vt(new typename Mul::Elem[packed_size]);
  const std::unique_ptr<float[]> scratch(new float[static_cast<size_t>(threads * per_thread)]);
#pragma omp parallel num_threads(threads)
  {
    pack<Mul, T, D>(p, tiles, kt.get(), vt.get());  // ends in the loop's barrier
    const Scratch<Mul> buffers(scratch.get() + omp_get_thread_num() * per_thread, rows, D);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (Mul::TILES) configure_tiles();  // each thread's own tile registers
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      // later query blocks see more keys: the costliest start first
      const int64_t h = u % p.hkv, block = blocks - 1 - u / p.hkv, head = h * tiles * D * KEYS;
      attend_unit<Mul, T, D>(p, kt.get() + head, vt.get() + head, h, block * QUERY_TOKENS,
                             buffers);
    }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if constexpr (Mul::TILES) _tile_release();
#endif
  }
}

template <typename T, int D>
void attend_on(const Problem<T>& p, int threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if constexpr (std::is_same_v<T, bf16> && amx_takes(D)) {
    if (amx_granted()) {
      attend<AmxPairs, T, D>(p, threads);
      return;
    }
  }
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16>) {
    attend<Bf16Pairs, T, D>(p, threads);
    return;
  }
#endif
  attend<Floats, T, D>(p, threads);
}

// run(std::integral_constant<int, D>) for the head sizes built (HEAD_DIMS in the .py): 0, or 1
// for any other size
template <typename Run>
int with_head_dim(int64_t head_dim, Run&& run) {
  switch (head_dim) {
    case 16: run(std::integral_constant<int, 16>{}); return 0;
    case 32: run(std::integral_constant<int, 32>{}); return 0;
    case 64: run(std::integral_constant<int, 64>{}); return 0;
    case 96: run(std::integral_constant<int, 96>{}); return 0;
    case 128: run(std::integral_constant<int, 128>{}); return 0;
    case 256: run(std::integral_constant<int, 256>{}); return 0;
    default: return 1;
  }
}

template <typename T>
int attend_any(const Problem<T>& p, int64_t head_dim, int threads) {
  return with_head_dim(head_dim, [&](auto d) { attend_on<T, decltype(d)::value>(p, threads); });
}

// ---- A decode step: each row's one query over its context in the paged cache ----
//
// The cache of one layer holds K (and, apart, V) as [blocks][block_size][hkv][d]; a row's
// context is the first `len` tokens of its blocks, in its block table's order. The step's new
// K/V go into their slots first (the query sees its own token). Work units are a row's keys in
// spans of DECODE_KEYS, every head, so one row keeps every thread busy and each unit reads whole
// token rows (all KV heads: consecutive memory within a block); each unit leaves its span's
// max, sum and unnormalized output per query head, and a second pass merges a row's spans (as
// the online softmax would). Units are dealt to the threads in turn, so each thread knows its
// next unit and fetches that one's rows while it computes the current one (Fetcher): a long
// context's keys and values come from memory, and the passes over them would otherwise wait.
constexpr int64_t DECODE_KEYS = 128;

template <typename T>
struct DecodeProblem {
  const T *q, *k_new, *v_new;
  T *k_cache, *v_cache, *out;
  int64_t q_stride, k_new_stride, v_new_stride;  // rows; heads contiguous within a row
  int64_t block_stride, token_stride;             // the caches'; heads contiguous
  const int32_t *slots, *table, *lens;            // [rows], [rows][width], [rows]
  int64_t rows, width, block_size, num_blocks, hq, hkv;
  float scale;
};

// a row's spans, and the floats a unit leaves per query head (output, max, sum)
inline int64_t spans(int64_t len) { return (len + DECODE_KEYS - 1) / DECODE_KEYS; }
template <int D> constexpr int64_t PART = D + 2;

// whether every slot, block and length the step names lies inside the cache
template <typename T>
bool in_bounds(const DecodeProblem<T>& p) {
  const int64_t slots = p.num_blocks * p.block_size;
  for (int64_t r = 0; r < p.rows; ++r) {
    if (p.slots[r] < 0 || p.slots[r] >= slots || p.lens[r] < 1 ||
        p.lens[r] > p.width * p.block_size)
      return false;
    for (int64_t b = 0; b < (p.lens[r] + p.block_size - 1) / p.block_size; ++b)
      if (p.table[r * p.width + b] < 0 || p.table[r * p.width + b] >= p.num_blocks) return false;
  }
  return true;
}

template <typename T>
void store_new_tokens(const DecodeProblem<T>& p, int64_t head_elems) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t at = (p.slots[r] / p.block_size) * p.block_stride +
                       (p.slots[r] % p.block_size) * p.token_stride;
    std::memcpy(p.k_cache + at, p.k_new + r * p.k_new_stride, head_elems * sizeof(T));
    std::memcpy(p.v_cache + at, p.v_new + r * p.v_new_stride, head_elems * sizeof(T));
  }
}

// visit(i, token) for the keys j0 + i < j1 of `row`: each one's row of `cache`, every KV head
template <typename T, typename Visit>
inline void for_each_key(const DecodeProblem<T>& p, const T* cache, int64_t row, int64_t j0,
                         int64_t j1, Visit&& visit) {
  const int32_t* blocks = p.table + row * p.width;
  int64_t b = j0 / p.block_size, slot = j0 % p.block_size;
  for (int64_t j = j0; j < j1; ++j) {
    visit(j - j0, cache + blocks[b] * p.block_stride + slot * p.token_stride);
    if (++slot == p.block_size) slot = 0, ++b;
  }
}

// Sums of vectors' lanes, W vectors at a time: lane i of the result is the sum of v[i]'s lanes.
// A tree of shuffles and adds (2 shuffles and an add per pair of vectors, W - 1 pairs) instead of
// a horizontal sum per vector: level 1 pairs neighbouring lanes of two vectors, level 2 pairs of
// pairs, so each 4-lane block holds 4 vectors' partial sums; later levels add 4-lane blocks.
inline vf fold(vf a, vf b, int level) {
#if defined(__AVX512F__)
  if (level == 1)
    return __builtin_shufflevector(a, b, 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13,
                                   29) +
           __builtin_shufflevector(a, b, 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15,
                                   31);
  if (level == 2)
    return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28,
                                   29) +
           __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                   31);
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
#else
  if (level == 1)
    return __builtin_shufflevector(a, b, 0, 8, 1, 9, 4, 12, 5, 13) +
           __builtin_shufflevector(a, b, 2, 10, 3, 11, 6, 14, 7, 15);
  if (level == 2)
    return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
#endif
}

inline vf lane_sums(vf* v) {  // v[W], overwritten
  for (int n = W, level = 1; n > 1; n /= 2, ++level)
    for (int i = 0; i < n / 2; ++i) v[i] = fold(v[2 * i], v[2 * i + 1], level);
  return v[0];
}

// A query head's dot product with one key, before its lanes are summed: float32 vectors (a bf16
// cache's keys widened), or (AVX512-BF16, D a multiple of 32) bf16 pairs straight from the cache,
// exact products summed in float32 and scaled after the lanes are.
template <typename T, int D>
struct DecodeScores {
  vf q[D / W];  // one query head's, scaled
  void set(const T* query, float scale) {
    for (int c = 0; c < D / W; ++c) q[c] = load_widened(query + c * W) * scale;
  }
  static float after(float) { return 1.f; }  // the scale is in q
  struct Key {
    vf k[D / W];
    explicit Key(const T* key) {
      for (int c = 0; c < D / W; ++c) k[c] = load_widened(key + c * W);
    }
  };
  vf partial(const Key& key) const {
    vf acc = q[0] * key.k[0];
    for (int c = 1; c < D / W; ++c) acc += q[c] * key.k[c];
    return acc;
  }
};

#if defined(__AVX512BF16__)
template <int D>
  requires(D % 32 == 0)
struct DecodeScores<bf16, D> {
  __m512bh q[D / 32];
  void set(const bf16* query, float) {
    for (int c = 0; c < D / 32; ++c) q[c] = (__m512bh)_mm512_loadu_si512(query + c * 32);
  }
  static float after(float scale) { return scale; }  // applied to the sums
  struct Key {
    __m512bh k[D / 32];
    explicit Key(const bf16* key) {
      for (int c = 0; c < D / 32; ++c) k[c] = (__m512bh)_mm512_loadu_si512(key + c * 32);
    }
  };
  vf partial(const Key& key) const {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], key.k[0]);
    for (int c = 1; c < D / 32; ++c) acc = _mm512_dpbf16_ps(acc, q[c], key.k[c]);
    return (vf)acc;
  }
};
#endif

// query heads per pass over a KV head's keys or values (their sums held in registers)
constexpr int64_t DECODE_HEADS = 4;

// visit(h, qh0, heads, first) for each KV head h and each set of its query heads (at most
// DECODE_HEADS, from qh0; `first`: the KV head's first set): a span's passes over its keys or
// values, one per set, whose first reads each key's row from memory
template <typename T, typename Visit>
inline void for_head_sets(const DecodeProblem<T>& p, Visit&& visit) {
  const int64_t group = p.hq / p.hkv;
  for (int64_t h = 0; h < p.hkv; ++h)
    for (int64_t g0 = 0; g0 < group; g0 += DECODE_HEADS)
      visit(h, h * group + g0, std::min(DECODE_HEADS, group - g0), g0 == 0);
}

// A work unit's keys: each one's row of the K cache (every KV head; its V row lies at the same
// offset in the V cache).
template <typename T>
struct SpanKeys {
  const T* rows[DECODE_KEYS];
  int64_t n = 0;
};

// The K and V rows of the thread's next unit, fetched into the caches a few lines at each step
// of the current unit's passes (a key's dot products, or its values, for one KV head): memory
// then works while the current unit computes, instead of each pass waiting on its own reads.
template <typename T>
class Fetcher {
 public:
  Fetcher(const DecodeProblem<T>& p, const SpanKeys<T>& next, int64_t head_elems, int64_t steps)
      : next_(next), to_v_(p.v_cache - p.k_cache), row_bytes_(head_elems * int64_t(sizeof(T))) {
    const int64_t lines = next.n * ((row_bytes_ + 63) / 64);  // each a K line and a V line
    per_step_ = steps > 0 ? (lines + steps - 1) / steps : 0;
  }
  void step() {
    for (int64_t i = 0; i < per_step_ && key_ < next_.n; ++i) {
      const char* k = reinterpret_cast<const char*>(next_.rows[key_]) + at_;
      __builtin_prefetch(k);
      __builtin_prefetch(k + to_v_ * int64_t(sizeof(T)));
      if ((at_ += 64) >= row_bytes_) at_ = 0, ++key_;
    }
  }

 private:
  const SpanKeys<T>& next_;
  const int64_t to_v_, row_bytes_;  // V's offset from K (elements); a token's row (bytes)
  int64_t per_step_ = 0, key_ = 0, at_ = 0;
};

// scores [hq][DECODE_KEYS] of the span's keys, in powers of 2 (vexp2): W keys at a time, each
// query head's dot products lane-summed by a tree
template <typename T, int D>
void span_scores(const DecodeProblem<T>& p, int64_t row, const SpanKeys<T>& keys,
                 Fetcher<T>& fetcher, float* scores) {
  using Scores = DecodeScores<T, D>;
  const int64_t n = keys.n;
  const float scale = p.scale * LOG2E;
  vf sums[DECODE_HEADS][W];
  for_head_sets(p, [&](int64_t h, int64_t qh0, int64_t heads, bool first) {
    Scores queries[DECODE_HEADS];
    for (int64_t g = 0; g < heads; ++g)
      queries[g].set(p.q + row * p.q_stride + (qh0 + g) * D, scale);
    for (int64_t i0 = 0; i0 < n; i0 += W) {
      for (int i = 0; i < W; ++i) {
        if (i0 + i >= n) {  // past the span: zeros, masked by the softmax
          for (int64_t g = 0; g < heads; ++g) sums[g][i] = splat(0.f);
          continue;
        }
        if (first) fetcher.step();
        const typename Scores::Key key(keys.rows[i0 + i] + h * D);
        for (int64_t g = 0; g < heads; ++g) sums[g][i] = queries[g].partial(key);
      }
      for (int64_t g = 0; g < heads; ++g)
        store(scores + (qh0 + g) * DECODE_KEYS + i0, lane_sums(sums[g]) * Scores::after(scale));
    }
  });
}

// each query head's sum of its probabilities times V [hq][D] into `part` (stride PART): a KV
// head's value rows widened once for the query heads that share them
template <typename T, int D>
void widened_values(const DecodeProblem<T>& p, const SpanKeys<T>& keys, Fetcher<T>& fetcher,
                    const float* weights, float* part) {
  for_head_sets(p, [&](int64_t h, int64_t qh0, int64_t heads, bool first) {
    vf acc[DECODE_HEADS][D / W];
    for (int64_t g = 0; g < heads; ++g)
      for (int c = 0; c < D / W; ++c) acc[g][c] = splat(0.f);
    for (int64_t i = 0; i < keys.n; ++i) {
      if (first) fetcher.step();
      const T* value = p.v_cache + (keys.rows[i] - p.k_cache) + h * D;
      vf v[D / W];
      for (int c = 0; c < D / W; ++c) v[c] = load_widened(value + c * W);
      for (int64_t g = 0; g < heads; ++g) {
        const vf weight = splat(weights[(qh0 + g) * DECODE_KEYS + i]);
        for (int c = 0; c < D / W; ++c) acc[g][c] += weight * v[c];
      }
    }
    for (int64_t g = 0; g < heads; ++g)
      for (int c = 0; c < D / W; ++c) store(part + (qh0 + g) * PART<D> + c * W, acc[g][c]);
  });
}

#if defined(__AVX512BF16__)
// The same for a bf16 cache with AVX512-BF16 (D a multiple of 32): two keys' value rows
// interleaved into bf16 pairs, against the two keys' probabilities rounded to bf16 (as the
// prompt's P V rounds them), one pair product per two keys and 16 lanes of D, instead of
// widening every value and one product per key. The interleave (unpacklo/hi within 128-bit
// lanes) leaves each accumulator's lanes in D order by blocks of 4: put back when stored.
template <int D>
  requires(D % 32 == 0)
void paired_values(const DecodeProblem<bf16>& p, const SpanKeys<bf16>& keys,
                   Fetcher<bf16>& fetcher, const float* weights, float* part) {
  // each 32 of D from its two accumulators: the first 16 (front), the next 16 (back)
  const __m512i front = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i back = _mm512_add_epi32(front, _mm512_set1_epi32(8));
  for_head_sets(p, [&](int64_t h, int64_t qh0, int64_t heads, bool first) {
    // the heads' probabilities as bf16; past the span's end they are 0 (the softmax's)
    alignas(64) uint16_t probs[DECODE_HEADS][DECODE_KEYS];
    for (int64_t g = 0; g < heads; ++g)
      for (int64_t j = 0; j < keys.n; j += W)
        _mm256_store_si256(reinterpret_cast<__m256i*>(&probs[g][j]),
                           (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(
                               weights + (qh0 + g) * DECODE_KEYS + j)));
    __m512 acc[DECODE_HEADS][D / 16];
    for (int64_t g = 0; g < heads; ++g)
      for (int c = 0; c < D / 16; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < keys.n; i += 2) {
      if (first) fetcher.step(), fetcher.step();
      const bf16* one = p.v_cache + (keys.rows[i] - p.k_cache) + h * D;
      const bf16* two = i + 1 < keys.n ? p.v_cache + (keys.rows[i + 1] - p.k_cache) + h * D
                                       : nullptr;  // an odd span's last key: with zeros
      __m512bh pairs[D / 16];
      for (int c = 0; c < D / 32; ++c) {
        const __m512i a = _mm512_loadu_si512(one + 32 * c);
        const __m512i b = two ? _mm512_loadu_si512(two + 32 * c) : _mm512_setzero_si512();
        pairs[2 * c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        pairs[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
      for (int64_t g = 0; g < heads; ++g) {
        uint32_t both;
        std::memcpy(&both, &probs[g][i], sizeof both);
        const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(both));
        for (int c = 0; c < D / 16; ++c)
          acc[g][c] = _mm512_dpbf16_ps(acc[g][c], pairs[c], weight);
      }
    }
    for (int64_t g = 0; g < heads; ++g)
      for (int c = 0; c < D / 32; ++c) {
        float* out = part + (qh0 + g) * PART<D> + 32 * c;
        _mm512_storeu_ps(out, _mm512_permutex2var_ps(acc[g][2 * c], front, acc[g][2 * c + 1]));
        _mm512_storeu_ps(out + 16,
                         _mm512_permutex2var_ps(acc[g][2 * c], back, acc[g][2 * c + 1]));
      }
  });
}
#endif

template <typename T, int D>
void span_values(const DecodeProblem<T>& p, const SpanKeys<T>& keys, Fetcher<T>& fetcher,
                 const float* weights, float* part) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16> && D % 32 == 0)
    return paired_values<D>(p, keys, fetcher, weights, part);
#endif
  widened_values<T, D>(p, keys, fetcher, weights, part);
}

// unit u's keys (none past the last unit, or past its row's context)
template <typename T>
void unit_keys(const DecodeProblem<T>& p, int64_t u, int64_t units, int64_t max_spans,
               SpanKeys<T>& keys) {
  const int64_t row = u / max_spans, j0 = u % max_spans * DECODE_KEYS;
  const int64_t j1 = u < units ? std::min<int64_t>(j0 + DECODE_KEYS, p.lens[row]) : j0;
  for_each_key(p, p.k_cache, row, j0, j1, [&](int64_t i, const T* key) { keys.rows[i] = key; });
  keys.n = std::max<int64_t>(j1 - j0, 0);
}

// a unit's keys for every query head, fetching `next`'s meanwhile: `scores` hq x DECODE_KEYS,
// `part` hq x PART
template <typename T, int D>
void decode_span(const DecodeProblem<T>& p, int64_t row, const SpanKeys<T>& keys,
                 const SpanKeys<T>& next, float* scores, float* part) {
  const int64_t n = keys.n;
  Fetcher<T> fetcher(p, next, p.hkv * D, 2 * n * p.hkv);
  span_scores<T, D>(p, row, keys, fetcher, scores);
  const int64_t span = (n + W - 1) / W * W;
  for (int64_t qh = 0; qh < p.hq; ++qh) {
    float* s = scores + qh * DECODE_KEYS;
    vf mx = splat(-INFINITY);
    for (int64_t j = 0; j < span; j += W)
      mx = max_kept(mx, load(s + j), first_lanes(static_cast<int>(n - j)));
    const float m = hmax(mx);
    vf sum = splat(0.f);
    for (int64_t j = 0; j < span; j += W) {
      vf e = vexp2(load(s + j) - m, first_lanes(static_cast<int>(n - j)));
      store(s + j, e);
      sum += e;
    }
    part[qh * PART<D> + D] = m;
    part[qh * PART<D> + D + 1] = hsum(sum);
  }
  span_values<T, D>(p, keys, fetcher, scores, part);
}

// query head qh of `row`: its spans' outputs, each weighted by e^(its max - the row's max)
template <typename T, int D>
void merge_spans(const DecodeProblem<T>& p, int64_t row, int64_t qh, int64_t max_spans,
                 const float* parts) {
  const float* first = parts + (row * max_spans * p.hq + qh) * PART<D>;
  const int64_t n = spans(p.lens[row]), stride = p.hq * PART<D>;
  float m = -INFINITY, l = 0.f;
  for (int64_t c = 0; c < n; ++c) m = std::max(m, first[c * stride + D]);
  vf acc[D / W];
  for (int c = 0; c < D / W; ++c) acc[c] = splat(0.f);
  for (int64_t c = 0; c < n; ++c) {
    const float* part = first + c * stride;
    const float weight = std::exp2(part[D] - m);
    l += weight * part[D + 1];
    for (int k = 0; k < D / W; ++k) acc[k] += load(part + k * W) * weight;
  }
  T* dst = p.out + (row * p.hq + qh) * D;
  for (int k = 0; k < D / W; ++k)
    for (int w = 0; w < W; ++w) narrow(acc[k][w] / l, dst + k * W + w);
}

template <typename T, int D>
void paged_decode(const DecodeProblem<T>& p, int threads) {
  int64_t max_spans = 0;
  for (int64_t r = 0; r < p.rows; ++r) max_spans = std::max(max_spans, spans(p.lens[r]));
  const int64_t units = p.rows * max_spans, per_thread = p.hq * DECODE_KEYS;
  std::vector<float> parts(static_cast<size_t>(units * p.hq * PART<D>));
  std::vector<float> scratch(static_cast<size_t>(threads * per_thread));
  store_new_tokens(p, p.hkv * D);
#pragma omp parallel num_threads(threads)
  {
    float* scores = scratch.data() + omp_get_thread_num() * per_thread;
    SpanKeys<T> keys[2];  // this unit's and the next one's, in turn
    const int64_t team = omp_get_num_threads();
    bool first = true;
#pragma omp for schedule(static, 1)
    for (int64_t u = 0; u < units; ++u) {  // this thread's units: u, u + team, ...
      SpanKeys<T>& now = keys[u / team % 2];
      SpanKeys<T>& next = keys[(u / team + 1) % 2];
      if (first) unit_keys(p, u, units, max_spans, now), first = false;  // else the last next
      unit_keys(p, u + team, units, max_spans, next);
      if (now.n > 0)
        decode_span<T, D>(p, u / max_spans, now, next, scores, parts.data() + u * p.hq * PART<D>);
    }
#pragma omp for
    for (int64_t u = 0; u < p.rows * p.hq; ++u)
      merge_spans<T, D>(p, u / p.hq, u % p.hq, max_spans, parts.data());
  }
}

template <typename T>
int paged_decode_any(const DecodeProblem<T>& p, int64_t head_dim, int threads) {
  if (!in_bounds(p)) return 3;
  return with_head_dim(head_dim,
                       [&](auto d) { paged_decode<T, decltype(d)::value>(p, threads); });
}

}  // namespace

// How this build multiplies a bf16 prompt's tiles here, for heads of `head_dim`: 2 AMX tiles,
// 1 AVX512-BF16 pair dot products, 0 widened float32
extern "C" int bf16_products(int64_t head_dim) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_takes(head_dim) && amx_granted()) return 2;
#endif
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

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

// The step's new K/V [rows][hkv][d] into their slots of one layer's K and V caches, then each
// row's query [hq][d] over its context: out [rows][hq][d], contiguous. Returns 0: done; 1: a
// head size with no kernel; 2: out of memory; 3: a slot, block or length outside the cache
// (nothing written).
extern "C" int fused_paged_decode(
    const void* q, int64_t q_stride, const void* k_new, int64_t k_new_stride, const void* v_new,
    int64_t v_new_stride, void* k_cache, void* v_cache, int64_t block_stride,
    int64_t token_stride, const int32_t* slots, const int32_t* table, const int32_t* lens,
    void* out, int64_t rows, int64_t width, int64_t block_size, int64_t num_blocks, int64_t hq,
    int64_t hkv, int64_t head_dim, float scale, int bfloat16, int threads) {
  try {
    if (bfloat16) {
      const DecodeProblem<bf16> p{
          static_cast<const bf16*>(q), static_cast<const bf16*>(k_new),
          static_cast<const bf16*>(v_new), static_cast<bf16*>(k_cache),
          static_cast<bf16*>(v_cache), static_cast<bf16*>(out), q_stride, k_new_stride,
          v_new_stride, block_stride, token_stride, slots, table, lens, rows, width,
          block_size, num_blocks, hq, hkv, scale};
      return paged_decode_any(p, head_dim, threads);
    }
    const DecodeProblem<float> p{
        static_cast<const float*>(q), static_cast<const float*>(k_new),
        static_cast<const float*>(v_new), static_cast<float*>(k_cache),
        static_cast<float*>(v_cache), static_cast<float*>(out), q_stride, k_new_stride,
        v_new_stride, block_stride, token_stride, slots, table, lens, rows, width, block_size,
        num_blocks, hq, hkv, scale};
    return paged_decode_any(p, head_dim, threads);
  } catch (const std::bad_alloc&) {
    return 2;
  }
}

namespace {

// t with each row's heads side by side (rows may be strided, as the QKV output's views are)
at::Tensor heads_contiguous(const at::Tensor& t) {
  return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

at::Tensor int32_contiguous(const at::Tensor& t) {
  return t.scalar_type() == at::kInt && t.is_contiguous() ? t : t.to(at::kInt).contiguous();
}

// prefill::fused_paged_decode's CPU kernel: engine/rank/fused_attention.py's paged_decode,
// whose checks it makes the same way.
at::Tensor paged_decode_op(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           const at::Tensor& cache, int64_t layer, const at::Tensor& slot_mapping,
                           const at::Tensor& block_table, const at::Tensor& context_lens,
                           double scale) {
  const auto dtype = q_in.scalar_type();
  TORCH_CHECK_TYPE(k_in.scalar_type() == dtype && v_in.scalar_type() == dtype &&
                       cache.scalar_type() == dtype && cache.is_contiguous() &&
                       (dtype == at::kFloat || dtype == at::kBFloat16),
                   "fused paged decode: q, k, v and a contiguous CPU cache of one dtype, float32 "
                   "or bfloat16, got ", q_in.scalar_type(), "/", k_in.scalar_type(), "/",
                   v_in.scalar_type(), " and ", cache.scalar_type());
  const at::Tensor q = heads_contiguous(q_in), k = heads_contiguous(k_in),
                   v = heads_contiguous(v_in);
  const at::Tensor slots = int32_contiguous(slot_mapping), table = int32_contiguous(block_table),
                   lens = int32_contiguous(context_lens);
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  const int64_t num_blocks = cache.size(2), block_size = cache.size(3), hkv = cache.size(4),
                head_dim = cache.size(5), token = hkv * head_dim;
  char* layer_k = static_cast<char*>(cache.data_ptr()) +
                  layer * cache.stride(1) * cache.element_size();
  char* layer_v = layer_k + cache.stride(0) * cache.element_size();
  const int status = fused_paged_decode(
      q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), layer_k,
      layer_v, block_size * token, token, slots.const_data_ptr<int32_t>(),
      table.const_data_ptr<int32_t>(), lens.const_data_ptr<int32_t>(), out.data_ptr(),
      q.size(0), table.size(1), block_size, num_blocks, q.size(1), hkv, head_dim,
      static_cast<float>(scale), dtype == at::kBFloat16, at::get_num_threads());
  TORCH_CHECK(status != 1, "paged decode attention: the fused attention has no kernel for head "
              "size ", head_dim);
  TORCH_CHECK(status != 2, "paged decode attention: no memory for the fused attention's buffers");
  TORCH_CHECK_INDEX(status != 3, "paged decode attention of ", q.size(0), " rows: a slot, block "
                    "id or context length lies outside the KV cache (nothing was written)");
  return out;
}

}  // namespace

// The op's CPU kernel (engine/rank/fused_attention.py calls this after loading the library; a
// build loaded only to be looked at registers nothing). 0: done; 1: registering threw.
extern "C" int register_ops() {
  return register_cpu_kernels([](torch::Library& library) {
    library.impl("fused_paged_decode", TORCH_FN(paged_decode_op));
  });
}
