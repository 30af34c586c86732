"""Reproduce published Megatron-LM iteration times with autopar's cost model; print per-row and mean error.

    python benchmarks/validate_published.py [--json out.json]

Korthikanti et al. 2022 (plans fully given) and Narayanan et al. 2021 Table 1 (tp, pp and full recompute
given; micro-batch size and interleave degree are not published, so the planner searches them with those
keys fixed, on the same Selene cluster profile). No constant here is fitted per row: the cluster is the
bundled `selene` profile and the models are plain GPT specs built from each row.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cost_models.headroom import default_headroom_GiB  # noqa: E402
from cost_models.memory import layer_activation_bytes  # noqa: E402
from cost_models.step import estimate  # noqa: E402
from specs.cluster_loading import load_cluster  # noqa: E402
from specs.model import ModelSpec  # noqa: E402
from specs.parallel import RECOMPUTE_CODE, ParallelConfig  # noqa: E402
from specs.state import StateSpec  # noqa: E402

DATA = ROOT / "benchmarks" / "data"


def _rows(name: str) -> list[dict[str, str]]:
    with open(DATA / name) as f:
        return list(csv.DictReader(f))


def _gpt(name: str, row: dict[str, str]) -> ModelSpec:
    return ModelSpec(name=name, arch="gpt", num_layers=int(row["layers"]), hidden_size=int(row["hidden"]),
                     num_attention_heads=int(row["heads"]), vocab_size=int(row["vocab"]), seq_length=int(row["seq"]))


# Whether each published set's stack added the weight gradients into the fp32 buffer inside the GEMMs (Megatron-LM's
# --gradient-accumulation-fusion) or in a pass of its own, as autopar's runtime does: Megatron-LM had the fusion
# by 2022 (apex ported it from there in February 2022, NVIDIA/apex#1297), the Megatron-LM of Narayanan et al.'s
# early-2021 runs added each micro-batch's gradients in a hook, and BigScience's Megatron-DeepSpeed fork has no
# fusion (plain F.linear in its tensor-parallel layers; its 16-bit gradients move 6 bytes a parameter, priced as 10).
# NeMo 24.09/24.05 (NVIDIA's DGX Cloud benchmark recipes 24.11, benchmarks/validate_h100.py) sets
# gradient_accumulation_fusion: true in every config it ran.
FUSED_ACCUMULATION = {"korthikanti2022": True, "narayanan2021": False, "bigscience_tr11_topology": False,
                      "nvidia_dgxc_h100": True}


def published_state(cluster, name: str) -> StateSpec:
    """The model state of published set ``name``: Megatron-LM's mixed precision, its gradient accumulation
    (:data:`FUSED_ACCUMULATION`), and a loss over the whole logits (vocab-parallel cross-entropy on the full
    [tokens, vocab shard] in fp32), where autopar's fused loss computes them a chunk at a time."""
    return StateSpec.default(cluster.precision).model_copy(
        update={"fused_accumulation": FUSED_ACCUMULATION[name], "full_logits": True})


def korthikanti() -> list[dict]:
    """Every row of Korthikanti et al. 2022 with the paper's plan: predicted vs measured iteration time."""
    out = []
    for row in _rows("korthikanti2022.csv"):
        model = _gpt(row["model"], row)
        cluster = load_cluster("selene", gpus=int(row["gpus"]))
        cfg = ParallelConfig(tp=int(row["tp"]), pp=int(row["pp"]), dp=int(row["dp"]), mbs=int(row["micro_batch"]),
                             vpp=int(row["vpp"]), recompute=row["recompute"], sp=row["sp"] == "true")
        est = estimate(model, cluster, cfg, int(row["global_batch"]), state=published_state(cluster, "korthikanti2022"))
        meas = float(row["iteration_time_s"])
        out.append({"model": row["model"], "plan": cfg.short(), "measured_s": meas, "predicted_s": est.step_time_s,
                    "error": (est.step_time_s - meas) / meas, "memory_GiB": est.memory_GiB})
    return out


def alternative_pairs(rows: list[dict]) -> list[dict]:
    """Korthikanti 2022 measured two plans of each model on the same GPUs (full recompute without sequence
    parallelism, and selective recompute with it): a sweep of two alternatives per model. Per model, the measured
    and predicted speedup of the second over the first and whether the model ranks them as measured."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        full, sel = (next(r for r in rows if r["model"] == model and f"recompute={k}" in r["plan"])
                     for k in ("full", "selective"))
        measured, predicted = full["measured_s"] / sel["measured_s"], full["predicted_s"] / sel["predicted_s"]
        out.append({"model": model, "measured_speedup": measured, "predicted_speedup": predicted,
                    "same_order": (measured > 1) == (predicted > 1)})
    return out


def korthikanti_activation_check() -> list[dict]:
    """Per-layer activation bytes against the paper's closed forms (GPT, 16-bit, dropout on)."""
    out = []
    for row in _rows("korthikanti2022.csv"):
        if row["recompute"] != "full":
            continue
        m = _gpt(row["model"], row)
        s, b, h, a, t = m.seq_length, 1, m.hidden_size, m.num_attention_heads, int(row["tp"])
        sbh = s * b * h
        paper = {
            ("none", False): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
            ("none", True): sbh / t * (34 + 5 * a * s / h),
            ("selective", False): sbh * (10 + 24 / t),
            ("selective", True): sbh * 34 / t,
            ("full", False): 2 * sbh,
        }
        for (rc, sp), want in paper.items():
            full, ckpt, _ = layer_activation_bytes(m, 2, t, 1, b, sp, RECOMPUTE_CODE[rc])
            got = float(ckpt if rc == "full" else full)
            out.append({"model": row["model"], "recompute": rc, "sp": sp, "paper_bytes": want, "model_bytes": got,
                        "error": (got - want) / want})
    return out


def narayanan() -> list[dict]:
    """Table 1 of Narayanan et al. 2021; mbs and vpp searched by the planner with tp/pp/dp/recompute fixed."""
    from planner.search import search

    out = []
    for row in _rows("narayanan2021_table1.csv"):
        model = _gpt(f"{row['params_b']}B", row)
        gpus, B = int(row["gpus"]), int(row["global_batch"])
        tp, pp = int(row["tp"]), int(row["pp"])
        cluster = load_cluster("selene", gpus=gpus)
        s, L, h, V = model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
        flops = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
        meas = flops / (float(row["tflops_per_gpu"]) * 1e12 * gpus)
        # the paper's setting: full recompute of every layer, even layer split, no SP / ZeRO / overlap
        fixed = {"tp": tp, "pp": pp, "dp": gpus // (tp * pp), "cp": 1, "recompute": "full", "recompute_layers": None,
                 "layers": None, "sp": False, "zero": 0, "dp_overlap": False, "tp_overlap": False}
        res = search(model, cluster, B, fixed=fixed, top=1, headroom_GiB=0.0,
                     state=published_state(cluster, "narayanan2021"))
        best = res.plans[0]
        out.append({"model": model.name, "plan": best.config.short(), "measured_s": meas,
                    "predicted_s": best.estimate.step_time_s,
                    "error": (best.estimate.step_time_s - meas) / meas, "memory_GiB": best.estimate.memory_GiB})
    return out


def paired_rows() -> list[dict]:
    """Narayanan 2021 rows whose pipelines do exactly the work of a Korthikanti 2022 row (same model, tp, pp, full
    recompute, and global batch / dp equal to the 2022 batch): the measured ratio shows what data parallelism plus
    the older code base cost; the predicted ratio (same mbs and vpp as the 2022 row) is what the model charges for
    the data-parallel reduce alone."""
    out = []
    for n in _rows("narayanan2021_table1.csv"):
        tp, pp, gpus, B = int(n["tp"]), int(n["pp"]), int(n["gpus"]), int(n["global_batch"])
        dp = gpus // (tp * pp)
        for k in _rows("korthikanti2022.csv"):
            same = (k["hidden"], k["layers"], k["heads"], k["tp"], k["pp"]) == (n["hidden"], n["layers"], n["heads"],
                                                                            n["tp"], n["pp"])
            if not same or k["recompute"] != "full" or int(k["global_batch"]) * dp != B:
                continue
            model = _gpt(k["model"], k)
            s, L, h, V = model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
            meas_n = 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)) / (
                float(n["tflops_per_gpu"]) * 1e12 * gpus)
            meas_k = float(k["iteration_time_s"])
            cfg = ParallelConfig(tp=tp, pp=pp, dp=1, mbs=int(k["micro_batch"]), vpp=int(k["vpp"]), recompute="full")
            ck, cn = load_cluster("selene", gpus=tp * pp), load_cluster("selene", gpus=gpus)
            pred_k = estimate(model, ck, cfg, int(k["global_batch"]),
                              state=published_state(ck, "korthikanti2022")).step_time_s
            pred_n = estimate(model, cn, replace(cfg, dp=dp), B, state=published_state(cn, "narayanan2021")).step_time_s
            out.append({"model": k["model"], "plan": cfg.short(), "dp_2021": dp, "measured_2022_s": meas_k,
                        "measured_2021_s": meas_n, "predicted_dp1_s": pred_k, "predicted_dp_s": pred_n,
                        "measured_ratio": meas_n / meas_k, "predicted_ratio": pred_n / pred_k})
    return out


# BigScience's BLOOM topology sweep (tr11 prequel, 2022-02-25): one model, 48 nodes of Jean Zay, many plans.
BLOOM_SWEEP = ModelSpec(name="bloom-181b", arch="gpt", num_layers=72, hidden_size=14336, num_attention_heads=64,
                        vocab_size=250880, seq_length=2048, tie_embeddings=True)


def price_bloom_plan(model: ModelSpec, cluster, row: dict[str, str], layers: tuple[int, ...] | None = None) -> dict:
    """One plan of BigScience's BLOOM sweeps (a CSV row: dp, tp, pp, micro_batch, global_batch, memory_GB,
    sec_per_iteration or ``oom``), measured vs predicted: time per sample and peak memory, or whether it fits.

    The sweeps' setting (Megatron-DeepSpeed): fp16, ZeRO-1, full recompute, plain 1F1B, no SP or overlap, and the
    transformer layers split over the stages as its GPTModelPipe's partition_method 'type:transformer' does
    (``layers``, default even; the chronicle switched to 'type:transformer|embedding' only after these tables), the
    embedding on the first and last stage besides."""
    from planner.search import search

    dp, tp, pp, mbs, B = (int(row[k]) for k in ("dp", "tp", "pp", "micro_batch", "global_batch"))
    fixed = {"tp": tp, "pp": pp, "dp": dp, "mbs": mbs, "vpp": 1, "cp": 1, "recompute": "full",
             "recompute_layers": None, "sp": False, "zero": 1, "dp_overlap": False, "tp_overlap": False,
             "layers": layers or (model.num_layers // pp,) * pp}
    plans = search(model, cluster, B, fixed=fixed, top=1, headroom_GiB=0.0,
                   state=published_state(cluster, "bigscience_tr11_topology")).plans
    oom = row["sec_per_iteration"] == "oom"
    r = {"plan": f"tp={tp} pp={pp} dp={dp} mbs={mbs}", "tp": tp, "global_batch": B, "measured_oom": oom,
         "predicted_fits": bool(plans)}
    if not oom:
        r["measured_s_per_sample"] = float(row["sec_per_iteration"]) / B
    if plans:
        r["predicted_s_per_sample"] = plans[0].estimate.step_time_s / B
        r["predicted_GiB"] = plans[0].estimate.memory_GiB
    if row["memory_GB"]:
        r["measured_GiB"] = float(row["memory_GB"])
    return r


def bloom_topology() -> list[dict]:
    """Every plan of the BLOOM topology sweep (:func:`price_bloom_plan`): 72 layers split evenly."""
    cluster = load_cluster(str(DATA / "jean-zay-a100.yaml"))
    return [price_bloom_plan(BLOOM_SWEEP, cluster, row) for row in _rows("bigscience_tr11_topology.csv")]


def _ranks(x: list[float]) -> list[float]:
    """Ranks from 0, ties sharing their average rank."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    r = [0.0] * len(x)
    pos = 0
    while pos < len(order):
        end = pos
        while end + 1 < len(order) and x[order[end + 1]] == x[order[pos]]:
            end += 1
        for k in range(pos, end + 1):
            r[order[k]] = (pos + end) / 2
        pos = end + 1
    return r


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (ties share their average rank); nan when either side has one value only."""
    ra, rb = _ranks(a), _ranks(b)
    m = (len(a) - 1) / 2
    cov = sum((x - m) * (y - m) for x, y in zip(ra, rb))
    var = (sum((x - m) ** 2 for x in ra) * sum((y - m) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def topology_summary(rows: list[dict]) -> dict:
    """How the model ranks the sweep: rank correlation of per-sample times, the measured cost of taking the
    model's favourite (regret), memory error, and out-of-memory agreement."""
    timed = [r for r in rows if "measured_s_per_sample" in r and "predicted_s_per_sample" in r]
    meas = [r["measured_s_per_sample"] for r in timed]
    pred = [r["predicted_s_per_sample"] for r in timed]
    n = len(timed)
    best = min(meas)
    pick = timed[min(range(n), key=lambda i: pred[i])]
    mem = [(r["predicted_GiB"] - r["measured_GiB"]) / r["measured_GiB"] for r in rows
           if "measured_GiB" in r and "predicted_GiB" in r]
    time_err = [(p - m) / m for m, p in zip(meas, pred)]
    best_tp8 = min(m for m, r in zip(meas, timed) if r["tp"] == 8)
    return {"spearman": spearman(meas, pred), "model_pick": pick["plan"],
            "regret": pick["measured_s_per_sample"] / best - 1,
            "best_tp8_vs_best": best_tp8 / best - 1, "share_faster_than_best_tp8": sum(m < best_tp8 for m in meas) / n,
            "mean_abs_time_error": sum(map(abs, time_err)) / n, "mean_time_error": sum(time_err) / n,
            "mean_abs_memory_error": sum(map(abs, mem)) / len(mem), "max_abs_memory_error": max(map(abs, mem)),
            "max_under_GiB": max(r["measured_GiB"] - r["predicted_GiB"] for r in rows
                                 if "measured_GiB" in r and "predicted_GiB" in r),
            "fit_agreement": sum(r["predicted_fits"] != r["measured_oom"] for r in rows) / len(rows)}


# What Narayanan 2021 Table 1 uses: tp, pp, dp, micro-batch, interleaving and full recompute; nothing newer.
PAPER_FEATURES = {"cp": 1, "recompute": "full", "recompute_layers": None, "layers": None, "sp": False, "zero": 0,
                  "dp_overlap": False, "tp_overlap": False}


def feasible_exact(model: ModelSpec, cluster, B: int, fixed: dict) -> list[tuple[float, ParallelConfig]]:
    """(step time, plan) for every plan in the space restricted by ``fixed`` that fits, priced exactly (with
    Narayanan et al.'s stack, whose rows it ranks)."""
    import numpy as np

    from cost_models.batch import estimate_batch
    from planner.space import enumerate_space

    cands = enumerate_space(model, cluster, B, fixed)
    res = estimate_batch(model, cluster, cands, B, state=published_state(cluster, "narayanan2021"))
    out = []
    for i in np.nonzero(res.memory_GiB <= cluster.gpu.memory_GiB * 1.1)[0]:  # the closed form is conservative
        cfg = cands.config(int(i))
        e = estimate(model, cluster, cfg, B, validate=False, state=published_state(cluster, "narayanan2021"))
        if e.fits:
            out.append((e.step_time_s, cfg))
    return out


def paper_rank(row: dict[str, str], pipeline_penalty: float = 0.0,
               plans: list[tuple[float, ParallelConfig]] | None = None) -> dict:
    """Where the paper's (tp, pp), with its best mbs / vpp, ranks among the feasible plans built from the paper's
    features: the fraction predicted strictly faster. ``pipeline_penalty`` multiplies every pp > 1 plan's time
    by (1 + penalty) — a sensitivity check, not part of the model."""
    model = _gpt(row["params_b"], row)
    gpus, B, tp, pp = int(row["gpus"]), int(row["global_batch"]), int(row["tp"]), int(row["pp"])
    if plans is None:
        plans = feasible_exact(model, load_cluster("selene", gpus=gpus), B, PAPER_FEATURES)
    timed = [(t * (1 + pipeline_penalty if c.pp > 1 else 1.0), c) for t, c in plans]
    paper = min(t for t, c in timed if c.tp == tp and c.pp == pp)
    best_t, best = min(timed, key=lambda x: x[0])
    faster = sum(1 for t, _ in timed if t < paper * (1 - 1e-9))
    return {"model": f"{row['params_b']}B", "paper_s": paper, "best_s": best_t, "best_plan": best.short(),
            "faster": faster, "feasible": len(timed), "rank": faster / len(timed)}


def residual_rows(sets: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """measured / predicted step time of every timed row of each published set, with whether the plan is
    pipelined (what planner/residuals.json holds and planner/uncertainty.py turns into bands)."""
    out = {}
    for name, rows in sets.items():
        out[name] = []
        for r in rows:
            meas = r.get("measured_s", r.get("measured_s_per_sample"))
            pred = r.get("predicted_s", r.get("predicted_s_per_sample"))
            if meas is None or pred is None:
                continue
            pp = int(r["plan"].split("pp=")[1].split()[0])
            out[name].append({"plan": r["plan"], "pipelined": pp > 1, "ratio": round(meas / pred, 6)})
    return out


def summary(rows: list[dict]) -> dict:
    errs = [abs(r["error"]) for r in rows]
    return {"mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs), "rows": len(rows)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write all rows and summaries to this file")
    ap.add_argument("--write-residuals", metavar="PATH",
                    help="write measured/predicted of every row (planner/residuals.json: the plans' +- bands)")
    ap.add_argument("--ranks", action="store_true",
                    help="also rank the paper's configurations among all feasible paper-feature plans (~1 min)")
    args = ap.parse_args()
    result, timed = {}, {}
    for name, fn in (("korthikanti2022", korthikanti), ("narayanan2021", narayanan)):
        rows = timed[name] = fn()
        result[name] = {**summary(rows), "rows": rows}
        print(f"\n{name}")
        print(f"{'model':8} {'plan':52} {'measured':>9} {'predicted':>9} {'error':>7}")
        for r in rows:
            print(f"{r['model']:8} {r['plan']:52} {r['measured_s']:9.2f} {r['predicted_s']:9.2f} "
                  f"{r['error'] * 100:6.1f}%")
        s = result[name]
        print(f"mean |error| {s['mean_abs_error'] * 100:.2f}%   max |error| {s['max_abs_error'] * 100:.2f}%")
    alts = alternative_pairs(timed["korthikanti2022"])
    result["korthikanti2022_alternatives"] = alts
    print("\nKorthikanti 2022, two plans per model on the same GPUs: speedup of selective recompute + SP over full "
          "recompute")
    for a in alts:
        wrong = "" if a["same_order"] else "  ORDER WRONG"
        print(f"{a['model']:8} measured x{a['measured_speedup']:.3f}  predicted x{a['predicted_speedup']:.3f}  "
              f"({a['predicted_speedup'] / a['measured_speedup'] - 1:+.1%}){wrong}")
    print(f"ranked as measured: {sum(a['same_order'] for a in alts)} of {len(alts)} models (regret 0 where right)")
    pairs = paired_rows()
    result["paired_2021_2022"] = pairs
    print("\nsame pipeline work, 2022 (dp=1) vs 2021 (dp>1): measured and predicted time ratios")
    for r in pairs:
        print(f"{r['model']:8} {r['plan']:40} dp={r['dp_2021']:<3} measured x{r['measured_ratio']:.3f}  "
              f"predicted x{r['predicted_ratio']:.3f}")
    sweep = bloom_topology()
    ts = topology_summary(sweep)
    result["bigscience_tr11_topology"] = {"rows": sweep, **ts}
    print("\nBigScience BLOOM topology sweep (48 Jean Zay nodes): measured vs predicted ms per sample, memory GiB")
    for r in sweep:
        m = f"{r['measured_s_per_sample'] * 1e3:6.1f}" if "measured_s_per_sample" in r else "   OOM"
        p = f"{r['predicted_s_per_sample'] * 1e3:6.1f}" if "predicted_s_per_sample" in r else " no fit"
        mg = f"{r['measured_GiB']:4.0f}" if "measured_GiB" in r else "   -"
        pg = f"{r['predicted_GiB']:5.1f}" if "predicted_GiB" in r else "    -"
        print(f"  {r['plan']:26} {m} {p}   {mg} {pg}")
    print(f"rank correlation {ts['spearman']:.2f}; model's pick {ts['model_pick']} measures {ts['regret']:+.1%} vs "
          f"the measured best; best tp=8 plan {ts['best_tp8_vs_best']:+.1%} ({ts['share_faster_than_best_tp8']:.0%} "
          f"of runs faster); "
          f"time error mean {ts['mean_time_error']:+.1%}; memory |error| mean {ts['mean_abs_memory_error']:.1%} "
          f"max {ts['max_abs_memory_error']:.1%}; fits/OOM agree {ts['fit_agreement']:.0%}; measured peak above "
          f"the prediction by up to {ts['max_under_GiB']:.1f} GiB (the default --headroom, "
          f"{default_headroom_GiB(80.0):.0f} GiB of these 80 GiB GPUs, "
          f"{'covers it' if ts['max_under_GiB'] <= default_headroom_GiB(80.0) else 'does not cover it'})")
    from validate_h100 import nemo  # the H100 set (NVIDIA's DGX Cloud recipes), priced in benchmarks/validate_h100.py

    residuals = residual_rows({**timed, "bigscience_tr11_topology": sweep, "nvidia_dgxc_h100": nemo()})
    from planner.uncertainty import coverage

    print("\n+- bands (planner/uncertainty.py), each row's from the other rows, cover the measured step of "
          + ", ".join(f"{c:.0%} of {name}" for name, c in coverage(residuals).items())
          + "; each set's from the other sets only (a stack the bands have not seen): "
          + ", ".join(f"{c:.0%} of {name}" for name, c in coverage(residuals, "set").items()))
    if args.write_residuals:
        Path(args.write_residuals).write_text(json.dumps(
            {"source": "python benchmarks/validate_published.py --write-residuals planner/residuals.json",
             "sets": residuals}, indent=1) + "\n")
    acts = korthikanti_activation_check()
    worst = max(abs(a["error"]) for a in acts)
    result["korthikanti2022_activations"] = {"rows": acts, "max_abs_error": worst}
    print(f"\nactivation memory vs Korthikanti's formulas: {len(acts)} cases, max |error| {worst * 100:.2f}%")
    if args.ranks:
        penalties = (0.0, round(max(r["measured_ratio"] / r["predicted_ratio"] for r in pairs) - 1, 3), 0.15)
        print(f"\nrank of the paper's configuration (fraction of feasible plans predicted faster), with every "
              f"pp>1 plan slowed by {', '.join(f'{p:.1%}' for p in penalties)}")
        ranks = []
        for row in _rows("narayanan2021_table1.csv"):
            model = _gpt(row["params_b"], row)
            gpus, B = int(row["gpus"]), int(row["global_batch"])
            plans = feasible_exact(model, load_cluster("selene", gpus=gpus), B, PAPER_FEATURES)
            rs = [paper_rank(row, p, plans) for p in penalties]
            ranks.append({"model": rs[0]["model"], "penalties": list(penalties), "ranks": [r["rank"] for r in rs],
                          "feasible": rs[0]["feasible"], "best_plan": rs[0]["best_plan"],
                          "best_vs_paper": rs[0]["best_s"] / rs[0]["paper_s"]})
            print(f"{rs[0]['model']:8} {rs[0]['feasible']:4} plans  " + "  ".join(f"{r['rank']:6.1%}" for r in rs)
                  + f"   best {rs[0]['best_plan']} ({rs[0]['best_s'] / rs[0]['paper_s'] - 1:+.1%})")
        result["paper_ranks"] = ranks
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
