"""The unfused attention's batched GEMMs at the head dims of BigScience's BLOOM sweeps, measured against the cost
model (GPU only).

    python benchmarks/attention_head_dim.py [--profile dgx-a100] [--dtype fp16] [--reps 20] [--json out.json]

BigScience's earlier sweeps (benchmarks/bloom_prequel.py) ran 128 heads of a 13824-wide model, head dim 108, 1.5x
slower than predicted, where 64 and 96 heads of the same model (216, 144) ran as predicted: 108 is not a multiple of
8, the operand alignment NVIDIA's GEMM guide asks of fp16 tensor-core kernels. Megatron-DeepSpeed's unfused
attention computes scores = Q K^T (baddbmm) and out = P V (bmm) per micro-batch, one GEMM per head: the cost model
prices both with its tile model (``ComputeModel.gemm_fwd_bwd``, cost_models/layer.py), which has no alignment
term. This times both forward GEMMs at each sweep shape (tp=8, micro-batch 4, sequence 2048) and prints measured
TFLOP/s beside the model's on the given profile, so an alignment effect, if there is one, shows as the ratio
falling at the unaligned head dims. It measures; it changes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from wgrad_accumulation import _time, has_cuda  # noqa: E402

from cost_models.compute import ComputeModel  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402

SEQ, TP, MBS = 2048, 8, 4
SHAPES = [(13824, 64), (13824, 96), (13824, 128), (14336, 16), (14336, 32), (14336, 64), (14336, 112),
          (14336, 128), (14336, 256), (12288, 64), (12288, 96), (12288, 128), (13312, 64),
          (13312, 128)]  # the (hidden, heads) of the sweeps' tp=8 runs


def cases() -> list[dict]:
    """Each sweep shape's two forward GEMMs: batch (micro-batch x heads per rank), M, N, K."""
    out = []
    for hidden, heads in SHAPES:
        hd, bh = hidden // heads, MBS * heads // TP
        out.append({"hidden": hidden, "heads": heads, "head_dim": hd, "gemm": "QK^T", "batch": bh,
                    "m": SEQ, "n": SEQ, "k": hd})
        out.append({"hidden": hidden, "heads": heads, "head_dim": hd, "gemm": "PV", "batch": bh,
                    "m": SEQ, "n": hd, "k": SEQ})
    return out


def measure(c: dict, dtype: str, reps: int) -> float:
    """Median ms of ``batch`` GEMMs [m, k] @ [k, n] as Megatron's unfused attention lays them out."""
    import torch

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    b, m, n, k = c["batch"], c["m"], c["n"], c["k"]
    if c["gemm"] == "QK^T":  # [b, s, hd] @ [b, hd, s], K transposed as a view of [b, s, hd]
        a = torch.randn(b, m, k, device="cuda", dtype=dt)
        w = torch.randn(b, n, k, device="cuda", dtype=dt).transpose(1, 2)
        out = torch.empty(b, m, n, device="cuda", dtype=dt)
        return _time(lambda: torch.baddbmm(out, a, w, beta=0.0, alpha=1.0, out=out), reps)
    a = torch.randn(b, m, k, device="cuda", dtype=dt)
    w = torch.randn(b, k, n, device="cuda", dtype=dt)
    out = torch.empty(b, m, n, device="cuda", dtype=dt)
    return _time(lambda: torch.bmm(a, w, out=out), reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="dgx-a100", help="cluster profile whose GEMM model is compared (default "
                    "dgx-a100, the sweeps' GPU; an `autopar profile` YAML of this GPU compares like with like)")
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16", help="the sweeps ran fp16 (default)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per GEMM (median reported)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    if not has_cuda("attention_head_dim.py"):
        return 2
    cluster = load_cluster(args.profile)
    cm = ComputeModel(cluster.gpu, cluster.precision)
    rows = []
    print(f"{'hidden':>6} {'heads':>5} {'hd':>4} {'gemm':>5} {'batch':>5} {'measured TF/s':>13} {'model TF/s':>10} "
          f"{'meas/model':>10}")
    for c in cases():
        flops = 2.0 * c["batch"] * c["m"] * c["n"] * c["k"]
        ms = measure(c, args.dtype, args.reps)
        model_s = float(cm.gemm(c["m"], c["n"], c["k"], c["batch"]))
        row = {**c, "measured_ms": ms, "measured_tflops": flops / ms / 1e9, "model_tflops": flops / model_s / 1e12}
        row["ratio"] = row["measured_tflops"] / row["model_tflops"]
        rows.append(row)
        print(f"{c['hidden']:6d} {c['heads']:5d} {c['head_dim']:4d} {c['gemm']:>5} {c['batch']:5d} "
              f"{row['measured_tflops']:13.1f} {row['model_tflops']:10.1f} {row['ratio']:10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
