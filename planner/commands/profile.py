"""`autopar profile`: measure this machine (or every node of a torchrun job; hardware_profiles/profiler.py), write the
cluster profile and say what was measured."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hardware_profiles.profiler import build, load_torch, run_local, run_torchrun
from specs.cluster_loading import check_profile_out
from specs.errors import AutoparError
from specs.host import usable_cores


def summary(profile: dict[str, Any], out: str) -> list[str]:
    """A few lines on what was measured."""
    if profile.get("node_groups"):
        return _grouped_summary(profile, out)
    gpu = profile["gpu"]
    best = max(gpu["gemm_table"], key=lambda g: g["tflops"])
    eff = gpu["efficiency"]
    as_peak = " (taken as the peak: a CPU has no datasheet)" if gpu["name"] == "cpu" else ""
    lines = [f"wrote {out}: {profile['num_nodes']} x {profile['gpus_per_node']} {gpu['name']} ({profile['backend']}, "
             f"{profile['precision']})",
             f"  GEMM      {len(gpu['gemm_table'])} shapes, best {best['tflops']:.4g} TFLOP/s at "
             f"{best['m']}x{best['n']}x{best['k']}{as_peak}; "
             f"efficiency.gemm {eff['gemm']:.3g} (the median shape's rate over the peak, after tile and K losses"
             + ("; at most 1, the shapes' own rates are in the table)" if eff["gemm"] >= 1 else ")"),
             f"  attention {len(gpu['attention_table'])} points, forward {eff['attention_fwd']:.3g} / backward "
             f"{eff['attention_bwd']:.3g} of peak (median)",
             f"  memory    {gpu['measured_memory_bandwidth_GBps']:.4g} GB/s copy"
             + (f", {gpu['elementwise_bandwidth_GBps']:.4g} GB/s per modelled byte of the layers' memory-bound ops"
                if gpu.get("elementwise_bandwidth_GBps") else f" ({gpu['memory_bandwidth_GBps']:.4g} datasheet)")
             + (f"; AdamW update {gpu['optimizer_bandwidth_GBps']:.4g} GB/s" if gpu.get("optimizer_bandwidth_GBps")
                else "")
             + f"; fixed cost per kernel {eff['kernel_overhead_us']:.3g} us"]
    return lines + _fit_lines(profile.get("collectives", {}), "  ")


def _fit_lines(fits: dict[str, dict[str, dict[str, float]]], indent: str) -> list[str]:
    """One line per measured collective and level."""
    lines = []
    for c, levels in fits.items():
        for lv, f in levels.items():
            per = f" (+{f['alpha_per_rank_us']:.3g} us per rank beyond 2)" if f.get("alpha_per_rank_us") else ""
            lines.append(f"{indent}{c:<15}{lv:<6} alpha {f['alpha_us']:.4g} us{per}, busbw {f['busbw_GBps']:.4g} GB/s, "
                         f"R^2 {f['r2']:.3f}")
    return lines


def _grouped_summary(profile: dict[str, Any], out: str) -> list[str]:
    """A line per node group (then its collective fits) and per link between groups."""
    groups = profile["node_groups"]
    lines = [f"wrote {out}: node groups " + ", ".join(f"{g['name']} ({g['num_nodes']} x {g['gpus_per_node']} "
                                                      f"{g['gpu']['name']})" for g in groups)
             + f" ({profile['backend']}, {profile['precision']})"]
    for g in groups:
        gpu, net = g["gpu"], g["inter_node"]
        best = max(gpu["gemm_table"], key=lambda x: x["tflops"])
        lines.append(f"  group {g['name']}: GEMM best {best['tflops']:.4g} TFLOP/s, memory "
                     f"{gpu['measured_memory_bandwidth_GBps']:.4g} GB/s copy, intra-node "
                     f"{g['intra_node']['bandwidth_GBps']:.4g} GB/s, NICs {net['nics_per_node']} x "
                     f"{net['nic_bandwidth_Gbps']:.4g} Gb/s {net['kind']}")
        lines += _fit_lines(g.get("collectives", {}), "    ")
    for x in profile.get("between_groups", []):
        lines.append(f"  link {'-'.join(x['groups'])}: {x['bandwidth_Gbps_per_node']:.4g} Gb/s per node, latency "
                     f"{x['latency_us']:.4g} us beyond the NIC hops (point to point, local rank i with i, all at once)")
    return lines


def profile_command(args: argparse.Namespace, progress: Callable[[], bool] | None = None) -> int:
    """The CLI entry point (args: out, quick, nproc, name, group, nic_kind)."""
    from hardware_profiles.assemble import to_yaml, write_profile

    if os.environ.get("RANK", "0") == "0":  # rank 0 writes the profile
        check_profile_out(args.out, "profile")  # before minutes of measuring
    torch = load_torch()
    show = sys.stderr.isatty() if progress is None else progress()
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    group, nic_kind = getattr(args, "group", None), getattr(args, "nic_kind", None)
    if under_torchrun:
        if args.nproc is not None:
            raise AutoparError("--nproc is for spawning ranks here; under torchrun use --nproc-per-node")
        try:
            meas = run_torchrun(args.quick, show, group, nic_kind)
        except AutoparError as err:  # every rank failed alike: the first rank of each node says why
            if os.environ.get("LOCAL_RANK", "0") != "0":
                time.sleep(1.0)  # torchrun stops a node's ranks when one exits: let the first print first
                raise SystemExit(err.exit_code) from None
            raise
        if meas is None:
            return 0
    else:
        if group is not None or nic_kind is not None:
            flag = "--group" if group is not None else "--nic-kind"
            raise AutoparError(f"{flag} is for the nodes of a torchrun job: run `torchrun ... autopar profile --group "
                               "NAME` on every node (the nodes of one name form a node group)")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        nproc = args.nproc if args.nproc is not None else (gpus or 2)
        if nproc < 1:
            raise AutoparError(f"--nproc must be at least 1, got {nproc}")
        if gpus and nproc > gpus:
            raise AutoparError(f"--nproc {nproc}: this machine has {gpus} GPU(s)")
        usable = usable_cores()
        cores = max(2, usable)
        if not gpus and nproc > cores:
            raise AutoparError(f"--nproc {nproc}: this process may use {usable} CPU core(s); more gloo ranks than "
                               f"cores would time the cores' sharing, not the links (give at most {cores})")
        meas = run_local(nproc, args.quick, show)
    name = args.name or Path(args.out).stem
    profile, notes = build(meas, name)
    try:
        write_profile(args.out, to_yaml(profile, meas, notes))
    except OSError as err:
        raise AutoparError(f"cannot write {args.out}: {err.strerror}") from None
    for line in summary(profile, args.out) + [f"note: {n}" for n in notes]:
        print(line)
    return 0
