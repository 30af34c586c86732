"""Ahead-of-time compile every kernel variant for an H100 (sm_90) without a GPU.

The interpreter checks numerics but not Triton's compiler (types of loop-carried values, constexpr use,
layouts). Triton can lower to PTX/cubin with no device, so a subprocess (triton imported *without*
TRITON_INTERPRET) compiles each kernel with the reference shape's block sizes. Run this file directly to
also print registers and spills per kernel (``python tests/runtime/kernels/test_kernel_compile.py``).
"""

import os
import subprocess
import sys

import pytest
from kernel_testutils import needs_triton

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# (label, module, kernel attribute, pointer dtypes by argument, constexprs, num_warps); other args are i32
_BF, _F32, _I64 = "*bf16", "*fp32", "*i64"
SPECS = [
    *[(f"rms_fwd res={r}", "rms_norm_op", "rms_fwd_kernel",
       {"X": _BF, "R": _BF, "S": _BF, "Y": _BF, "W": _F32, "RSTD": _F32, "eps": "fp32"},
       {"HAS_RES": r, "BLOCK_M": 2, "BLOCK_N": 2048}, 8) for r in (False, True)],
    *[(f"rms_bwd dres={r}", "rms_norm_op", "rms_bwd_kernel",
       {"DY": _BF, "X": _BF, "W": _F32, "RSTD": _F32, "DRES": _BF, "DX": _BF, "DW": _F32},
       {"HAS_DRES": r, "BLOCK_M": 2, "BLOCK_N": 2048}, 8) for r in (False, True)],
    ("rms_fwd wide fp32", "rms_norm_op", "rms_fwd_kernel",
     {"X": _F32, "R": _F32, "S": _F32, "Y": _F32, "W": _F32, "RSTD": _F32, "eps": "fp32"},
     {"HAS_RES": False, "BLOCK_M": 1, "BLOCK_N": 16384}, 16),
    *[(f"ln_fwd bias={b}", "layer_norm_op", "ln_fwd_kernel",
       {"X": _BF, "Y": _BF, "W": _F32, "B": _F32, "MEAN": _F32, "RSTD": _F32, "eps": "fp32"},
       {"HAS_BIAS": b, "BLOCK_M": 2, "BLOCK_N": 2048}, 8) for b in (False, True)],
    *[(f"ln_bwd bias={b}", "layer_norm_op", "ln_bwd_kernel",
       {"DY": _BF, "X": _BF, "W": _F32, "MEAN": _F32, "RSTD": _F32, "DX": _BF, "DW": _F32, "DB": _F32},
       {"HAS_BIAS": b, "BLOCK_M": 2, "BLOCK_N": 2048}, 8) for b in (False, True)],
    ("swiglu_fwd", "swiglu_op", "swiglu_fwd_kernel", {"G": _BF, "U": _BF, "Y": _BF}, {"BLOCK": 2048}, 8),
    ("swiglu_bwd", "swiglu_op", "swiglu_bwd_kernel",
     {"DY": _BF, "G": _BF, "U": _BF, "DG": _BF, "DU": _BF}, {"BLOCK": 2048}, 8),
    *[(f"rope backward={b}", "rope_op", "rope_kernel",
       {"Q": _BF, "K": _BF, "QO": _BF, "KO": _BF, "COS": _F32, "SIN": _F32},
       {"BACKWARD": b, "BLOCK_HQ": 16, "BLOCK_HK": 16, "BLOCK_D": 64}, 4) for b in (False, True)],
    *[(f"ce_fused one_block={o} grad={g}", "cross_entropy_op", "ce_fused_kernel",
       {"LOGITS": _BF, "TARGET": _I64, "LOSS": _F32, "SCALE": _F32},
       {"COMPUTE_GRAD": g, "ONE_BLOCK": o, "BLOCK_V": 32768}, 32)
      for o in (True, False) for g in (True, False)],
    *[(f"grad_scale in_place={i}", "cross_entropy_op", "grad_scale_kernel", {"X": _BF, "Y": _F32, "G": _F32},
       {"IN_PLACE": i, "BLOCK": 4096}, 8) for i in (True, False)],
    *[(f"ce_stats one_block={o}", "cross_entropy_op", "ce_stats_kernel",
       {"LOGITS": _BF, "TARGET": _I64, "STATS": _F32}, {"ONE_BLOCK": o, "BLOCK_V": 16384}, 16)
      for o in (True, False)],
    ("ce_grad", "cross_entropy_op", "ce_grad_kernel",
     {"LOGITS": _BF, "TARGET": _I64, "LSE": _F32, "SCALE": _F32}, {"BLOCK_V": 16384}, 16),
]


def main(verbose: bool = True) -> int:
    """Compile all SPECS for sm_90; print registers/spills when ptxas can report them. Returns #failures."""
    import importlib
    import inspect
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    failures = 0
    for label, mod_name, attr, types, constexprs, warps in SPECS:
        lazy = getattr(importlib.import_module(f"runtime.kernels.{mod_name}"), attr)
        names = list(inspect.signature(lazy.fn).parameters)
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        try:
            compiled = triton.compile(ASTSource(fn=lazy.build(), signature=sig, constexprs=constexprs),
                                      target=target, options={"num_warps": warps})
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failures += 1
            print(f"FAIL {label}: {type(e).__name__}: {e}")
            continue
        if verbose:
            info = ""
            for ptxas in ("ptxas-blackwell", "ptxas"):
                path = os.path.join(bin_dir, ptxas)
                if not os.path.exists(path):
                    continue
                with tempfile.TemporaryDirectory() as d:
                    src = os.path.join(d, "k.ptx")
                    with open(src, "w") as f:
                        f.write(compiled.asm["ptx"])
                    cmd = [path, "-v", "--gpu-name", "sm_90a", src, "-o", os.path.join(d, "k.o")]
                    r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode == 0:
                    lines = (r.stdout + r.stderr).splitlines()
                    info = "; ".join(s.split(":", 1)[-1].strip() for s in lines
                                     if "registers" in s or "spill" in s)
                    break
            print(f"ok   {label:36s} warps={warps:2d} {info}")
    return failures


@needs_triton
def test_all_kernels_compile_for_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = "import sys, test_kernel_compile as t; sys.exit(min(t.main(verbose=False), 1))"
    r = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.abspath(__file__)), env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "FAIL" not in r.stdout:
        pytest.skip(f"cannot compile for sm_90 here: {r.stderr.strip().splitlines()[-1:]}")
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, _ROOT)
    sys.exit(min(main(), 1))
