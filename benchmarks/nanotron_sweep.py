"""The Ultra-Scale Playbook's sweep: ~1,750 measured plans of four Llamas on 1-64 nodes of 8 H100s, priced.

    python benchmarks/nanotron_sweep.py [--json out.json] [--autopar-defaults]

Hugging Face's nanotron runs (benchmarks/data/nanotron_ultrascale_h100.csv, source and stack in
benchmarks/data/README.md): every combination of dp, tp, pp, micro-batch, accumulation and ZeRO-0/1 its authors ran
for 1B, 3B, 8B and 80B Llamas at 4,096 tokens and a 1M-token batch, each timed on its third step. This is the
largest published set of alternative plans of one model on one cluster we know of: what a planner has to rank.
Each run is priced on the bundled dgx-h100 profile as nanotron ran it (:func:`plan_of`), nothing fitted; printed:
step-time errors, the bands' coverage, and per (model, nodes) the rank correlation of predicted and measured steps
and the regret of the model's pick (its fastest predicted plan's measured step over the measured best) and of the
best of its three fastest (what `autopar tune` keeps); the same on the sweep's own network as the playbook measured
it (benchmarks/data/ultrascale-h100-efa.yaml), then with that profile calibrated on the runs tune would have made on
a small allocation, the rest held out; last, how the memory model's fit verdict compares with the runs that ran and
those that crashed or ran out of memory.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from validate_published import spearman  # noqa: E402

from cost_models.step import estimate  # noqa: E402
from planner.calibrate import calibrated, calibration_spread, fit_scales  # noqa: E402
from planner.measured_runs import Run  # noqa: E402
from planner.uncertainty import in_band, step_band  # noqa: E402
from specs.cluster import ClusterSpec  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402
from specs.errors import AutoparError  # noqa: E402
from specs.model import ModelSpec  # noqa: E402
from specs.parallel import ParallelConfig  # noqa: E402
from specs.planfile import PlanFile  # noqa: E402
from specs.state import StateSpec  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "nanotron_ultrascale_h100.csv"
NETWORK = ROOT / "benchmarks" / "data" / "ultrascale-h100-efa.yaml"  # its nodes and their collectives as measured
CLUSTER = "dgx-h100"
SEQ = 4096
VOCAB = 131072
# (layers, hidden, heads, MLP width) of each model, as nanotron's scripts/scaling_benchmarks.py builds them (commit
# e24d2483): every head its own K/V (num_key_value_heads = heads), embeddings tied below an MLP width of 10,000
MODELS = {"1B": (16, 2048, 32, 8192), "3B": (28, 3072, 32, 8192), "8B": (32, 4096, 32, 14336),
          "80B": (80, 8192, 64, 28672)}


def model_of(name: str) -> ModelSpec:
    layers, hidden, heads, ffn = MODELS[name]
    return ModelSpec(name=f"nanotron-{name}", arch="llama", num_layers=layers, hidden_size=hidden,
                     num_attention_heads=heads, num_kv_heads=heads, ffn_hidden_size=ffn, vocab_size=VOCAB,
                     seq_length=SEQ, tie_embeddings=ffn < 10_000, attention="flash", dropout=0.0)


def stage_layers(name: str, pp: int) -> tuple[int, ...] | None:
    """The decoder layers on each pipeline rank, as nanotron's build_model balances its blocks: each block costs
    what LlamaModel.get_block_compute_costs says (a decoder layer 4 h^2 + 3 h f, the LM head V h, the rest nothing),
    and blocks go to a rank until their cumulative cost passes its share (rank + 1) / pp of the total, the block
    that passes it staying. None where the head passes a share before the last rank's: the blocks after it (the
    cast to fp32 and the loss) then go to the next ranks, and the logits cross a pipeline boundary, a split
    autopar's stages (the loss with the head, on the last) do not express (1B at pp=8 or 16, 3B and 8B at pp=16,
    8B at 32)."""
    layers, hidden, _, ffn = MODELS[name]
    costs = [0] + [4 * hidden * hidden + 3 * ffn * hidden] * layers + [0, VOCAB * hidden, 0, 0]
    kinds = ["embedding"] + ["layer"] * layers + ["norm", "head", "cast", "loss"]
    total, done, rank = sum(costs), 0, 0
    per_rank = [0] * pp
    for kind, cost in zip(kinds, costs):
        per_rank[rank] += kind == "layer"
        done += cost
        if kind == "head":
            return tuple(per_rank) if rank == pp - 1 else None
        if done > total * (rank + 1) / pp:
            rank += 1
    raise AssertionError("the head is always placed")


def plan_of(r: dict[str, str], own: bool = True) -> ParallelConfig | None:
    """A row's plan as nanotron ran it: tp in its REDUCE_SCATTER mode (Megatron's sequence parallelism) without
    an overlapped GEMM (its async communication only starts the gather early), the 1F1B engine over its own split
    of the layers (:func:`stage_layers`), no recompute, ZeRO-0 or ZeRO-1 (its ZeroDistributedOptimizer), and the
    data-parallel reduce inside the last micro-batch's backward (torch DDP's buckets, no_sync on the others).
    ``own=False``: the layers split evenly, as autopar prices a plan that does not give its split. None where
    nanotron's split puts the loss on a rank of its own (:func:`stage_layers`; left out either way, so that both
    price the same runs)."""
    tp, pp = int(r["tp"]), int(r["pp"])
    split = stage_layers(r["model"], pp) if pp > 1 else None
    if pp > 1 and split is None:
        return None
    return ParallelConfig(tp=tp, pp=pp, dp=int(r["dp"]), mbs=int(r["mbs"]), sp=tp > 1, tp_overlap=False,
                          recompute="none", zero=int(r["zero"]), dp_overlap=True, layers=split if own else None)


DDP_BUCKET_PARAMS = 25 * 2**20 // 2  # the bench config's ddp_bucket_cap_mb: 25 (MiB of bf16 gradients)


def state_of(own: bool = True) -> StateSpec:
    """nanotron's model state with accumulate_grad_in_fp32: bf16 weights, an fp32 gradient buffer each micro-batch's
    gradients are added to in a pass of its own, fp32 master weights, the reduce in fp32 (its DDP hook, in torch
    DDP's 25 MiB buckets); ZeRO-1's all-gather of the updated parameters right after the optimizer step
    (ZeroDistributedOptimizer.step), and its loss over the whole logits (a vocab-parallel cross-entropy in fp32).
    ``own=False``: the loss alone, the rest autopar's defaults (the gather hidden, Megatron's buckets)."""
    if not own:
        return StateSpec.default("bf16").model_copy(update={"full_logits": True})
    return StateSpec.default("bf16").model_copy(update={"full_logits": True, "param_gather_after_step": True,
                                                        "bucket_params": DDP_BUCKET_PARAMS})


def cluster_of(nodes: int):
    """The bundled dgx-h100 profile at ``nodes`` nodes (8 H100 SXM and 3.2 Tb/s each, as the cluster's AWS p5
    nodes with EFA), tensor parallelism allowed across nodes as the sweep ran it."""
    return load_cluster(CLUSTER, gpus=8 * nodes).model_copy(update={"tp_across_nodes": True})


H100_BF16_TFLOPS = 989.5  # the dense BF16 peak the page's MFU divides by


def page_mfu(r: dict[str, str]) -> float:
    """A run's MFU (%) as nanotron counts it from its tokens/s: 6 x parameters + 12 x layers x hidden x sequence
    FLOPs a token on 989.5 TFLOP/s, a tied embedding counted twice when pipelined (each end holds a copy)."""
    m = model_of(r["model"])
    if int(r["pp"]) > 1 and m.tie_embeddings:
        m = m.model_copy(update={"tie_embeddings": False})
    flops = 6 * m.num_params + 12 * m.num_layers * m.hidden_size * SEQ
    return float(r["tokens_per_s_per_gpu"]) * flops / (H100_BF16_TFLOPS * 1e12) * 100


def rows() -> list[dict[str, str]]:
    with open(DATA) as f:
        return list(csv.DictReader(f))


def runs(own: bool = True) -> tuple[list[dict], list[str]]:
    """Every consistent row (its global batch equal to dp x mbs x accumulation) with its plan file and, where it ran,
    its measured step (``own``: priced with nanotron's own layer split, gather and buckets); notes on those left
    out."""
    out, notes, state = [], [], state_of(own)
    for r in rows():
        dp, mbs, acc = int(r["dp"]), int(r["mbs"]), int(r["grad_accum"])
        if dp * mbs * acc != int(r["global_batch"]):
            notes.append(f"{r['model']} on {r['nodes']} nodes, dp={dp} mbs={mbs} accumulation {acc}: the page says "
                         f"global batch {r['global_batch']}, not {dp * mbs * acc}")
            continue
        if r["status"] == "ran" and abs(page_mfu(r) - float(r["mfu_percent"])) >= 0.1:  # the page rounds to 0.1%
            notes.append(f"{r['model']} on {r['nodes']} nodes, tp={r['tp']} pp={r['pp']} dp={dp} mbs={mbs}: its "
                         f"MFU {r['mfu_percent']}% is not what its {r['tokens_per_s_per_gpu']} tokens/s give "
                         f"({page_mfu(r):.1f}%): two runs' numbers in one point")
            continue
        nodes, cfg = int(r["nodes"]), plan_of(r, own)
        row = {"model": r["model"], "nodes": nodes, "plan": f"tp={r['tp']} pp={r['pp']} dp={dp} mbs={mbs}"
               f"{' zero=1' if r['zero'] != '0' else ''}", "pp": int(r["pp"]), "zero": int(r["zero"]),
               "ran": r["status"] == "ran"}
        if row["ran"]:
            row["measured_s"] = int(r["global_batch"]) * SEQ / (float(r["tokens_per_s_per_gpu"]) * 8 * nodes)
            row["measured_GB"] = float(r["gpu_memory_GB"])
        if cfg is None:
            row["refused"] = ("nanotron's split puts the loss on a rank after the head's: the logits cross a pipeline "
                              "boundary, which autopar's stages do not express")
        else:
            row["planfile"] = PlanFile(model=model_of(r["model"]), cluster=cluster_of(nodes),
                                       global_batch=int(r["global_batch"]), seq=SEQ, parallel=cfg.to_dict(),
                                       state=state)
        out.append(row)
    return out, notes


def price(out: list[dict], base: ClusterSpec, key: str, spread: bool = False) -> None:
    """Each row's predicted step (``key``) on ``base`` sized as the row's cluster, its memory and fit verdict; with
    ``spread`` its band widened by what ``base``'s calibration leaves uncertain; ``refused`` where autopar's rules
    refuse the plan."""
    for row in out:
        if "refused" in row:
            continue
        plan = row["planfile"]
        cl = base.resized(gpus=plan.cluster.num_gpus).model_copy(update={"tp_across_nodes": True})
        try:
            est = estimate(plan.model, cl, plan.config, plan.global_batch, state=plan.state)
        except AutoparError as e:
            row["refused"] = str(e)
            continue
        row[key] = est.step_time_s
        row.setdefault("predicted_GiB", est.memory_GiB)
        row.setdefault("first_stage_GiB", est.stage_memory_GiB[0])
        row.setdefault("predicted_fits", bool(est.fits))
        if spread and row["ran"]:
            sd, _ = calibration_spread(plan.model, cl, plan.config, plan.global_batch, plan.state)
            low, high = step_band(plan.config.pp, est.step_time_s, sd)
            row["calibrated_in_band"] = bool(low <= row["measured_s"] <= high)


def calibration_set(out: list[dict], key: str, finalists: int = 3) -> list[int]:
    """The runs `autopar tune` would have measured on a small allocation: for each model on the smallest cluster it
    ran on (one node for 1B, 3B and 8B; four for 80B), the ``finalists`` measured plans predicted fastest (``key``;
    a plan measured twice: both runs)."""
    smallest = {m: min(r["nodes"] for r in out if r["model"] == m and r["ran"]) for m in MODELS}
    chosen = []
    for m in MODELS:
        idx = [i for i, r in enumerate(out) if r["model"] == m and r["nodes"] == smallest[m] and r["ran"]
               and "refused" not in r]
        plans = sorted({out[i]["plan"]: out[i][key] for i in idx}.items(), key=lambda kv: kv[1])
        keep = {p for p, _ in plans[:finalists]}
        chosen += [i for i in idx if out[i]["plan"] in keep]
    return chosen


def rankings(timed: list[dict], key: str, finalists: int = 3) -> list[dict]:
    """Per (model, nodes) with 3 or more plans measured: each plan's median measured step over its runs, the rank
    correlation with the predicted steps (``key``), the regret of the model's pick (its measured step over the
    measured best) and that of the best measured of its ``finalists`` fastest predicted plans (what `autopar tune`
    with that many trials would keep)."""
    groups: dict[tuple[str, int], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in timed:
        groups[(r["model"], r["nodes"])][r["plan"]].append(r)
    out = []
    for (model, nodes), plans in groups.items():
        names = list(plans)
        if len(names) < 3:
            continue
        meas = [statistics.median(x["measured_s"] for x in plans[p]) for p in names]
        pred = [plans[p][0][key] for p in names]
        best = min(meas)
        by_pred = sorted(range(len(names)), key=lambda i: pred[i])
        top = min(range(len(names)), key=lambda i: meas[i])
        out.append({"model": model, "nodes": nodes, "plans": len(names), "spearman": spearman(meas, pred),
                    "model_pick": names[by_pred[0]], "regret": meas[by_pred[0]] / best - 1,
                    "tuned_regret": min(meas[i] for i in by_pred[:finalists]) / best - 1,
                    "measured_best": names[top], "best_predicted_rank": by_pred.index(top) + 1,
                    "best_error": pred[top] / meas[top] - 1})
    order = list(MODELS)
    return sorted(out, key=lambda g: (order.index(g["model"]), g["nodes"]))


def repeats(timed: list[dict]) -> list[float]:
    """Slowest over fastest measured step of every plan the page shows measured more than once."""
    same: dict[tuple, list[float]] = defaultdict(list)
    for r in timed:
        same[(r["model"], r["nodes"], r["plan"])].append(r["measured_s"])
    return [max(v) / min(v) for v in same.values() if len(v) > 1]


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def errors_table(timed: list[dict], key: str, band) -> None:
    print(f"{'model':5} {'runs':>5} {'median':>8} {'p10':>8} {'p90':>8} {'within 10%':>11} {'in band':>8}")
    for m in [*MODELS, "all"]:
        sel = [r for r in timed if m in (r["model"], "all")]
        if not sel:
            continue
        errs = [r[key] / r["measured_s"] - 1 for r in sel]
        covered = sum(band(r) for r in sel)
        print(f"{m:5} {len(sel):5} {statistics.median(errs):+8.1%} {_pct(errs, 0.1):+8.1%} {_pct(errs, 0.9):+8.1%} "
              f"{sum(abs(e) <= 0.10 for e in errs):5}/{len(errs):<5} {covered / len(sel):8.0%}")


def ranking_table(ranks: list[dict]) -> None:
    print(f"{'model':5} {'nodes':>5} {'plans':>5} {'spearman':>8} {'regret':>7} {'top-3':>7}  {'model pick':38} "
          "measured best (its predicted rank)")
    for g in ranks:
        print(f"{g['model']:5} {g['nodes']:5} {g['plans']:5} {g['spearman']:8.2f} {g['regret']:+7.1%} "
              f"{g['tuned_regret']:+7.1%}  {g['model_pick']:38} {g['measured_best']} ({g['best_predicted_rank']})")
    rs, ts = [g["regret"] for g in ranks], [g["tuned_regret"] for g in ranks]
    be = [g["best_error"] for g in ranks]
    print(f"the measured best plan of each: predicted / measured - 1 median {statistics.median(be):+.1%}, from "
          f"{min(be):+.1%} to {max(be):+.1%}")
    print(f"rank correlation median {statistics.median(g['spearman'] for g in ranks):.2f}; regret of the pick median "
          f"{statistics.median(rs):.1%} (within 5% of the best in {sum(x <= 0.05 for x in rs)} of {len(rs)}); of the "
          f"best of the top 3 median {statistics.median(ts):.1%} (within 5% in {sum(x <= 0.05 for x in ts)} of "
          f"{len(ts)})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every row and summary here")
    ap.add_argument("--autopar-defaults", action="store_true",
                    help="price the runs with autopar's defaults where the stack differs (layers split evenly, ZeRO's "
                         "gather hidden, Megatron's buckets): how much nanotron's own mechanisms move the numbers")
    args = ap.parse_args()
    out, notes = runs(own=not args.autopar_defaults)
    for n in notes:
        print(f"left out: {n}")
    base = load_cluster(CLUSTER)
    price(out, base, "bundled_s")
    refused = [r for r in out if "refused" in r]
    timed = [r for r in out if r["ran"] and "refused" not in r]
    apart = [r for r in refused if r["refused"].startswith("nanotron's split")]
    ruled = [r for r in refused if r not in apart]
    print(f"{len(out)} rows: {sum(r['ran'] for r in out)} ran, {sum(not r['ran'] for r in out)} crashed or ran out of "
          f"memory; left out: {len(apart)} ({sum(r['ran'] for r in apart)} ran) whose loss nanotron puts on a rank "
          f"after the head's, {len(ruled)} refused by autopar's rules"
          + (f" (e.g. {ruled[0]['model']} {ruled[0]['plan']}: {ruled[0]['refused']})" if ruled else ""))
    slow = [r for r in timed if r["measured_s"] > 3 * min(x["measured_s"] for x in timed
                                                           if (x["model"], x["nodes"]) == (r["model"], r["nodes"]))]
    print(f"runs measured more than 3x slower than the best plan of their model and cluster size: {len(slow)} of "
          f"{len(timed)}")
    rep = repeats(timed)
    print(f"plans measured more than once: {len(rep)}; slowest / fastest run of the same plan: median "
          f"x{statistics.median(rep):.2f}, max x{max(rep):.2f}")

    print("\n== step time, predicted / measured - 1 (bundled dgx-h100, nothing fitted)")
    errors_table(timed, "bundled_s", lambda r: in_band(r["pp"] > 1, r["measured_s"], r["bundled_s"]))
    print("\n== ranking per model and cluster size (bundled): plans measured (median of repeats), rank correlation, "
          "regret of the model's pick and of the best of its 3 fastest predicted (tune's default trials)")
    bundled_ranks = rankings(timed, "bundled_s")
    ranking_table(bundled_ranks)

    network = load_cluster(str(NETWORK))
    price(out, network, "network_s")
    print(f"\n== on the sweep's own network as the playbook measured it ({NETWORK.name}: its collectives' bus "
          "bandwidth at 1-64 nodes), nothing fitted")
    errors_table(timed, "network_s", lambda r: in_band(r["pp"] > 1, r["measured_s"], r["network_s"]))
    network_ranks = rankings(timed, "network_s")
    ranking_table(network_ranks)

    cal = calibration_set(out, "network_s")
    fit_runs = [Run(source=f"{out[i]['model']} {out[i]['plan']}", plan=out[i]["planfile"],
                    measured_s=out[i]["measured_s"], steps=1, logged_prediction_s=None) for i in cal]
    print(f"\n== that profile calibrated (autopar calibrate's fit) on {len(cal)} runs, tune's 3 finalists on each "
          "model's smallest cluster (" + "; ".join(f"{out[i]['model']} {out[i]['plan']}" for i in cal)
          + "), the rest held out", flush=True)
    fit = fit_scales(fit_runs, network)
    print("  scales: " + ", ".join(f"{k} {v:.3f}" for k, v in fit.scales.items()))
    price(out, calibrated(network, fit), "calibrated_s", spread=True)
    held = [r for i, r in enumerate(out) if r["ran"] and "refused" not in r and i not in set(cal)]
    errors_table(held, "calibrated_s", lambda r: r["calibrated_in_band"])
    print("(in band: the bands widened by the fit's own uncertainty, as `plan` shows them on a calibrated profile)")
    held_ranks = rankings(held, "calibrated_s")
    ranking_table(held_ranks)

    print("\n== memory: the fit verdict (80 GiB, no headroom) against what ran")
    ran = [r for r in out if r["ran"] and "predicted_fits" in r]
    crashed = [r for r in out if not r["ran"] and "predicted_fits" in r]
    print(f"ran, predicted to fit: {sum(r['predicted_fits'] for r in ran)} of {len(ran)}")
    print(f"crashed or out of memory, predicted not to fit: {sum(not r['predicted_fits'] for r in crashed)} of "
          f"{len(crashed)} (the page does not say which were out of memory)")
    mem = [r["first_stage_GiB"] / r["measured_GB"] - 1 for r in ran]
    print(f"rank 0's predicted peak (first stage) / the page's GPU memory (GiB) - 1: median "
          f"{statistics.median(mem):+.1%}, p10 {_pct(mem, 0.1):+.1%}, p90 {_pct(mem, 0.9):+.1%}")
    if args.json:
        keep = [{k: v for k, v in r.items() if k != "planfile"} for r in out]
        Path(args.json).write_text(json.dumps({"rows": keep, "bundled_rankings": bundled_ranks,
                                               "network_rankings": network_ranks,
                                               "calibrated_rankings": held_ranks, "scales": fit.scales,
                                               "left_out": notes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
