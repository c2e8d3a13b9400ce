"""The Triton kernels compile for an H100/H200 (sm_90) without a GPU: Triton lowers them to PTX
and, with the ptxas it ships, to a cubin, for a target given by hand (GPUTarget). Catches what
the interpreter does not: types that only the compiler checks, tl.dot shapes under 16, shared
memory beyond what an SM has.

In a child process: whether triton's own helpers (tl.zeros, ...) are interpreted is fixed when
triton is first imported, and test_triton_attention.py imports it interpreted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fairway.models import triton_attention as ta

def ints(*names):
    return {n: "i32" for n in names}

kv = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16", "block_tables_ptr": "*i32"}
strides = ints("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_ch", "stride_cs", "stride_bt")
shape = {"BLOCK_SIZE": 16, "GROUP": 4, "HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_N": ta.BLOCK_N}
kernels = {
    "store_kv": (ta._store_kv_kernel, {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16",
                 "v_cache_ptr": "*bf16", "slot_ptr": "*i64",
                 **ints("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ch", "stride_cs")},
                 {"HEAD_DIM": 64, "BLOCK_D": 64}),
    "decode": (ta._decode_kernel, {**kv, "context_lens_ptr": "*i32", "scale": "fp32", **strides},
               {**shape, "BLOCK_G": 16}),
    "prefill": (ta._prefill_kernel, {**kv, "query_start_ptr": "*i32", "seq_lens_ptr": "*i32", "scale": "fp32",
                **strides}, {**shape, "BLOCK_M": ta.BLOCK_M}),
}
out = {}
for name, (fn, signature, constexprs) in kernels.items():
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32))
    ptx = kernel.asm["ptx"]
    out[name] = {"target": [l.split()[1] for l in ptx.splitlines() if l.startswith(".target")],
                 "cubin_bytes": len(kernel.asm["cubin"]), "shared": kernel.metadata.shared}
print(json.dumps(out))
"""


def test_the_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(compiled) == {"store_kv", "decode", "prefill"}
    for name, result in compiled.items():
        assert result["target"] == ["sm_90a"], name
        assert result["cubin_bytes"] > 0, name
        assert result["shared"] <= 64 * 1024, name  # a few programs per SM (228 KB each on an H100/H200)
