"""y = x Wᵀ (+ b) for every projection of the model, routed to the fastest matmul library the
device has.

On a CPU, `F.linear` goes to MKL, and MKL takes a slow code path on AMD processors: measured on
an AVX512-BF16 EPYC (2 threads, float32, `python -m bench.cpu_ops`), oneDNN's
inner product ran 1.9-2.2x faster for prompt-sized inputs (128-2048 rows) and 1.6x faster for
decode's single rows. oneDNN is the library torch already ships for its CPU convolutions and
for compiled linears (inductor emits the same op after freezing); results agree with MKL's to
float32 rounding. float16 on a CPU has no oneDNN kernel, and CUDA has cuBLAS: both keep
`F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.rank import ops
from engine.rank.quantized import KERNEL_ROWS, QuantizedWeight
from parallel import graph_op

# read once: torch.compile cannot trace the queries, and a graph would break at every projection
HAVE_ONEDNN = torch.backends.mkldnn.is_available()
# oneDNN builds bf16 products only on a CPU with AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; on an
# AVX2-only one it fails to create them, and torch's own bf16 GEMM there is ~8x slower than
# float32 for a prompt's rows (engine.rank.kernel_choice times a float32 product instead)
HAVE_ONEDNN_BF16 = HAVE_ONEDNN and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's inner product runs products of this dtype on this CPU."""
    return (dtype == torch.float32 and HAVE_ONEDNN) or (dtype == torch.bfloat16
                                                         and HAVE_ONEDNN_BF16)


def _onednn_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # a strided weight (a column slice) sends oneDNN down a path ~200x slower than F.linear
    return (weight.device.type == "cpu" and onednn_runs(weight.dtype)
            and weight.is_contiguous() and x.dtype == weight.dtype and x.dim() == 2)


def _onednn_only(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """A weight only oneDNN reads: packed in its own layout (engine.rank.decode_weights), or
    bfloat16 against a float32 input (decode_dtype copies). A packed weight of x's dtype is
    multiplied as it is. A float32 input against bf16 weights runs in bf16 with float32
    accumulation, or, in a graph of at most MATVEC_ROWS fixed rows, as a float32
    multiply-and-sum reading the (plain) bf16 weight; its result and the bias are float32."""
    compiling = torch.compiler.is_compiling()
    if x.dtype == weight.dtype:
        return (onednn_linear if compiling else eager_onednn_linear)(x, weight, bias)
    if compiling:
        if few_fixed_rows(x) and not weight.is_mkldnn:
            return matvec(x, weight, bias)
        y = onednn_linear(x.to(weight.dtype), weight, None)
    else:
        y = eager_onednn_linear(x.to(weight.dtype), weight, None)
    y = y.to(x.dtype)
    return y if bias is None else y + bias


# A compiled graph of a decode step with at most this many rows, all known when compiling,
# writes its float32 and bfloat16 projections as a multiply-and-sum that inductor turns into
# one streaming loop over the weight: in one graph over 30 layers of SmolLM2's weights (2
# threads, AVX512 EPYC, `python -m bench.cpu_ops`) 2.4x oneDNN's inner product for 1 float32
# row and 1.4x for 2, and slower from 4 rows on (0.8x), where the rows' products stop sharing
# each weight read. bf16 weights are widened inside the loop, element by element: the same
# graph read them at 3.2x torch's bf16 matrix-vector product on the AMX Xeon (session 34).
MATVEC_ROWS = 2
# Steps of at most this many tokens (not decode graphs') run eagerly (engine.rank.compiled): a
# projection picks its product by its row count (the streaming loop up to MATVEC_ROWS, a
# quantized weight's kernel up to KERNEL_ROWS), and a layers graph whose dynamic token count
# started at or below either threshold would guard on it
EAGER_ROWS = max(MATVEC_ROWS, KERNEL_ROWS)


def few_fixed_rows(x: torch.Tensor) -> bool:
    # dynamo treats a symbolic row count as an int, so this would guard a dynamic graph on it:
    # engine.rank.compiled bounds its dynamic token count below at MATVEC_ROWS + 1, which makes
    # the comparison false there without a guard
    return x.shape[0] <= MATVEC_ROWS and x.dtype in (torch.float32, torch.bfloat16)


def matvec(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ + b summed in float32 (as oneDNN's bf16 products accumulate), rounded once to x's
    dtype; for float32 operands the widenings are no-ops."""
    rows = widened_rows(x) if torch.compiler.is_compiling() and x.dtype != torch.float32 else x
    y = (rows.float().unsqueeze(1) * weight.float()).sum(-1)
    return (y if bias is None else y + bias.float()).to(x.dtype)


def widened_rows(x: torch.Tensor) -> torch.Tensor:
    """x widened to float32 into a buffer of its own, inside a graph. Left to itself, inductor
    fuses whatever computed x (a layer's RMSNorm of x + residual) into the product's loop and
    computes it again for every output row, loading and widening three bf16 vectors per weight
    vector read (writing the rows once made SmolLM2's compiled bf16 decode 65-71 tok/s against
    55-61, session 45). Asking for the widened rows in a fixed layout makes inductor write them
    once, in the kernel that computes them, and the product read them. This replaced an opaque
    op (a Python kernel called 4 times a layer) that did the same and split each layer's graph
    around it: a compiled bf16 decode layer is now two C++ kernels and the attention. float32
    rows keep the fused loop (matvec): with the op, its call cost more than the recomputing
    saved (40 against 43 tok/s, session 45); the layout request, which costs no call, is
    untried there."""
    wide = x.float()
    return torch.ops.prims.inductor_force_stride_order(wide, wide.stride())


class PromptCopies:
    """Copies of weights packed by oneDNN for a prompt's rows, which products of more than
    PLAIN_WEIGHT_ROWS rows through oneDNN read instead of the weight (made where timed faster:
    engine.rank.kernel_choice). oneDNN reorders a plain weight into its blocked layout inside
    every product; a copy packed once skips that: 30 layers of SmolLM2's projections at 512
    rows ran 1.24x as fast in float32 and 1.04x in bf16 on the AVX512-BF16 EPYC (2 threads;
    `.venv/bin/python -m bench.cpu_ops`, BENCHMARKS.md session 43). A copy costs the weight's
    bytes again.

    Found by the weight they copy, since a compiled graph hands its ops the weight tensors (an
    opaque oneDNN tensor cannot be a kept graph's input: its guards are not serializable). An
    entry holds the weight itself, so no other tensor can take its address while the entry
    lives, and the weight's version: a weight written in place no longer finds its copy."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def add(self, weights: list[torch.Tensor], rows: int, halves: bool = False) -> int:
        """Pack each weight for products of about `rows` rows; the copies' bytes. `halves`:
        pack its first and second halves of rows apart (a gate/up weight: gated_halves)."""
        nbytes = 0
        for weight in weights:
            if weight.is_inference():  # no version to tell a weight written since
                continue
            plain = weight.detach()
            packed = pack_halves(plain, rows) if halves else pack_for_rows(plain, rows)
            self._entries[weight.data_ptr()] = (weight, weight._version, packed)
            nbytes += weight.nbytes
        return nbytes

    def remove(self, addresses: list[int]) -> None:
        for address in addresses:
            self._entries.pop(address, None)

    def find(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight's packed copy, or the weight where it has none (or was written since)."""
        packed = self._packed(weight)
        return packed if isinstance(packed, torch.Tensor) else weight

    def find_halves(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The packed copies of the weight's two halves (add(..., halves=True)), or None."""
        packed = self._packed(weight)
        return packed if isinstance(packed, tuple) else None

    def _packed(self, weight: torch.Tensor) -> torch.Tensor | tuple | None:
        entry = self._entries.get(weight.data_ptr())
        if entry is None:
            return None
        plain, version, packed = entry
        same = (plain.shape == weight.shape and plain.dtype == weight.dtype
                and plain.stride() == weight.stride() and version == weight._version)
        return packed if same else None


PROMPT_COPIES = PromptCopies()
PLAIN_WEIGHT_ROWS = 16  # products of at most this many rows (decode steps) read the plain weight


def eager_onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """oneDNN's inner product called directly (the custom-op wrapper costs ~10 us, 120 times a
    decode step), reading the weight's prompt copy for more than PLAIN_WEIGHT_ROWS rows where
    it has one. x: 2-D; weight: contiguous (or packed), x's dtype, float32 or bfloat16."""
    if x.shape[0] > PLAIN_WEIGHT_ROWS and not weight.is_mkldnn:
        weight = PROMPT_COPIES.find(weight)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


# The oneDNN inner product as an opaque op, for graphs being compiled: inductor lowers the raw
# oneDNN op only for weights it froze itself, and our weights are inputs.
onednn_linear = graph_op.define(
    "onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", eager_onednn_linear,
    lambda x, weight, bias: x.new_empty(x.shape[0], weight.shape[0]))


def gated_halves(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(x Gᵀ) · (x Uᵀ) from packed gate and up weights, the SiLU and the product applied
    by oneDNN as each tile of the result is written: no [T, 2·ffn] tensor is written and read
    again. Over 30 layers' SmolLM2 gate/up weights (2 threads of the AVX512-BF16 EPYC,
    `.venv/bin/python -m bench.cpu_ops --only-gated`, BENCHMARKS.md session 47) it ran 1.03x
    the product-then-pass in float32 and 1.08x in bf16 at 2048 rows, and tied at 512;
    engine.rank.kernel_choice times the two at start-up."""
    silu_gate = torch.ops.mkldnn._linear_pointwise(x, gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, silu_gate, up, None, "mul")


def eager_gated_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SiLU·mul of x times a gate/up weight [gate; up] of x's dtype, through oneDNN: the fused
    halves where the weight has packed ones (PromptCopies.add(..., halves=True)) and the rows
    are a prompt's, else the product, then the SiLU·mul."""
    halves = PROMPT_COPIES.find_halves(weight) if x.shape[0] > PLAIN_WEIGHT_ROWS else None
    if halves is None:
        return ops.silu_mul(eager_onednn_linear(x, weight))
    return gated_halves(x, *halves)


# As an opaque op for compiled graphs, as onednn_linear: the halves are found at run time.
gated_product = graph_op.define(
    "onednn_gated_product(Tensor x, Tensor weight) -> Tensor", eager_gated_product,
    lambda x, weight: x.new_empty(x.shape[0], weight.shape[0] // 2))


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):  # weights="int8" | "int4" | "gguf"
        if x.numel() // x.shape[-1] <= KERNEL_ROWS:
            return weight.matmul(x, bias)
        return linear(x, weight.dequantized(), bias)  # a prompt's rows: quantized.KERNEL_ROWS
    if weight.is_mkldnn or (weight.dtype == torch.bfloat16 and x.dtype == torch.float32
                            and weight.device.type == "cpu" and HAVE_ONEDNN_BF16):
        return _onednn_only(x, weight, bias)
    compiling = torch.compiler.is_compiling()
    if (compiling and weight.device.type == "cpu" and x.dtype == weight.dtype
            and few_fixed_rows(x)):
        return matvec(x, weight, bias)
    if not _onednn_usable(x, weight):
        return F.linear(x, weight, bias)
    if compiling:
        return onednn_linear(x, weight, bias)
    return eager_onednn_linear(x, weight, bias)


def pack_halves(weight: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's first and second halves of rows (a gate/up weight's gate and up), each
    packed for products of about `rows` rows: what gated_halves multiplies."""
    gate, up = (pack_for_rows(half.contiguous(), rows) for half in weight.chunk(2))
    return gate, up


def pack_for_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """The weight reordered into oneDNN's own layout for products of about `rows` rows: an
    opaque tensor that only oneDNN's inner product reads (`linear` sends such weights there).
    A plain weight is reordered by every product (into this layout or its like)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
