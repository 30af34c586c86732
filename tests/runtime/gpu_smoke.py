"""GPU smoke check of the runtime (needs one CUDA GPU; not part of the CPU test suite).

``python tests/runtime/gpu_smoke.py [--skip-throughput]`` prints one ``RESULT {json}`` line:

* ``bf16``: the tiny plan trained 30 steps on the GPU in bf16 (bf16 parameters, fp32 gradients and master
  weights; NCCL, one rank): first/last loss;
* ``fp32_vs_cpu``: 3 steps of an fp32 plan on the GPU and on the CPU: largest relative loss difference;
* ``resume``: torchrun + NCCL, checkpoint at step 2 of 4, resume, losses equal to an uninterrupted run;
* ``cp_blocks``: context parallelism's attention blocks on CUDA's flash kernel (bf16, grouped K/V) against the
  math blocks in fp32, forward and backward: largest difference relative to the largest value;
* ``throughput``: the llama-1b preset (seq 4096, micro-batch 2, bf16), tokens/s, MFU and peak memory,
  the shape of the peer baselines in ``shared/bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from specs.cluster_loading import load_cluster  # noqa: E402
from specs.model_loading import load_model  # noqa: E402
from specs.parallel import ParallelConfig  # noqa: E402
from specs.planfile import TrainConfig, make_plan, save_plan  # noqa: E402


def _plan(tmp: Path, name: str, model: str, cluster: str, batch: int, mbs: int, steps: int,
          precision: str | None = None) -> str:
    path = tmp / f"{name}.json"
    train = TrainConfig(steps=steps, lr=3e-3, min_lr=3e-4, warmup_steps=3)
    c = load_cluster(cluster, gpus=1)
    if precision:
        c = c.model_copy(update={"precision": precision})
    save_plan(make_plan(load_model(model), c, batch, ParallelConfig(mbs=mbs), train=train), path)
    return str(path)


def _train(args: list[str], torchrun: bool = False, cpu: bool = False) -> list[dict]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # keep carried wheels
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "4"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    out = Path(tempfile.mkdtemp()) / "m.jsonl"
    pre = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"] if torchrun \
        else [sys.executable]
    r = subprocess.run([*pre, "-m", "runtime.train", *args, "--quiet", "--metrics-out", str(out)], env=env,
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"failed: {args}\n{r.stderr[-3000:]}")
    return [row for x in out.read_text().splitlines() if "step" in (row := json.loads(x))]  # not a resume's event


def _cp_blocks() -> float:
    """FlashCUDABlocks against MathBlocks (fp32) on rank 0 of cp=2: output, dq, dk, dv."""
    import torch

    from runtime.parallel.context_parallel import (
        FlashCUDABlocks,
        MathBlocks,
        blocks_backward,
        blocks_forward,
        local_chunks,
    )

    torch.manual_seed(0)
    b, s, heads, kv, d, scale = 2, 512, 8, 2, 64, 0.125
    q = torch.randn(b, heads, s // 2, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, kv, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    worst = 0.0
    for impl, dt in ((FlashCUDABlocks, torch.bfloat16), (MathBlocks, torch.float32)):
        o, lse = blocks_forward(impl, q.to(dt), k.to(dt), v.to(dt), local_chunks(2, 0), scale)
        got = [o, *blocks_backward(impl, do.to(dt), q.to(dt), k.to(dt), v.to(dt), o, lse, local_chunks(2, 0), scale)]
        if impl is FlashCUDABlocks:
            flash = got
    for a, ref in zip(flash, got):
        worst = max(worst, float((a.float() - ref.float()).abs().max() / ref.float().abs().max()))
    return worst


def main() -> None:
    import torch

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    tmp = Path(tempfile.mkdtemp())
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    rows = _train([_plan(tmp, "bf16", "tiny", "dgx-h100", 16, 4, 30)])
    res["bf16"] = {"first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"], "step_time_s": rows[-1]["step_time_s"]}
    fp32_gpu = _plan(tmp, "fp32-gpu", "tiny", "dgx-h100", 16, 4, 3, precision="fp32")
    fp32_cpu = _plan(tmp, "fp32-cpu", "tiny", "cpu-gloo", 16, 4, 3)
    gpu, cpu = _train([fp32_gpu]), _train([fp32_cpu], cpu=True)
    res["fp32_vs_cpu"] = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(gpu, cpu))
    ck = tmp / "ck"
    p = _plan(tmp, "ck", "tiny", "dgx-h100", 16, 4, 4)
    whole = _train([p], torchrun=True)
    first = _train([p, "--steps", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "2"], torchrun=True)
    (ck / "latest").write_text("step_00000002\n")  # resume from step 2 although step 4 was also saved
    rest = _train([p, "--checkpoint-dir", str(ck), "--resume"], torchrun=True)
    res["resume"] = {"whole": [r["loss"] for r in whole], "first": [r["loss"] for r in first],
                     "resumed": [r["loss"] for r in rest],
                     # flash attention's backward is not bit-deterministic on GPUs: compare with a tolerance
                     "max_rel_diff": max(abs(a["loss"] - b["loss"]) / abs(b["loss"])
                                         for a, b in zip(whole[2:], rest))}
    res["cp_blocks"] = _cp_blocks()
    if "--skip-throughput" not in sys.argv:
        toks = tmp / "rand.npy"
        np.save(toks, np.random.default_rng(0).integers(0, 32000, 4_000_000).astype(np.uint16))
        rows = _train([_plan(tmp, "big", "llama-1b", "dgx-h100", 4, 2, 6), "--data", str(toks)])
        last = rows[2:]
        res["throughput"] = {k: sum(r[k] for r in last) / len(last) for k in ("tokens_per_s", "mfu", "step_time_s")}
        res["throughput"]["peak_memory_GiB"] = rows[-1]["peak_memory_GiB"]
    print("RESULT", json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
