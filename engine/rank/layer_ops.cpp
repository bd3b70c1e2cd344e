// The small ops of a decoder layer on a CPU, each one pass over its rows: RMSNorm with the
// residual add before it, RoPE, and the MLP's SiLU(gate) · up. They are the CPU kernels of the
// ops prefill::add_rmsnorm, prefill::rope and prefill::silu_mul (engine/rank/layer_ops.py),
// registered when the library loads, so compiled graphs call them with no Python in between.
//
// Why not leave them to inductor: its RoPE in the prompt graph gathers the cos/sin rows on one
// thread and writes float32 copies of q's and k's halves before it rotates them.
//
// Each op computes what engine/rank/ops.py's torch code computes, rounding where it rounds
// (bf16 results of each torch op are rounded to bf16 before the next), in float32; only the
// order of a row's sum of squares and the exp's last bits differ.
#include <cmath>
#include <cstdint>
#include <tuple>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "cpu_vectors.h"
#include "layer_rows.h"
#include "torch_ops.h"

namespace {

// Rows per thread at least this many values: fewer (a decode step's rows) run on one thread,
// where waking the others would cost more than the work
constexpr int64_t VALUES_PER_THREAD = 16384;

int64_t grain(int64_t row_values) { return std::max<int64_t>(1, VALUES_PER_THREAD / row_values); }

template <typename T>
const T* data(const at::Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); }
template <typename T>
T* data(at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

// f<float>() or f<bf16>() for a float32 or bfloat16 dtype
template <typename F>
void by_dtype(at::ScalarType dtype, F f) {
  if (dtype == at::kBFloat16) {
    f(bf16{});
  } else {
    f(float{});
  }
}

void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* op) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kBFloat16),
                   op, ": float32 or bfloat16 tensors, all of one dtype, got ", t.scalar_type(),
                   " beside ", dtype);
}

// the last dimension contiguous; the rest at any strides
at::Tensor last_contiguous(const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// prefill::add_rmsnorm: (RMSNorm(x + residual) * weight, x + residual)
std::tuple<at::Tensor, at::Tensor> add_rmsnorm_op(const at::Tensor& x_in,
                                                  const at::Tensor& residual_in,
                                                  const at::Tensor& weight_in, double eps) {
  const auto dtype = x_in.scalar_type();
  for (const at::Tensor* t : {&x_in, &residual_in, &weight_in}) {
    check_dtype(*t, dtype, "add_rmsnorm");
  }
  TORCH_CHECK(x_in.dim() == 2 && residual_in.sizes() == x_in.sizes() && weight_in.dim() == 1 &&
                  weight_in.size(0) == x_in.size(1),
              "add_rmsnorm: x and residual [rows, d] and a weight [d], got ", x_in.sizes(), ", ",
              residual_in.sizes(), " and ", weight_in.sizes());
  const at::Tensor x = last_contiguous(x_in), residual = last_contiguous(residual_in),
                   weight = weight_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options()), sum = at::empty(x.sizes(), x.options());
  const int64_t d = x.size(1);
  by_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, x.size(0), grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_rmsnorm_row(data<T>(x) + r * x.stride(0), data<T>(residual) + r * residual.stride(0),
                        data<T>(weight), data<T>(out) + r * d, data<T>(sum) + r * d, d,
                        static_cast<float>(eps));
      }
    });
  });
  return {out, sum};
}

// a [rows, heads, d] tensor's heads rotated at each row's position into a contiguous copy
template <typename T>
at::Tensor rotated(const at::Tensor& x_in, const int64_t* positions, const float* cos,
                   const float* sin) {
  const at::Tensor x = last_contiguous(x_in);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t heads = x.size(1), half = x.size(2) / 2;
  at::parallel_for(0, x.size(0), grain(heads * 2 * half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *c = cos + positions[r] * half, *s = sin + positions[r] * half;
      for (int64_t h = 0; h < heads; ++h) {
        rotate_head(data<T>(x) + r * x.stride(0) + h * x.stride(1), c, s,
                    data<T>(out) + (r * heads + h) * 2 * half, half);
      }
    }
  });
  return out;
}

// prefill::rope: q [rows, hq, d] and k [rows, hkv, d] rotated by their rows' positions; cos and
// sin [max_positions, d/2] float32 tables
std::tuple<at::Tensor, at::Tensor> rope_op(const at::Tensor& positions_in, const at::Tensor& q,
                                           const at::Tensor& k, const at::Tensor& cos_in,
                                           const at::Tensor& sin_in) {
  const auto dtype = q.scalar_type();
  check_dtype(k, dtype, "rope");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.size(2) % 2 == 0 && positions_in.dim() == 1 &&
                  positions_in.size(0) == q.size(0),
              "rope: q [rows, hq, d], k [rows, hkv, d] (d even) and positions [rows], got ",
              q.sizes(), ", ", k.sizes(), " and ", positions_in.sizes());
  TORCH_CHECK(cos_in.scalar_type() == at::kFloat && sin_in.scalar_type() == at::kFloat &&
                  cos_in.dim() == 2 && cos_in.sizes() == sin_in.sizes() &&
                  cos_in.size(1) == q.size(2) / 2,
              "rope: float32 cos and sin tables [max_positions, d/2], got ", cos_in.sizes(), " ",
              cos_in.scalar_type(), " and ", sin_in.sizes(), " ", sin_in.scalar_type());
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  const at::Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t* rows_at = positions.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < positions.size(0); ++r) {
    TORCH_CHECK_INDEX(rows_at[r] >= 0 && rows_at[r] < cos.size(0), "rope: position ", rows_at[r],
                      " lies outside the tables' ", cos.size(0), " positions");
  }
  at::Tensor q_out, k_out;
  by_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    const float *c = cos.const_data_ptr<float>(), *s = sin.const_data_ptr<float>();
    q_out = rotated<T>(q, rows_at, c, s);
    k_out = rotated<T>(k, rows_at, c, s);
  });
  return {q_out, k_out};
}

// prefill::silu_mul: SiLU(gate) * up of a [rows, 2 n] gate/up product's halves
at::Tensor silu_mul_op(const at::Tensor& gate_up_in) {
  const auto dtype = gate_up_in.scalar_type();
  check_dtype(gate_up_in, dtype, "silu_mul");
  TORCH_CHECK(gate_up_in.dim() == 2 && gate_up_in.size(1) % 2 == 0,
              "silu_mul: a gate/up product [rows, 2 n], got ", gate_up_in.sizes());
  const at::Tensor gate_up = last_contiguous(gate_up_in);
  const int64_t n = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), n}, gate_up.options());
  by_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    at::parallel_for(0, gate_up.size(0), grain(2 * n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = data<T>(gate_up) + r * gate_up.stride(0);
        silu_mul_row(row, row + n, data<T>(out) + r * n, n);
      }
    });
  });
  return out;
}

}  // namespace

// The ops' CPU kernels (engine/rank/layer_ops.py calls this after loading the library).
// 0: done; 1: registering threw.
extern "C" int register_ops() {
  return register_cpu_kernels([](torch::Library& library) {
    library.impl("add_rmsnorm", TORCH_FN(add_rmsnorm_op));
    library.impl("rope", TORCH_FN(rope_op));
    library.impl("silu_mul", TORCH_FN(silu_mul_op));
  });
}
