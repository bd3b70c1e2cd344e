"""Compile the kernels for a GPU that is not here: Triton's whole pipeline (TTIR, TTGIR, LLVM IR,
PTX, and a cubin from the ptxas that ships with Triton) runs on any machine, so a kernel that
only the interpreter has run can still be shown to compile, and its shared memory read off.

    python -m engine.rank.kernels.aot_check            # sm_90 (H100/H200), the GPU defaults
    python -m engine.rank.kernels.aot_check --all-configs   # every autotune config too

Must run with TRITON_INTERPRET unset (the interpreter has nothing to compile).
"""
from __future__ import annotations

import argparse
import json
import os
import time

# under the interpreter the kernels are not compilable objects
if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("aot_check: unset TRITON_INTERPRET (it compiles kernels, not interprets them)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.rank.kernels import decode_attention, flash_attention, kv_store  # noqa: E402
from engine.rank.kernels.launch_config import GPU_DEFAULTS, PREFILL_TUNE_SPACE  # noqa: E402

H100_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90


def _signature(fn, consts: dict, pointers: dict[str, str]) -> dict[str, str]:
    """Pointer arguments by the dtype given (int32 by default: the step metadata), scalars as
    i32 except the one float (the softmax scale)."""
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*i32")
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig


def _aligned(fn, pointers: dict[str, str]) -> dict:
    """What a launch tells the compiler about alignment: torch's data pointers are 16-byte
    aligned, and at head dims 64/128 every row stride of q, out and the cache is a multiple of
    16 elements (Triton specialises such integer arguments when it launches; without this the
    loads are not vectorised nor pipelined, and the compile would not be the one a GPU runs)."""
    names = [n for n in fn.arg_names if n in pointers or n.startswith("stride_")
             and n not in ("stride_table", "stride_pb", "stride_ph")]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def compile_one(fn, consts: dict, pointers: dict[str, str], num_warps: int, num_stages: int,
                capability: int = 90) -> dict:
    start = time.perf_counter()
    src = ASTSource(fn, _signature(fn, consts, pointers), constexprs=consts,
                    attrs=_aligned(fn, pointers))
    kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    return {"kernel": fn.__name__, "consts": {k: str(v) for k, v in consts.items()},
            "num_warps": num_warps, "num_stages": num_stages,
            "shared_bytes": kernel.metadata.shared, "has_cubin": "cubin" in kernel.asm,
            # loads the software pipeliner turned into async copies (prefetched stages ahead)
            "async_copies": kernel.asm["ttgir"].count("async_copy_global_to_local"),
            "compile_s": round(time.perf_counter() - start, 2)}


def _prefill(head_dim: int, dtype: str, tile: tuple[int, int, int, int]) -> dict:
    m, n, warps, stages = tile
    data = {p: f"*{dtype}" for p in ("q_ptr", "out_ptr", "k_cache_ptr", "v_cache_ptr")}
    consts = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, GROUP=4, BLOCK_M=m, BLOCK_N=n,
                  BLOCK_D=head_dim, MASK_FULL_TILES=False, FP32_DOT=False, PRECISION="tf32")
    return compile_one(flash_attention._flash_prefill_kernel, consts, data, warps, stages)


def default_set() -> list[dict]:
    """The kernels as the CUDA path launches them by default, at Llama 3's shapes."""
    g = GPU_DEFAULTS
    tile = (g.prefill_block_m, g.prefill_block_n, g.prefill_num_warps, g.prefill_num_stages)
    out = [_prefill(128, "bf16", tile), _prefill(64, "fp16", tile)]
    data = {p: "*bf16" for p in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    data.update({p: "*fp32" for p in ("part_acc_ptr", "part_m_ptr", "part_l_ptr")})
    out.append(compile_one(decode_attention._decode_split_kernel,
                           dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_G=16,
                                BLOCK_N=g.decode_block_n, BLOCK_D=128,
                                FP32_DOT=False, PRECISION="tf32"), data, 4, 2))
    out.append(compile_one(decode_attention._decode_merge_kernel,
                           dict(BLOCK_S=64, BLOCK_D=128), data, 4, 2))
    kv = {p: "*bf16" for p in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
    kv["slot_ptr"] = "*i64"
    out.append(compile_one(kv_store._kv_store_kernel, dict(BLOCK_H=8, BLOCK_D=128), kv, 4, 2))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="compile the kernels for sm_90 without a GPU")
    ap.add_argument("--all-configs", action="store_true",
                    help="also every autotune config of the prefill, head dim 128, bf16")
    ap.add_argument("--json", help="write the results here as well")
    args = ap.parse_args(argv)
    results = default_set()
    if args.all_configs:
        results += [_prefill(128, "bf16", tile) for tile in PREFILL_TUNE_SPACE[1:]]
    for r in results:
        fits = "fits" if r["shared_bytes"] <= H100_SHARED_LIMIT else "OVER the sm_90 limit"
        print(f"{r['kernel']:24s} warps {r['num_warps']} stages {r['num_stages']} "
              f"{r['consts']}: shared {r['shared_bytes']} B ({fits}), "
              f"{r['async_copies']} async copies, {r['compile_s']} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
