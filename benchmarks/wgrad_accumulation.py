"""What a fused fp32 gradient accumulation costs in the weight-gradient GEMMs of NVIDIA's H100 recipes (GPU only).

    python benchmarks/wgrad_accumulation.py [--reps 20] [--sustain 60] [--json out.json]

The cost model prices Megatron-LM's gradient_accumulation_fusion (the weight-gradient GEMM adds into the fp32
main gradient, C += A^T B with an fp32 C) as its epilogue's extra bytes at the memory bandwidth
(StateSpec.accumulate_bytes, since session 15, from this script's H200 run; it was free before). NeMo's H100 runs
(benchmarks/data/nvidia_dgxc_h100_bf16.csv) all use it (benchmarks/RESULTS.md).
This measures, for each recipe's four weight-gradient GEMMs per layer (QKV, attention output, MLP in, MLP out;
K = the tokens of one micro-batch on one GPU, shapes from `validate_h100.nemo_case`), the median time of:

- ``bf16``: the GEMM with a bf16 output (what the model prices);
- ``fused``: the same GEMM adding into an fp32 buffer (``torch.addmm(..., out_dtype=float32, out=C)``, cuBLAS
  with beta = 1: Megatron's fusion);
- ``separate``: the bf16 GEMM, then an fp32 add of its output into the buffer (autopar's runtime).

and what the fused form would add to each recipe's step (per layer, per micro-batch, per pipeline rank).
``--sustain S`` also times the 8B recipe's GEMMs in a short burst, then back to back for S seconds, and prints the
rate of each 5-second window: whether a GPU under sustained load keeps the rate a short benchmark measures (clocks,
power). (Session 15's run on an H200 laid the sustained GEMMs out differently from the burst, so its 645 TFLOP/s
sustained against 735 in bursts did not compare like with like; both now share one layout.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from validate_h100 import _rows, nemo_case, recipe  # noqa: E402

from cost_models.layer import projection_shapes  # noqa: E402


def wgrad_shapes(model, cfg) -> dict[str, tuple[int, int, int]]:
    """(out, in, tokens) of one layer's weight-gradient GEMMs on one GPU: dW[out, in] = dY[T, out]^T X[T, in]."""
    tokens = cfg.mbs * model.seq_length // cfg.cp
    return {g: (int(n), int(k), tokens) for g, (n, k) in projection_shapes(model, cfg.tp).items()}


def recipe_rows() -> list[dict[str, str]]:
    """The first row of each NeMo recipe in nvidia_dgxc_h100_bf16.csv (the 405B proxies run its shapes)."""
    first: dict[str, dict[str, str]] = {}
    for r in _rows("nvidia_dgxc_h100_bf16.csv"):
        first.setdefault(recipe(r["model"]), r)
    return list(first.values())


def has_cuda(script: str) -> bool:
    """Print the GPU and torch version, or say on stderr why ``script`` cannot run here (it times cuBLAS GEMMs)."""
    import torch

    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (it times cuBLAS GEMMs); run it on an H100", file=sys.stderr)
        return False
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    return True


def _time(fn, reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(out: int, inn: int, tokens: int, reps: int) -> dict[str, float]:
    """Median ms of the three forms of one weight-gradient GEMM."""
    import torch

    dy = torch.randn(tokens, out, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, inn, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(out, inn, device="cuda", dtype=torch.float32)
    dyt = dy.t()
    out = acc
    try:  # C += A^T B in place, as Megatron's fused accumulation does
        torch.addmm(acc, dyt, x, out_dtype=torch.float32, out=acc)
    except RuntimeError:  # no aliased output here: write a second buffer (the same bytes read and written)
        out = torch.empty_like(acc)
    return {
        "bf16": _time(lambda: torch.mm(dyt, x), reps),
        "fused": _time(lambda: torch.addmm(acc, dyt, x, out_dtype=torch.float32, out=out), reps),
        "separate": _time(lambda: acc.add_(torch.mm(dyt, x)), reps),
    }


def sustain(seconds: float, reps: int) -> tuple[float, list[float]]:
    """TFLOP/s of the 8B recipe's weight-gradient GEMMs (laid out as :func:`measure` lays them out) timed as
    :func:`measure` times them (a short burst: median of ``reps``), then of each 5-second window of them run back to
    back: whether a GPU under sustained load keeps the rate a short benchmark measures."""
    import torch

    model, _, cfg, _ = nemo_case(recipe_rows()[0])
    mats = []
    for out, inn, tokens in wgrad_shapes(model, cfg).values():
        mats.append((torch.randn(tokens, out, device="cuda", dtype=torch.bfloat16).t(),
                     torch.randn(tokens, inn, device="cuda", dtype=torch.bfloat16), 2.0 * out * inn * tokens))
    burst = sum(f for _, _, f in mats) / sum(_time(lambda a=a, b=b: torch.mm(a, b), reps) for a, b, _ in mats) / 1e9
    rates, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        flops, t0 = 0.0, time.perf_counter()
        while time.perf_counter() - t0 < 5.0:
            for a, b, f in mats:
                torch.mm(a, b)
                flops += f
            torch.cuda.synchronize()
        rates.append(flops / (time.perf_counter() - t0) / 1e12)
    return burst, rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per GEMM (median reported)")
    ap.add_argument("--sustain", type=float, default=0.0, help="seconds of back-to-back GEMMs (0: skip)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    if not has_cuda("wgrad_accumulation.py"):
        return 2
    result = {"recipes": [], "sustain_tflops": []}
    for r in recipe_rows():
        model, _, cfg, batch = nemo_case(r)
        layers = model.num_layers // cfg.pp  # per pipeline rank
        extra = 0.0
        print(f"== {model.name}: {cfg.short()}, {layers} layers per pipeline rank, "
              f"{cfg.microbatches(batch)} micro-batches, measured step {r['step_s']} s")
        for name, (out, inn, tokens) in wgrad_shapes(model, cfg).items():
            ms = measure(out, inn, tokens, args.reps)
            extra += ms["fused"] - ms["bf16"]
            tf = 2.0 * out * inn * tokens / ms["bf16"] / 1e9
            print(f"  {name:8} {out:6}x{inn:6} K={tokens:6}: bf16 {ms['bf16']:.3f} ms ({tf:.0f} TFLOP/s), fused "
                  f"{ms['fused']:.3f} ({ms['fused'] / ms['bf16'] - 1:+.1%}), separate {ms['separate']:.3f} "
                  f"({ms['separate'] / ms['bf16'] - 1:+.1%})")
            result["recipes"].append({"model": model.name, "gemm": name, "shape": [out, inn, tokens], **ms})
        step = extra * layers * cfg.microbatches(batch) / 1e3
        print(f"  fused accumulation adds {step:.2f} s a step over bf16 outputs ({step / float(r['step_s']):.1%} of "
              "the measured step)")
    if args.sustain > 0:
        result["burst_tflops"], result["sustain_tflops"] = sustain(args.sustain, args.reps)
        print(f"the 8B recipe's GEMMs: {result['burst_tflops']:.0f} TFLOP/s in a short burst; sustained, per 5 s "
              "window: " + ", ".join(f"{x:.0f}" for x in result["sustain_tflops"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
