"""Does a measured profile predict real runs? profile -> plan -> run, predicted beside measured step time.

    python benchmarks/profile_check.py cpu [--ranks 2 4] [--steps 20] [--warmup 5] [--also KEYS ...] [--quick]
    python benchmarks/profile_check.py gpu-gemm [--profile h100.yaml]     # profiled GEMM table vs torch timings
    python benchmarks/profile_check.py gpu-plans [--profile h100.yaml]    # 3 single-GPU plans, predicted vs run
    python benchmarks/profile_check.py gpu                                # both GPU checks
    ... [--json out.json]

cpu: for each rank count R, `autopar profile --nproc R` measures this machine with R gloo ranks, `autopar plan`
picks the best plan (--runnable) for the tiny model on that profile, `autopar run` trains it; the predicted step time is
compared with the median measured step time after ``--warmup`` steps (target: within 25%; CPU timings on a
shared machine are noisy, so both numbers are printed).
gpu-gemm: every shape of the profile's GEMM table is timed again with torch.utils.benchmark (torch's own
timer, a different method from the profiler's CUDA events); target: every shape within 5%. The cost model's
time for the shapes the three models below ask for is printed beside torch's too (interpolation check), and beside
those shapes run as the runtime's linear layers run them (x @ W^T, and with a bias in the epilogue).
gpu-plans: three model shapes that fit one GPU are planned on the profile with --gpus 1 and run; target:
predicted within 10% of the measured median step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Single-GPU model shapes (seq 2048): ~350M GPT, ~1.3B GPT, and the bundled llama-1b preset.
GPU_MODELS: dict[str, dict[str, Any]] = {
    "gpt-350m": {"name": "gpt-350m", "arch": "gpt", "num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
                 "vocab_size": 51200, "seq_length": 2048, "attention": "flash", "dropout": 0.0},
    "gpt-1.3b": {"name": "gpt-1.3b", "arch": "gpt", "num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16,
                 "vocab_size": 51200, "seq_length": 2048, "attention": "flash", "dropout": 0.0},
    "llama-1b": "llama-1b",
}


def autopar(*args: str, capture: bool = True) -> str:
    """Run the CLI in a subprocess (as a user would); raise with its stderr on failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")
    r = subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=capture, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"autopar {' '.join(args)} failed ({r.returncode}): {(r.stderr or '').strip()[-2000:]}")
    return r.stdout


def measured_step(metrics: Path, warmup: int) -> tuple[float, float | None, int]:
    """(median step time after ``warmup`` steps, the prediction the runtime logged, steps used)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if r.get("step", 0) > warmup]
    if not times:
        raise SystemExit(f"{metrics}: no steps after warm-up {warmup}")
    return statistics.median(times), rows[0].get("predicted_step_time_s"), len(times)


def profile_plan_run(work: Path, tag: str, profile: Path, model: str, batch: int, gpus: int | None, fix: str,
                     steps: int, warmup: int) -> dict[str, Any]:
    plan = work / f"plan-{tag}.json"
    args = ["plan", "--model", model, "--cluster", str(profile), "--global-batch", str(batch), "--out", str(plan),
            "--runnable", "--format", "json"]
    if gpus:
        args += ["--gpus", str(gpus)]
    if fix:
        args += ["--fix", fix]
    best = json.loads(autopar(*args))["plans"][0]
    metrics = work / f"metrics-{tag}.jsonl"
    metrics.unlink(missing_ok=True)  # a rerun into the same --work: a fresh run refuses earlier metrics
    autopar("run", str(plan), "--steps", str(steps), "--metrics-out", str(metrics))
    med, logged, n = measured_step(metrics, warmup)
    pred = best["step_time_s"]
    from specs.parallel import ParallelConfig

    keys = ParallelConfig.from_dict(best["parallel"]).short()
    return {"case": tag, "plan": keys, "predicted_s": pred, "logged_prediction_s": logged, "measured_median_s": med,
            "steps": n, "error": pred / med - 1.0, "breakdown": best["breakdown"]}


def check_cpu(a: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    for r in a.ranks:
        prof = work / f"cpu-{r}.yaml"
        print(f"profiling {r} gloo ranks -> {prof}", flush=True)
        print(autopar("profile", "--nproc", str(r), "--out", str(prof), *(["--quick"] if a.quick else [])), flush=True)
        cases = [(f"tiny-{r}ranks", a.fix)]
        cases += [(f"tiny-{r}ranks-fixed{j}", ",".join(filter(None, [a.fix, keys]))) for j, keys in enumerate(a.also)
                  if _fits(keys, r)]
        for tag, fix in cases:
            row = profile_plan_run(work, tag, prof, "tiny", a.global_batch, r, fix, a.steps, a.warmup)
            rows.append(row)
            print(f"  {row['case']}: {row['plan']}  predicted {row['predicted_s']:.4f} s, measured median "
                  f"{row['measured_median_s']:.4f} s over {row['steps']} steps: error {100 * row['error']:+.1f}% "
                  f"({'PASS' if abs(row['error']) <= 0.25 else 'FAIL'} at 25%)", flush=True)
    return rows


def _fits(keys: str, ranks: int) -> bool:
    """Whether fixed plan keys (tp, pp, dp) can run on ``ranks`` ranks."""
    kv = dict(k.split("=") for k in keys.split(",") if "=" in k)
    used = int(kv.get("tp", 1)) * int(kv.get("pp", 1)) * int(kv.get("dp", 1))
    return ranks % used == 0 and ("dp" not in kv or used == ranks)


def _gpu_profile(a: argparse.Namespace, work: Path) -> Path:
    if a.profile:
        return Path(a.profile)
    prof = work / "gpu.yaml"
    print(f"profiling this GPU -> {prof}", flush=True)
    print(autopar("profile", "--nproc", "1", "--out", str(prof), *(["--quick"] if a.quick else [])), flush=True)
    return prof


def check_gpu_gemm(prof: Path) -> list[dict[str, Any]]:
    import torch
    from torch.utils.benchmark import Timer

    from cost_models.compute import ComputeModel
    from specs.cluster_loading import load_cluster
    from specs.model_loading import load_model, model_from_dict

    cluster = load_cluster(str(prof))
    cm = ComputeModel(cluster.gpu, cluster.precision)
    from runtime.dtypes import TORCH_DTYPES

    dtype = TORCH_DTYPES[cluster.precision]

    def torch_time(m: int, n: int, k: int) -> float:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        return Timer("torch.matmul(a, b)", globals={"torch": torch, "a": a, "b": b}).blocked_autorange(
            min_run_time=0.1).median

    def linear_time(m: int, n: int, k: int, bias: bool) -> float:
        """The product as the runtime's linear layers run it: x (m x k) times a weight (n x k) transposed, with a
        bias in cuBLAS's epilogue where ``bias`` (GPT's column-parallel qkv and MLP-in layers; row-parallel ones add
        theirs after the reduction). Session 29: the step's GEMMs ran ~20% faster than the table's matmuls."""
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
        return Timer("F.linear(x, w, b)", globals={"F": torch.nn.functional, "x": x, "w": w, "b": b}
                     ).blocked_autorange(min_run_time=0.1).median

    rows = []
    for p in cluster.gpu.gemm_table:
        t_torch = torch_time(p.m, p.n, p.k)
        t_table = 2.0 * p.m * p.n * p.k / (p.tflops * 1e12)
        rows.append({"m": p.m, "n": p.n, "k": p.k, "torch_s": t_torch, "table_s": t_table,
                     "model_s": float(cm.gemm(p.m, p.n, p.k)), "error": t_table / t_torch - 1.0, "kind": "table"})
    worst = max(rows, key=lambda r: abs(r["error"]))
    within = sum(abs(r["error"]) <= 0.05 for r in rows)
    print(f"GEMM table vs torch.matmul: {within}/{len(rows)} shapes within 5%; median |error| "
          f"{100 * statistics.median(abs(r['error']) for r in rows):.2f}%, worst {100 * worst['error']:+.1f}% at "
          f"{worst['m']}x{worst['n']}x{worst['k']}", flush=True)
    # the shapes the model GEMMs of the GPU models ask for (tp=1, micro-batch 1): interpolation quality
    for key, spec in GPU_MODELS.items():
        m = load_model(spec) if isinstance(spec, str) else model_from_dict(spec, key)
        T, h, f = m.seq_length, m.hidden_size, m.ffn
        shapes = {(T, m.q_width + 2 * m.kv_width, h), (T, h, m.q_width), (T, (2 if m.arch == "llama" else 1) * f, h),
                  (T, h, f), (T, m.vocab_size, h)}
        for M, N, K in sorted(shapes):
            t_torch = torch_time(M, N, K)
            t_linear, t_bias = linear_time(M, N, K, False), linear_time(M, N, K, True)
            t_model = float(cm.gemm(M, N, K))
            rows.append({"m": M, "n": N, "k": K, "torch_s": t_torch, "linear_s": t_linear, "linear_bias_s": t_bias,
                         "model_s": t_model, "error": t_model / t_torch - 1.0, "kind": f"model {key}"})
            print(f"  {key:<9} {M}x{N}x{K}: torch.matmul {1e3 * t_torch:.3f} ms, x @ W^T {1e3 * t_linear:.3f} ms, "
                  f"with a bias in the epilogue {1e3 * t_bias:.3f} ms, cost model {1e3 * t_model:.3f} ms "
                  f"({100 * (t_model / t_torch - 1):+.1f}%)", flush=True)
    return rows


def check_gpu_plans(a: argparse.Namespace, prof: Path, work: Path) -> list[dict[str, Any]]:
    rows = []
    for key, spec in GPU_MODELS.items():
        model = spec
        if isinstance(spec, dict):
            model = str(work / f"{key}.json")
            Path(model).write_text(json.dumps(spec))
        row = profile_plan_run(work, key, prof, model, a.global_batch, 1, a.fix, a.steps, a.warmup)
        rows.append(row)
        print(f"  {key}: {row['plan']}  predicted {row['predicted_s']:.4f} s, measured median "
              f"{row['measured_median_s']:.4f} s: error {100 * row['error']:+.1f}% "
              f"({'PASS' if abs(row['error']) <= 0.10 else 'FAIL'} at 10%)", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("cpu", "gpu", "gpu-gemm", "gpu-plans"))
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="cpu: gloo rank counts (default 2 4)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per run (cpu 20, gpu 30)")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the measured median")
    ap.add_argument("--global-batch", type=int, default=None, help="sequences per step (cpu 16, gpu 8)")
    ap.add_argument("--fix", default="", help="plan keys held fixed (plans are always --runnable)")
    ap.add_argument("--also", action="append", default=[], metavar="KEYS",
                    help="cpu: also run this fixed plan on each profile (repeatable), e.g. tp=2,pp=2,mbs=2")
    ap.add_argument("--quick", action="store_true", help="profile with --quick")
    ap.add_argument("--profile", help="gpu: use this profile instead of measuring one")
    ap.add_argument("--work", help="keep profiles, plans and metrics here (default: a temporary directory)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    gpu = a.mode.startswith("gpu")
    a.steps = a.steps or (30 if gpu else 20)
    a.global_batch = a.global_batch or (8 if gpu else 16)
    with tempfile.TemporaryDirectory(prefix="autopar-check-") as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        out: dict[str, Any] = {}
        if a.mode == "cpu":
            out["cpu"] = check_cpu(a, work)
        else:
            prof = _gpu_profile(a, work)
            if a.mode in ("gpu", "gpu-gemm"):
                out["gemm"] = check_gpu_gemm(prof)
            if a.mode in ("gpu", "gpu-plans"):
                out["plans"] = check_gpu_plans(a, prof, work)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
