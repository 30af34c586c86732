"""One GPU, the issue's reference shape: autopar's runtime (tp=pp=dp=1) against the peers, in one run.

    python benchmarks/single_gpu_step.py [--mbs 2] [--steps 10] [--peers compiled,hf-eager,liger]
                                         [--profile] [--backends auto,native] [--json out.json]

Reference shape: Llama hidden 2048, 16 layers, 16 heads, ffn 5504, vocab 32000, seq 4096 (the `llama-1b`
preset), bf16 parameters with fp32 gradients and master weights (the plan's default state), AdamW.
MFU = tokens/s x (6 x (params - input embedding) + 12 x layers x hidden x seq) / 989e12. Our step goes
through the runtime's Trainer exactly as `autopar run` does (one rank, NCCL). Peers (benchmarks/peers/) run
as separate processes right after, same GPU, same session. ``--backends auto,native`` runs our step with our
Triton norms and again with torch's own fused norms (runtime.kernels.set_backend). Prints a table and one
`RESULT {json}` line; exits with a message if there is no CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PEAK = 989e12  # H100 SXM dense bf16
PEERS = {
    "compiled": ["benchmarks/peers/peer_compiled_llama.py", "--compile", "model"],
    "compiled-blocks": ["benchmarks/peers/peer_compiled_llama.py", "--compile", "blocks"],
    "eager-plain": ["benchmarks/peers/peer_compiled_llama.py", "--compile", "none"],
    "hf-eager": ["benchmarks/peers/peer_hf_llama_step.py", "--impl", "eager"],
    "hf-compile": ["benchmarks/peers/peer_hf_llama_step.py", "--impl", "compile"],
    "liger": ["benchmarks/peers/peer_hf_llama_step.py", "--impl", "liger"],
}


def one_rank_trainer(spec, cluster_name: str, mbs: int, steps: int, device: str, **train):
    """The runtime's Trainer for ``spec`` (a ModelSpec) on one rank, as `autopar run` builds it (NCCL on a GPU, gloo
    on the CPU; the plan's state from ``cluster_name``'s precision; ``train``: TrainConfig fields over a short
    schedule's), with its plan and device. The caller destroys the process group."""
    import torch
    import torch.distributed as dist

    from runtime.data import SAMPLE_TEXT, TokenData
    from runtime.parallel.mesh import build_groups
    from runtime.trainer import Trainer
    from specs.cluster_loading import load_cluster
    from specs.parallel import ParallelConfig
    from specs.planfile import TrainConfig, make_plan

    cfg = ParallelConfig(mbs=mbs)
    plan = make_plan(spec, load_cluster(cluster_name, gpus=1), mbs, cfg,
                     train=TrainConfig(**{"steps": steps, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 1, **train}))
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    groups = build_groups(cfg, dev.type, tied_embeddings=spec.tie_embeddings)
    data = TokenData(SAMPLE_TEXT, spec.seq_length, spec.vocab_size, 0)
    return Trainer(plan, groups, dev, data, steps), plan, dev


def ours(mbs: int, steps: int, warmup: int, profile: bool, model: str = "llama-1b", device: str = "cuda",
         backend: str = "auto") -> dict:
    """The runtime's step, its kernels on ``backend`` (runtime.kernels.set_backend: 'auto' our Triton kernels on
    CUDA, 'native' torch's own fused norms instead of ours)."""
    import torch
    import torch.distributed as dist

    import runtime.kernels as K
    from specs.model_loading import load_model

    K.set_backend(backend)

    spec = load_model(model)
    total = warmup + steps
    tr, _, dev = one_rank_trainer(spec, "dgx-h100", mbs, total, device, grad_clip=0.0)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        st = tr.train_step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        st = tr.train_step()
    sync()
    dt = (time.perf_counter() - t0) / steps
    n = spec.num_params
    ftok = 6 * (n - spec.vocab_size * spec.hidden_size) + 12 * spec.num_layers * spec.hidden_size * spec.seq_length
    tok = mbs * spec.seq_length / dt
    out = {"impl": "autopar" if backend == "auto" else f"autopar/{backend}", "mb": mbs, "params": n,
           "tokens_s": round(tok), "mfu": round(tok * ftok / PEAK, 4),
           "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else None,
           "step_ms": round(dt * 1e3, 2),
           "loss": round(st.loss, 4)}
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
            for _ in range(2):
                tr.train_step()
            sync()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)
    dist.destroy_process_group()
    return out


def peer(name: str, mbs: int, steps: int) -> dict:
    cmd = [sys.executable, *PEERS[name], "--steps", str(steps)]
    cmd += ["--mb", str(mbs)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    m = re.search(r"^RESULT (.*)$", r.stdout, re.M)
    if r.returncode or not m:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        return {"impl": name, "error": " | ".join(tail)[:400]}
    d = json.loads(m.group(1))
    d.setdefault("peak_gb", d.get("peak_mem_gb"))  # the HF peer names it differently
    d["impl"] = name
    d["mb"] = mbs
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbs", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peers", default="compiled", help=f"comma list of {', '.join(PEERS)} (or 'none')")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of our step")
    ap.add_argument("--backends", default="auto",
                    help="comma list of our kernel backends to run: auto (our Triton kernels), native (torch's own "
                         "fused norms); default auto")
    ap.add_argument("--model", default="llama-1b",
                    help="our step's model (preset or spec file; default the reference shape, the only one the "
                         "peers run: give --peers none with another)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--cpu-smoke", action="store_true", help="run our step for the tiny model on CPU (a check)")
    args = ap.parse_args()
    import torch

    if args.cpu_smoke:
        for backend in args.backends.split(","):
            print("RESULT", json.dumps(ours(2, 2, 1, False, model="tiny", device="cpu", backend=backend)))
        return 0
    if not torch.cuda.is_available():
        print("single_gpu_step: no CUDA GPU here; run this on a machine with one (see benchmarks/RESULTS.md)")
        return 0
    rows = []
    for mbs in args.mbs:
        # ours in a child process per micro-batch size (a clean allocator and process group each time)
        for backend in args.backends.split(","):
            code = (f"import json,sys; sys.path.insert(0,{str(ROOT)!r}); import benchmarks.single_gpu_step as b; "
                    f"print('RESULT', json.dumps(b.ours({mbs}, {args.steps}, {args.warmup}, {args.profile}, "
                    f"model={args.model!r}, backend={backend!r})))")
            r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
            print(r.stdout[-6000:], end="")
            m = re.search(r"^RESULT (.*)$", r.stdout, re.M)
            rows.append(json.loads(m.group(1)) if m else {"impl": f"autopar/{backend}", "mb": mbs,
                                                          "error": r.stderr[-600:]})
        for name in [p for p in args.peers.split(",") if p and p != "none"]:
            rows.append(peer(name, mbs, args.steps))
    dev = torch.cuda.get_device_name()
    print(f"\n{dev}, torch {torch.__version__}")
    print(f"{'impl':16} {'mb':>3} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>8}  vs first peer")
    for mbs in args.mbs:
        group = [r for r in rows if r.get("mb") == mbs]
        base = next((r for r in group if not r["impl"].startswith("autopar") and "tokens_s" in r), None)
        for r in group:
            if "error" in r:
                print(f"{r['impl']:16} {mbs:3d}  error: {r['error'][:200]}")
                continue
            ratio = f"{r['tokens_s'] / base['tokens_s']:.3f}x" if base else "-"
            print(f"{r['impl']:16} {mbs:3d} {r['tokens_s']:10,d} {r['mfu'] * 100:6.1f}% {r['peak_gb']:8.1f}  {ratio}")
    print("RESULT", json.dumps({"device": dev, "torch": torch.__version__, "rows": rows}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
