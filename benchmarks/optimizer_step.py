"""Where the optimizer phase's time goes: the runtime's own AdamW step, piece by piece, beside the cost model.

    python benchmarks/optimizer_step.py [--models llama-1b gpt-1.3b gpt-350m] [--profile h100.yaml]
                                        [--device cuda|cpu] [--json out.json]

For each model (one rank, the plan's default state: bf16 weights, fp32 gradients and master copy) the runtime's
Trainer is built as `autopar run` builds it, one step is trained, and then timed (CUDA events, median):

- ``step``: ``DistributedAdamW.step`` whole (what `autopar diagnose` reports as the optimizer phase);
- ``norm``: the gradient norm and clipping; ``publish``: the master copy written back into the weights;
- ``adamw``: torch's fused AdamW over the runtime's own operands (views of the flat buckets, split where weight
  decay changes: matrices decayed, norms and biases not), ``tensors`` of them;
- ``adamw_flat``: the same number of elements as one tensor per decay group (what a layout without the split
  would cost), and ``adamw_k``: those elements cut into k equal tensors, k = 16 .. 4096 (the cost per tensor);
- ``adamw_profile``: what `autopar profile` measures (four large tensors, the same bytes).

The cost model's price of the same phase on ``--profile`` (default: this GPU's bundled profile) is printed
beside it. Exits with a message if ``--device cuda`` has no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.profile_check import GPU_MODELS  # noqa: E402
from benchmarks.single_gpu_step import one_rank_trainer  # noqa: E402

SPLITS = (16, 64, 256, 1024, 4096)


def _trainer(model: str, device: str, profile: str):
    """A one-rank Trainer for ``model`` (a GPU_MODELS key or a preset) after one trained step, its plan."""
    from specs.model_loading import load_model, model_from_dict

    spec = GPU_MODELS.get(model, model)
    spec = load_model(spec) if isinstance(spec, str) else model_from_dict(spec, model)
    tr, plan, dev = one_rank_trainer(spec, profile, 1, 1000, device)
    tr.train_step()
    return tr, plan, dev


def _fresh(numel: int, parts: int, device) -> list[list]:
    """w, g, m, v: fp32 lists of ``parts`` equal views covering ``numel`` elements."""
    import torch

    out = []
    for _ in range(4):
        flat = torch.rand(numel, device=device)
        out.append(list(flat.tensor_split(parts)))
    return out


def _adamw(lists: list[list], wd: float, step) -> None:
    import torch

    if lists[0]:
        torch._fused_adamw_(*lists, [], [step] * len(lists[0]), lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=wd,
                            eps=1e-8, amsgrad=False, maximize=False)


def measure(model: str, device: str, profile: str) -> dict:
    """Every piece of one model's optimizer step, seconds, and the cost model's price on ``profile``."""
    import torch
    import torch.distributed as dist

    from cost_models.compute import ComputeModel
    from cost_models.step import estimate
    from hardware_profiles.compute_bench import time_adamw
    from hardware_profiles.timing import Timer

    tr, plan, dev = _trainer(model, device, profile)
    opt = tr.opt
    timer = Timer(dev, min_window_s=0.02, repeats=7)
    dec, rest, back = opt._operands()
    step = torch.ones((), device=dev)
    n_dec, n_rest = sum(t.numel() for t in dec[0]), sum(t.numel() for t in rest[0])
    n = n_dec + n_rest
    row: dict = {"model": model, "params": n, "tensors": len(dec[0]) + len(rest[0]),
                 "small_tensors": sum(t.numel() < 65536 for t in dec[0] + rest[0]), "copied_back": len(back)}
    t = {"step": timer(opt.step), "norm": timer(opt.clip_and_norm), "publish": timer(opt._publish),
         "adamw": timer(lambda: (_adamw(dec, 0.1, step), _adamw(rest, 0.0, step)))}
    flat = [_fresh(k, 1, dev) for k in (n_dec, n_rest)]
    t["adamw_flat"] = timer(lambda f=flat: (_adamw(f[0], 0.1, step), _adamw(f[1], 0.0, step)))
    del flat
    for k in SPLITS:
        parts = _fresh(n, k, dev)
        t[f"adamw_{k}"] = timer(lambda parts=parts: _adamw(parts, 0.1, step))
        del parts
    t["adamw_profile"] = 28 * n / time_adamw(timer, 4 * n)  # seconds of the same bytes at the profile's rate
    row["measured_s"] = t
    row["adamw_GBps"] = 28 * n / t["adamw"] / 1e9
    row["adamw_flat_GBps"] = 28 * n / t["adamw_flat"] / 1e9
    row["per_tensor_us"] = 1e6 * statistics.median(
        (t[f"adamw_{b}"] - t[f"adamw_{a}"]) / (b - a) for a, b in zip(SPLITS, SPLITS[1:]))
    state = tr.state
    row["predicted_s"] = estimate(plan.model, plan.cluster, tr.cfg, plan.global_batch,
                                  state=state).breakdown["optimizer"]
    row["predicted_adamw_s"] = float(ComputeModel(plan.cluster.gpu, plan.cluster.precision).adamw(
        n * state.adamw_bytes, 2))
    dist.destroy_process_group()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-1b", "gpt-1.3b", "gpt-350m"])
    ap.add_argument("--profile", default=None, help="cluster profile the model prices on (default dgx-h100, cpu: "
                                                     "cpu-gloo)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("optimizer_step.py: no CUDA GPU here; run it on a GPU machine (or pass --device cpu)", file=sys.stderr)
        return 2
    profile = a.profile or ("dgx-h100" if a.device == "cuda" else "cpu-gloo")
    rows = []
    for m in a.models:
        r = measure(m, a.device, profile)
        rows.append(r)
        t = r["measured_s"]
        print(f"{m}: {r['params'] / 1e6:.0f}M params in {r['tensors']} operand tensors ({r['small_tensors']} under "
              f"64K elements); step {1e3 * t['step']:.2f} ms = norm {1e3 * t['norm']:.2f} + AdamW "
              f"{1e3 * t['adamw']:.2f} ({r['adamw_GBps']:.0f} GB/s; flat {1e3 * t['adamw_flat']:.2f} ms, "
              f"{r['adamw_flat_GBps']:.0f} GB/s; profile's {28 * r['params'] / t['adamw_profile'] / 1e9:.0f} GB/s) "
              f"+ publish "
              f"{1e3 * t['publish']:.2f}; per extra tensor {r['per_tensor_us']:.2f} us; model "
              f"{1e3 * r['predicted_s']:.2f} ms (AdamW {1e3 * r['predicted_adamw_s']:.2f})", flush=True)
        print("  AdamW over k equal tensors, ms: " + ", ".join(f"{k} {1e3 * t[f'adamw_{k}']:.2f}" for k in SPLITS),
              flush=True)
    print("RESULT " + json.dumps(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
