"""Turn the profiler's raw measurements into a cluster profile (the format in docs/contract.md).

Pure Python + numpy: no torch, so it is testable on its own. The profile keeps the datasheet facts of the
matching bundled GPU (peak FLOP/s, memory), adds the measured tables (GEMM by shape, attention by sequence
length and head dimension, memory bandwidth, alpha-beta fits per collective and level) and re-fits the few
efficiency parameters so the model's fallbacks agree with what was measured:
``gemm`` and ``attention_*`` are the median measured fraction of peak, ``memory`` the measured fraction
of datasheet bandwidth, ``kernel_overhead_us`` the measured fixed cost per kernel; the fused AdamW update's
bandwidth becomes ``optimizer_bandwidth_GBps``. A CPU has no datasheet:
its best GEMM rate stands for peak and its copy bandwidth for the memory bandwidth, and the layers'
memory-bound ops' bandwidth (``elementwise_bandwidth_GBps``) and the per-kernel cost come from the runtime's
own layers (layer_probe.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml

from cost_models.compute import ATTN_BWD_RATIO, ComputeModel, attention_flops
from hardware_profiles.fit import fit_alpha_beta
from specs.cluster import Efficiency, GPUSpec, bus_factor
from specs.cluster_loading import PROFILE_DIR, load_cluster, load_gpu
from specs.files import utc_now
from specs.topology import InterNode, Link

# substring of torch.cuda.get_device_name() (lower case) -> bundled GPU profile (first match wins)
_GPU_NAMES: tuple[tuple[str, str], ...] = (
    ("h200", "h200-sxm-141gb"), ("h100 pcie", "h100-pcie-80gb"), ("h100", "h100-sxm5-80gb"),
    ("b200", "b200-180gb"), ("l40s", "l40s-48gb"), ("v100", "v100-sxm2-32gb"),
)
# bundled GPU -> bundled cluster whose links are the fallback for what a run cannot measure
_CLUSTERS = {"h100-sxm5-80gb": "dgx-h100", "h200-sxm-141gb": "dgx-h200", "a100-sxm4-80gb": "dgx-a100",
             "a100-sxm4-40gb": "dgx-a100", "cpu": "cpu-gloo"}


def match_gpu(device_name: str, memory_GiB: float) -> str | None:
    """The bundled GPU profile for a CUDA device name (``None`` when unknown)."""
    low = device_name.lower()
    if "a100" in low:
        return "a100-sxm4-80gb" if memory_GiB > 50 else "a100-sxm4-40gb"
    for key, name in _GPU_NAMES:
        if key in low:
            return name
    return None


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def gpu_profile(device: dict[str, Any], compute: dict[str, Any], precision: str,
                kernel_overhead_s: float | None = None, elementwise_Bps: float | None = None) -> dict[str, Any]:
    """A GPU profile mapping (valid for :class:`GPUSpec`) from one device's measurements.

    ``kernel_overhead_s`` (CPU runs: layer_probe.py) replaces the tiny-kernel time as the fixed cost per kernel;
    ``elementwise_Bps`` (idem) becomes the layers' memory-bound ops' bandwidth (fused streaming kernels such as
    the optimizer keep the copy bandwidth)."""
    gemm = [(g["m"], g["n"], g["k"], 2.0 * g["m"] * g["n"] * g["k"] / g["seconds"]) for g in compute["gemm"]]
    attn = [(a, float(attention_flops(a["batch"] * a["heads"], a["seq"], a["seq"], a["head_dim"], 0.5)))
            for a in compute["attention"]]  # causal, as the probe runs it
    copy_GBps = compute["copy_Bps"] / 1e9
    ew_GBps = elementwise_Bps / 1e9 if elementwise_Bps else copy_GBps
    overhead_us = (kernel_overhead_s if kernel_overhead_s is not None else compute["tiny_op_s"]) * 1e6
    if device["type"] == "cuda":
        bundled = match_gpu(device["name"], device["memory_GiB"])
        base = load_gpu(bundled) if bundled else None
        if base is not None and precision in base.peak_tflops:
            peak = base.peak_tflops
        else:  # unknown GPU: take the best measured GEMM as the default GEMM efficiency of its peak
            peak = {precision: _sig(max(r for *_, r in gemm) / Efficiency.model_fields["gemm"].default / 1e12)}
        name = bundled or device["name"].lower().replace(" ", "-")
        datasheet_bw = base.memory_bandwidth_GBps if base else copy_GBps
        sm = device.get("sm_count") or (base.sm_count if base else GPUSpec.model_fields["sm_count"].default)
    else:  # a CPU: no datasheet; its "peak" is the best GEMM rate measured
        peak = {"fp32": _sig(max(r for *_, r in gemm) / 1e12)}
        name, datasheet_bw, sm = "cpu", copy_GBps, 1
    eff0 = Efficiency(kernel_overhead_us=overhead_us)
    probe = GPUSpec(name=name, peak_tflops=peak, memory_GiB=device["memory_GiB"], memory_bandwidth_GBps=datasheet_bw,
                    sm_count=sm, efficiency=eff0.model_copy(update={"gemm": 1.0}))
    cm = ComputeModel(probe, precision)
    ratios = [r / float(cm.gemm_rate(m, n, k)) for m, n, k, r in gemm]
    p = probe.peak(precision)
    fwd = [f / a["fwd_s"] for a, f in attn]
    bwd = [ATTN_BWD_RATIO * f / a["bwd_s"] for a, f in attn]
    clamp = lambda x: _sig(min(1.0, max(0.01, x)))  # noqa: E731
    eff = {"gemm": clamp(float(np.median(ratios))), "gemm_tile_m": eff0.gemm_tile_m, "gemm_tile_n": eff0.gemm_tile_n,
           "gemm_k_half": eff0.gemm_k_half, "memory": clamp(copy_GBps / datasheet_bw),
           "attention_fwd": clamp(float(np.median(fwd)) / p), "attention_bwd": clamp(float(np.median(bwd)) / p),
           "kernel_overhead_us": _sig(overhead_us)}
    return {
        "name": name,
        "peak_tflops": peak,
        "memory_GiB": _sig(device["memory_GiB"]),
        "memory_bandwidth_GBps": _sig(datasheet_bw),
        "sm_count": int(sm),
        "efficiency": eff,
        "measured_memory_bandwidth_GBps": _sig(copy_GBps),
        **({"elementwise_bandwidth_GBps": _sig(ew_GBps)} if elementwise_Bps else {}),
        **({"reduce_bandwidth_GBps": _sig(compute["column_sum_Bps"] / 1e9)} if compute.get("column_sum_Bps") else {}),
        **({"optimizer_bandwidth_GBps": _sig(compute["adamw_Bps"] / 1e9)} if compute.get("adamw_Bps") else {}),
        **({"cores": int(device["cores"])} if device.get("cores") else {}),  # CPUs: ranks that run at once
        "gemm_table": [{"m": m, "n": n, "k": k, "tflops": _sig(r / 1e12)} for m, n, k, r in gemm],
        "attention_table": [{"seq": a["seq"], "heads": a["heads"], "head_dim": a["head_dim"], "batch": a["batch"],
                             "fwd_tflops": _sig(fw / 1e12), "bwd_tflops": _sig(bw / 1e12)}
                            for (a, _), fw, bw in zip(attn, fwd, bwd)],
    }


def collective_fits(colls: dict[str, dict[str, list]]) -> dict[str, dict[str, dict[str, float]]]:
    """``{collective: {level: {alpha_us, busbw_GBps, alpha_per_rank_us, r2}}}`` from the measured
    ``{collective: {level: [(group size, bytes, seconds)]}}``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, per_level in colls.items():
        for level, pts in per_level.items():
            if len(pts) < 2:
                continue
            ab = fit_alpha_beta([b * bus_factor(name, n) for n, b, _ in pts], [t for *_, t in pts],
                                [n for n, *_ in pts])
            fit = {"alpha_us": _sig(ab.alpha_s * 1e6), "busbw_GBps": _sig(ab.bw_Bps / 1e9)}
            if ab.per_rank_s > 0:
                fit["alpha_per_rank_us"] = _sig(ab.per_rank_s * 1e6)
            out.setdefault(name, {})[level] = {**fit, "r2": round(ab.r2, 4)}
    return out


def cluster_profile(meas: dict[str, Any], name: str, kernel_overhead_s: float | None = None,
                    elementwise_Bps: float | None = None, as_run: bool = False) -> dict[str, Any]:
    """The cluster profile mapping (valid for ``cluster_from_dict``) from the measurements of a run.

    ``as_run`` (node groups) keeps the nodes as they ran: a one-node CPU run is not widened to the bundled
    CPU profile's ranks per node."""
    dev, world, local = meas["device"], meas["world"], meas["local"]
    gpu = gpu_profile(dev, meas["compute"], meas["precision"], kernel_overhead_s, elementwise_Bps)
    fits = collective_fits(meas.get("collectives", {}))
    base_name = _CLUSTERS.get(gpu["name"])
    base = load_cluster(base_name) if base_name and (PROFILE_DIR / "clusters" / f"{base_name}.yaml").exists() else None
    intra: dict[str, Any] = (dict(base.intra_node.model_dump()) if base
                             else {"bandwidth_GBps": 100.0, "latency_us": Link.model_fields["latency_us"].default})
    ring = [f["intra"]["busbw_GBps"] for c, f in fits.items() if c != "p2p" and "intra" in f]
    if ring:  # measured: the model's fallback link is what the collectives achieved
        intra = {"bandwidth_GBps": _sig(float(np.median(ring))), "efficiency": 1.0,
                 "latency_us": fits.get("p2p", {}).get("intra", {}).get("alpha_us", intra["latency_us"])}
    per_node = local
    # CPU ranks are processes: a node holds as many as the bundled CPU profile, whatever ran the probe
    if meas["backend"] == "gloo" and base is not None and world == local and not as_run:
        per_node = max(local, base.gpus_per_node)
        gpu["memory_GiB"] = _sig(dev["memory_GiB"] * local / per_node)  # the host's memory over all of them
    out: dict[str, Any] = {"name": name, "gpu": gpu, "gpus_per_node": per_node, "num_nodes": 1 if per_node != local
                           else world // local,
                           "backend": meas["backend"], "precision": meas["precision"], "intra_node": intra}
    inter_fits = [f["inter"]["busbw_GBps"] for c, f in fits.items() if c != "p2p" and "inter" in f]
    if inter_fits:
        out["inter_node"] = {"nic_bandwidth_Gbps": _sig(8 * float(np.median(inter_fits))), "nics_per_node": local,
                             "efficiency": 1.0,
                             "latency_us": fits.get("p2p", {}).get("inter", {}).get(
                                 "alpha_us", InterNode.model_fields["latency_us"].default)}
    elif base is not None and base.inter_node is not None:  # the bundled NICs per GPU, on this node's GPUs
        nics = max(1, round(base.inter_node.nics_per_node * per_node / base.gpus_per_node))
        out["inter_node"] = {**base.inter_node.model_dump(), "nics_per_node": nics}
    if fits:
        out["collectives"] = fits
    return out


def to_yaml(profile: dict[str, Any], meas: dict[str, Any], notes: list[str]) -> str:
    """The profile as YAML with a header saying what was measured, where and when."""
    dev = meas["device"]
    when = utc_now()
    where = f"{meas['world']} rank(s), {meas['local']} per node, {meas['backend']}; device: {dev['name']}"
    if "groups" in meas:
        where = f"{meas['world']} rank(s), {meas['backend']}; node groups: " + ", ".join(
            f"{g['name']} ({len(g['nodes'])} node(s) x {len(g['nodes'][0])}, {g['device']['name']})"
            for g in meas["groups"])
    head = [f"# Measured by `autopar profile` on {meas.get('host', '?')} at {when} (torch {meas.get('torch', '?')}).",
            f"# {where}, {meas['precision']}{', quick' if meas.get('quick') else ''}.",
            "# gemm_table / attention_table: whole-kernel rates (FLOP/s, causal FLOPs for attention);",
            "# collectives: time = alpha + bytes x factor / busbw (nccl-tests bus bandwidth), fitted per level."]
    if "groups" in meas:
        head += ["# between_groups: point to point between a node of each group, local rank i with i for every i both"
                 " have, at once;", "# alpha-beta fit: bandwidth per pair x pairs, latency = alpha less the groups' NIC"
                 " hops (the model adds them back)."]
    head += [f"# note: {n}" for n in notes]
    return "\n".join(head) + "\n" + yaml.safe_dump(profile, sort_keys=False, default_flow_style=None, width=120)


def write_profile(path: str | Path, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
