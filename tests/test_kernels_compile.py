"""The kernels compile for sm_90 (H100/H200) on this machine, with no GPU: Triton's compiler and
the ptxas it ships run anywhere. Runs engine.rank.kernels.aot_check in a subprocess, because
this test process runs the kernels under the interpreter (TRITON_INTERPRET=1), where there is
nothing to compile."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import triton



def _ptxas() -> bool:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled.exists() or shutil.which("ptxas") is not None


@pytest.mark.skipif(not _ptxas(), reason="no ptxas: Triton's NVIDIA backend is not installed")
def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = tmp_path / "aot.json"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "engine.rank.kernels.aot_check", "--json",
                           str(out)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {r["kernel"] for r in results} == {"_flash_prefill_kernel", "_decode_split_kernel",
                                              "_decode_merge_kernel", "_kv_store_kernel"}
    for r in results:
        assert r["has_cubin"], r
        assert 0 <= r["shared_bytes"] <= 232448, r  # sm_90's shared memory per block
    # the K/V tile loads of prefill and decode are software-pipelined (async copies ahead)
    assert all(r["async_copies"] > 0 for r in results
               if r["kernel"] in ("_flash_prefill_kernel", "_decode_split_kernel"))
