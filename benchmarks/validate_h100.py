"""H100 predictions against measured runs: the bundled dgx-h100 profile as it is, then calibrated on a few runs.

    python benchmarks/validate_h100.py [--json out.json] [--gpu-profile h100.yaml]

Four sets (sources in benchmarks/data/README.md), each mapped onto a plan without any per-row constant:
- ``peers``: our own single-H100 measurements of the reference shape (a plain Llama, eager and torch.compile).
  The cost model prices a fused stack (fused norms, activations and attention; what autopar's runtime runs on a
  GPU), so the compiled peer is the like-for-like comparison; the eager one shows what unfused kernels cost.
- ``nvidia_dgxc``: NVIDIA's DGX Cloud benchmark recipes (release 24.11, NeMo 24.09/24.05: Megatron-Core with Transformer
  Engine, the stack whose mechanisms the cost model follows): Llama 3.1 8B/70B/405B, Nemotron-4 15B/340B and GPT-3
  175B on 8-2,304 H100s, every setting taken from the config that ran (:func:`nemo_case`).
- ``mosaicml``: llm-foundry's H100 80GB BF16 tables: MPT 760M-70B (GPT blocks, tied embeddings, flash
  attention) under PyTorch FSDP (FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2) with data parallelism only, on
  8-512 GPUs at sequence lengths 512-65536, eager PyTorch 2.1 era (2023-24). Each row is priced with its own
  micro-batch, sharding and activation checkpointing (full recompute), overlapped data-parallel traffic.
- ``llama3``: Llama 3 405B on 8,192 and 16,384 H100s (Dubey et al. 2024, Table 4): tp=8, pp=16, 16M-token
  batches of 8,192-token sequences. The micro-batch, interleaving and recompute are not published: the
  planner searches them with tp, pp and cp fixed (as validate_published.py does for Narayanan et al.).
  Compared as model TFLOP/s per GPU in the Megatron/PaLM convention (``ModelSpec.model_flops_per_token``:
  attention counted without causal savings); the paper does not state its convention, and at 8k tokens the
  two differ by about 4%.

Then ``autopar calibrate``'s fit (planner/calibrate.py: five scales on the profile) is run on a handful of the
MosaicML runs, chosen by a rule fixed before any calibrated result was seen (:func:`calibration_rows`: every
8-GPU run at sequence 2048, one per model size), and every other run is predicted with the calibrated profile
(held out).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from validate_published import published_state  # noqa: E402

from cost_models.step import estimate  # noqa: E402
from planner.calibrate import calibrated, calibration_spread, fit_scales, predict  # noqa: E402
from planner.measured_runs import Run  # noqa: E402
from planner.search import search  # noqa: E402
from planner.uncertainty import in_band, step_band  # noqa: E402
from specs.cluster import ClusterSpec, GPUSpec  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402
from specs.model import ModelSpec  # noqa: E402
from specs.parallel import ParallelConfig  # noqa: E402
from specs.planfile import PlanFile  # noqa: E402

DATA = ROOT / "benchmarks" / "data"
CLUSTER = "dgx-h100"
ZERO = {"FULL_SHARD": 3, "SHARD_GRAD_OP": 2}


def _rows(name: str) -> list[dict[str, str]]:
    with open(DATA / name) as f:
        return list(csv.DictReader(f))


def _err(pred: float, meas: float) -> float:
    return pred / meas - 1.0


def peer_runs() -> list[dict]:
    """The reference shape on one H100: predicted vs measured tokens/s."""
    out = []
    for r in _rows("h100_reference_peers.csv"):
        m = ModelSpec(name="reference", arch=r["arch"], num_layers=int(r["layers"]), hidden_size=int(r["hidden"]),
                      num_attention_heads=int(r["heads"]), ffn_hidden_size=int(r["ffn"]), vocab_size=int(r["vocab"]),
                      seq_length=int(r["seq"]))
        mbs = int(r["micro_batch"])
        est = estimate(m, load_cluster(CLUSTER, gpus=1), ParallelConfig(mbs=mbs), mbs)
        pred = mbs * m.seq_length / est.step_time_s
        out.append({"peer": r["peer"], "micro_batch": mbs, "measured_tokens_s": float(r["tokens_per_s"]),
                    "predicted_tokens_s": pred, "error": _err(pred, float(r["tokens_per_s"]))})
    return out


def mosaic_plan(r: dict[str, str], cluster: str = CLUSTER) -> PlanFile:
    """One llm-foundry row as a plan on ``cluster``: data parallel over all GPUs, its micro-batch, sharding and
    checkpointing."""
    m = ModelSpec(name=r["model"], arch="gpt", num_layers=int(r["layers"]), hidden_size=int(r["hidden"]),
                  num_attention_heads=int(r["heads"]), vocab_size=int(r["vocab"]), seq_length=int(r["seq"]),
                  tie_embeddings=True, attention="flash", dropout=0.0)
    gpus = int(r["gpus"])
    cfg = ParallelConfig(dp=gpus, mbs=int(r["micro_batch"]), zero=ZERO[r["sharding"]], dp_overlap=True,
                         recompute="full" if r["activation_checkpointing"] == "true" else "none")
    return PlanFile(model=m, cluster=load_cluster(cluster, gpus=gpus), global_batch=int(r["global_batch"]),
                    seq=m.seq_length, parallel=cfg.to_dict())


def mosaic_runs(table: str = "mosaicml_llm_foundry_h100_bf16.csv", cluster: str = CLUSTER
                ) -> list[tuple[dict[str, str], Run]]:
    """Each row of an llm-foundry table with its plan on ``cluster`` and its measured step time."""
    out = []
    for r in _rows(table):
        plan = mosaic_plan(r, cluster)
        step = plan.global_batch * plan.seq / (float(r["tokens_per_s_per_gpu"]) * int(r["gpus"]))
        out.append((r, Run(source=f"{r['model']} seq {r['seq']} on {r['gpus']}", plan=plan, measured_s=step,
                           steps=1, logged_prediction_s=None)))
    return out


def calibration_rows(rows: list[dict[str, str]]) -> list[int]:
    """The rule, fixed before the errors were seen: every 8-GPU run at sequence 2048 (one per model size)."""
    return [i for i, r in enumerate(rows) if r["gpus"] == "8" and r["seq"] == "2048"]


def mosaic(base: ClusterSpec, table: str = "mosaicml_llm_foundry_h100_bf16.csv", cluster: str = CLUSTER
           ) -> tuple[list[dict], dict[str, float]]:
    """Every run of ``table`` predicted on ``base`` (the bundled ``cluster``) and on that profile calibrated on
    :func:`calibration_rows`' runs; each held-out run's band on the calibrated profile widened by what the fit leaves
    uncertain about it."""
    pairs = mosaic_runs(table, cluster)
    rows, runs = [p[0] for p in pairs], [p[1] for p in pairs]
    cal = calibration_rows(rows)
    print(f"calibrating on {len(cal)} runs: " + ", ".join(runs[i].source for i in cal), flush=True)
    fit = fit_scales([runs[i] for i in cal], base)
    before, after = predict(runs, base, {}), predict(runs, base, fit.scales)
    tuned = calibrated(base, fit)
    out = []
    for i, (r, run) in enumerate(pairs):
        plan = run.plan
        spread, _ = calibration_spread(plan.model, tuned.resized(gpus=plan.cluster.num_gpus), plan.config,
                                       plan.global_batch, plan.state)
        low, high = step_band(1, after[i], spread)  # FSDP: data parallel only, no pipeline
        out.append({"model": r["model"], "seq": int(r["seq"]), "gpus": int(r["gpus"]), "mbs": int(r["micro_batch"]),
                    "zero": ZERO[r["sharding"]], "recompute": r["activation_checkpointing"] == "true",
                    "measured_s": run.measured_s, "bundled_error": _err(before[i], run.measured_s),
                    "calibrated_error": _err(after[i], run.measured_s), "calibration_run": i in cal,
                    "calibration_log_sd": spread, "calibrated_in_band": bool(low <= run.measured_s <= high)})
    return out, fit.scales


def llama3() -> list[dict]:
    """Llama 3 405B rows of Dubey et al. 2024 Table 4 (seq 8192): the planner's best with tp, pp, cp fixed."""
    from specs.model_loading import load_model

    model = load_model("llama3-405b")
    out = []
    for gpus, measured in ((8192, 430.0), (16384, 400.0)):
        c = load_cluster(CLUSTER, gpus=gpus)
        batch = 16 * 2**20 // model.seq_length
        res = search(model, c, batch, fixed={"tp": 8, "pp": 16, "cp": 1}, headroom_GiB=0.0)
        best = res.plans[0]
        pred = best.estimate.mfu * c.gpu.peak(c.precision) / 1e12
        out.append({"gpus": gpus, "plan": best.config.short(), "measured_tflops": measured, "predicted_tflops": pred,
                    "error": _err(pred, measured)})
    return out


def megatron_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """The vocabulary Megatron-LM builds: padded to a multiple of make_vocab_size_divisible_by x tp (its
    ``_vocab_size_with_padding``; every NeMo config here sets make_vocab_size_divisible_by: 128)."""
    m = divisible_by * tp
    return -(-vocab // m) * m


# How Transformer Engine pieces each GEMM beside an overlapped collective, per recipe (`ub_tp_comm_overlap_cfg` in
# its config; the Nemotron-4 configs give none: TE's defaults, the same methods and TE's own 4 pipeline splits):
# "ring" = ring exchange in tp pieces ("ring/2": aggregate: 1, tp/2 pieces), an int = a pipelined
# reduce-scatter in num_splits pieces, 1 = a bulk overlap beside the whole input-gradient GEMM.
TE_DEFAULT = {"qkv_fprop": "ring", "fc1_fprop": "ring", "proj_dgrad": "ring", "fc2_dgrad": "ring",
              "proj_fprop": 4, "fc2_fprop": 4, "qkv_dgrad": 1, "fc1_dgrad": 1}
TE_OVERLAP = {
    "llama3.1-405b": {**TE_DEFAULT, "qkv_fprop": "ring/2", "fc1_fprop": "ring/2", "proj_dgrad": "ring/2",
                      "fc2_dgrad": "ring/2"},
    "gpt3-175b": {**TE_DEFAULT, "fc2_dgrad": "ring/2"},
}


# The SMs TE's pipelined reduce-scatter takes from the GEMM beside it (num_sm where the config sets set_sm_margin: 1;
# TE's default, which the Nemotron-4 configs leave as it is, reserves none), per recipe, from the same configs.
TE_SM_MARGIN = {
    "llama3.1-70b": {"proj_fprop": 24, "fc2_fprop": 16},
    "llama3.1-405b": {"proj_fprop": 24, "fc2_fprop": 8},
    "gpt3-175b": {"proj_fprop": 24, "fc2_fprop": 20},
}


def recipe(row_model: str) -> str:
    """The recipe a row of nvidia_dgxc_h100_bf16.csv belongs to ("llama3.1-405b (7-layer proxy)" -> "llama3.1-405b")."""
    return row_model.split(" (")[0]


def te_pieces(model: str, tp: int) -> tuple[tuple[str, int], ...]:
    """StateSpec.overlap_pieces of one recipe at tensor parallel ``tp``."""
    ways = {"ring": tp, "ring/2": max(1, tp // 2)}
    return tuple((g, ways.get(m, m)) for g, m in TE_OVERLAP.get(recipe(model), TE_DEFAULT).items())


def nemo_case(r: dict[str, str]) -> tuple[ModelSpec, ClusterSpec, ParallelConfig, int]:
    """One NeMo run of NVIDIA's DGX Cloud recipes as the cost model's inputs, from the config it ran: the model's
    shape (its tokenizer's vocabulary padded as Megatron does; its activation and whether its projections have
    biases: Nemotron-4's squared ReLU, computed unfused as its config's bias_activation_fusion: false asks, no
    biases and RoPE on half of each head), the published tp/pp/cp/vpp/micro-batch/global
    batch, sequence parallelism and Transformer Engine's tp overlap where the config turns them on, its
    recompute, and the distributed optimizer with overlapped gradient reduce-scatter and parameter all-gather
    (distributed_fused_adam with overlap_grad_sync and overlap_param_sync: ZeRO-1, dp_overlap), flash attention
    (TE's flash / cuDNN kernels), and the config's dropout (0.1 for GPT-3 175B, none for the others)."""
    tp, pp, cp, gpus = int(r["tp"]), int(r["pp"]), int(r["cp"]), int(r["gpus"])
    model = ModelSpec(name=r["model"], arch=r["arch"], num_layers=int(r["layers"]), hidden_size=int(r["hidden"]),
                      ffn_hidden_size=int(r["ffn"]), num_attention_heads=int(r["heads"]),
                      num_kv_heads=int(r["kv_heads"]), vocab_size=megatron_vocab(int(r["vocab"]), tp),
                      seq_length=int(r["seq"]), attention="flash", dropout=float(r["dropout"]),
                      activation=r["activation"], linear_bias=r["bias"] == "true",
                      rotary_fraction=float(r["rotary_fraction"]) if r["rotary_fraction"] else None)
    cfg = ParallelConfig(tp=tp, pp=pp, cp=cp, dp=gpus // (tp * pp * cp), vpp=int(r["vpp"]), mbs=int(r["mbs"]),
                         sp=r["sp"] == "true", tp_overlap=r["tp_overlap"] == "true", recompute=r["recompute"],
                         zero=1, dp_overlap=True)
    return model, load_cluster(CLUSTER, gpus=gpus), cfg, int(r["global_batch"])


def nemo(gpu: GPUSpec | None = None) -> list[dict]:
    """Every BF16 H100 run of the DGX Cloud recipes (benchmarks/data/nvidia_dgxc_h100_bf16.csv) priced on the
    bundled profile (its GPU replaced by ``gpu``, e.g. one measured by `autopar profile`, if given) with the
    stack's own state: fused gradient accumulation, a loss over the whole logits (compiled where the config fuses
    it), gradients reduced in bf16, and
    TE's pieces of the GEMMs beside overlapped collectives (:data:`TE_OVERLAP`) and the SMs it keeps from them
    (:data:`TE_SM_MARGIN`)."""
    out = []
    for r in _rows("nvidia_dgxc_h100_bf16.csv"):
        model, cluster, cfg, batch = nemo_case(r)
        if gpu is not None:
            cluster = cluster.model_copy(update={"gpu": gpu})
        state = published_state(cluster, "nvidia_dgxc_h100").model_copy(
            update={"overlap_pieces": te_pieces(r["model"], cfg.tp),
                    "sm_margin": tuple(TE_SM_MARGIN.get(recipe(r["model"]), {}).items()),
                    "grad_reduce": "bf16",  # every config's optim.grad_sync_dtype
                    "loss_fusion": r["loss_fusion"] == "true"})  # its cross_entropy_loss_fusion
        est = estimate(model, cluster, cfg, batch, state=state)
        meas = float(r["step_s"])
        out.append({"model": r["model"], "container": r["container"], "gpus": int(r["gpus"]), "plan": cfg.short(),
                    "measured_s": meas, "predicted_s": est.step_time_s, "error": _err(est.step_time_s, meas),
                    "predicted_GiB": est.memory_GiB, "predicted_fits": bool(est.fits)})
    return out


def _summary(errors: list[float]) -> str:
    a = [abs(e) for e in errors]
    return (f"median |error| {statistics.median(a):.1%}, max {max(a):.1%}, within 10%: "
            f"{sum(x <= 0.10 for x in a)}/{len(a)}, mean signed {statistics.mean(errors):+.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--gpu-profile", metavar="PROFILE",
                    help="price the DGX Cloud runs on this profile's GPU (e.g. h100.yaml from `autopar profile` on "
                         "an H100) in the bundled cluster, instead of the bundled GPU")
    args = ap.parse_args()
    base = load_cluster(CLUSTER)

    print("== reference shape on one H100 (measured by us, benchmarks/data/h100_reference_peers.csv)")
    peers = peer_runs()
    for p in peers:
        print(f"  {p['peer']:42} mbs {p['micro_batch']}: measured {p['measured_tokens_s']:8.0f} tok/s, predicted "
              f"{p['predicted_tokens_s']:8.0f} ({p['error']:+.1%})")

    print("== Llama 3 405B, Dubey et al. 2024 Table 4 (model TFLOP/s per GPU)")
    l3 = llama3()
    for r in l3:
        print(f"  {r['gpus']:6} GPUs {r['plan']:48} measured {r['measured_tflops']:.0f}, predicted "
              f"{r['predicted_tflops']:.0f} ({r['error']:+.1%})")

    print("== NVIDIA DGX Cloud recipes 24.11 (NeMo 24.09/24.05), H100 BF16 (step time; Megatron-Core + Transformer "
          "Engine)")
    gpu = load_cluster(args.gpu_profile).gpu if args.gpu_profile else None
    dgxc = nemo(gpu)
    for r in dgxc:
        fit = "" if r["predicted_fits"] else f"  (predicted {r['predicted_GiB']:.1f} GiB: not to fit, yet it ran)"
        print(f"  {r['model']:30} {r['gpus']:5} {r['plan']:58} measured {r['measured_s']:6.2f} s, predicted "
              f"{r['predicted_s']:6.2f} ({r['error']:+.1%}){fit}")
    print("  all runs: " + _summary([r["error"] for r in dgxc]))
    for name in dict.fromkeys(recipe(r["model"]) for r in dgxc):
        print(f"  {name:15} " + _summary([r["error"] for r in dgxc if recipe(r["model"]) == name]))

    print("== MosaicML llm-foundry, H100 80GB BF16 (step time)")
    rows, scales = mosaic(base)
    print("  calibrated scales: " + ", ".join(f"{k} {v:.3f}" for k, v in scales.items()))
    print(f"  {'model':9} {'seq':>6} {'GPUs':>5} {'mbs':>4} zero recompute {'bundled':>8} {'calibrated':>11}")
    for r in rows:
        mark = "  (calibration run)" if r["calibration_run"] else ""
        print(f"  {r['model']:9} {r['seq']:6} {r['gpus']:5} {r['mbs']:4} {r['zero']:4} {str(r['recompute']):9} "
              f"{r['bundled_error']:+8.1%} {r['calibrated_error']:+11.1%}{mark}")
    held = [r for r in rows if not r["calibration_run"]]
    print("  bundled profile, all runs:      " + _summary([r["bundled_error"] for r in rows]))
    print("  calibrated, held-out runs:      " + _summary([r["calibrated_error"] for r in held]))
    for name, keep in (("seq <= 4096", lambda r: r["seq"] <= 4096), ("seq >= 8192", lambda r: r["seq"] >= 8192)):
        sel = [r["calibrated_error"] for r in held if keep(r)]
        print(f"  calibrated, held out, {name}: " + _summary(sel))
    n = sum(in_band(False, 1.0, 1.0 + r["bundled_error"]) for r in rows)  # FSDP: data parallel only, no pipeline
    print(f"  +- bands (planner/uncertainty.py) cover {n} of {len(rows)} runs, bundled, all runs")
    n = sum(in_band(False, 1.0, 1.0 + r["calibrated_error"]) for r in held)
    print(f"  +- bands cover {n} of {len(held)} runs, calibrated, held out, without the fit's own uncertainty")
    n = sum(r["calibrated_in_band"] for r in held)
    wide = [math.exp(1.959964 * r["calibration_log_sd"]) for r in held]
    print(f"  +- bands cover {n} of {len(held)} runs, calibrated, held out, widened by the fit's uncertainty "
          f"(x/{min(wide):.2f} .. x/{max(wide):.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"peers": peers, "llama3": l3, "nvidia_dgxc": dgxc, "mosaicml": rows,
                                                "scales": scales}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
