"""Measure this machine (or every node of a torchrun job) for a cluster profile (``autopar profile``:
planner/commands/profile.py).

What is measured, on every rank at once (so a CPU shared by several ranks is measured as a run of that
many ranks sees it):
- GEMMs over a grid of (m, n, k) in the training precision (bf16 on GPUs, fp32 on CPUs), causal SDPA
  attention forward and backward over sequence lengths, device memory bandwidth (a large copy), and the
  fixed cost per kernel (compute_bench.py; on CPUs through the runtime's own layers, layer_probe.py);
- all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point over torch.distributed across
  message sizes, inside a node and (under a multi-node torchrun) across nodes, fitted per collective and
  level to alpha + bytes x factor / busbw (collectives.py, fit.py).
The result (assemble.py) loads with ``specs.cluster_loading.load_cluster`` and feeds estimate / plan /
whatif; the cost model interpolates its tables and falls back to datasheet defaults elsewhere.

How it runs: without torchrun it spawns ``--nproc`` ranks here (default: every local GPU, or 2 CPU
ranks; one GPU means no peer, so no collectives); under ``torchrun`` (multi-node) every rank runs the
command and rank 0 writes the file. torch is imported only inside the command.

Node groups: under torchrun, ``--group NAME`` on every node (nodes of one name form a group) measures each
group's compute and collectives over its own ranks and nodes and the links between groups (groups.py), and rank
0 writes one profile with ``node_groups`` and ``between_groups``. Groups may differ in ranks (GPUs) per node;
the nodes of one group may not (nor, without groups, any nodes).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from hardware_profiles.groups import Layout, LinkPlan, grouped_profile, link_rounds, node_layout, rank_record
from specs.errors import AutoparError, needs_torch
from specs.host import usable_cores


def load_torch():
    """torch, or the one-line error that says to install it."""
    try:
        import torch
    except ImportError as err:
        raise needs_torch("`autopar profile`", err) from None
    return torch


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Progress:
    """A rich progress bar on stderr (rank 0 only); silent when stderr is not a terminal unless forced."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("profiling {task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def tick(self, what: str, advance: float = 1.0) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=advance, description=what)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def measure(rank: int, world: int, local: int, quick: bool, progress: bool,
            names: tuple[str, ...] | None = None, layout: Layout | None = None, meta: Any = None,
            local_rank: int | None = None) -> dict[str, Any] | None:
    """Every rank's part of a profile (the process group is initialised); rank 0 returns the measurements.

    ``local``: the ranks on this rank's node, ``local_rank`` its place there (default ``rank % local``). With
    ``layout`` (node groups, whose nodes may differ in size) each group's compute and collectives are its own
    ranks' and the links between groups are measured too (:func:`_grouped`); ``meta``: a gloo group of every rank,
    if one exists already."""
    torch = load_torch()
    import torch.distributed as dist

    from hardware_profiles import collectives, compute_bench, layer_probe
    from hardware_profiles.assemble import gpu_profile
    from hardware_profiles.timing import Timer
    from runtime.dtypes import TORCH_DTYPES
    from specs.cluster import COLLECTIVES, GPUSpec

    names = names or COLLECTIVES
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % local if local_rank is None else local_rank) if cuda else torch.device("cpu")
    precision = "bf16" if cuda else "fp32"
    if cuda:
        torch.cuda.set_device(device)
        props = torch.cuda.get_device_properties(device)
        dev = {"type": "cuda", "name": props.name, "memory_GiB": props.total_memory / 2**30,
               "sm_count": props.multi_processor_count}
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / local
        except (ValueError, OSError):
            mem = 16.0
        usable = usable_cores()
        dev = {"type": "cpu", "name": f"{_cpu_model()} ({torch.get_num_threads()} thread(s) per rank)",
               # the ranks it runs at once at the rates measured: a core each, or as many as measured at once
               "memory_GiB": mem, "cores": max(1, usable // torch.get_num_threads(), local)}
    members = layout.members if layout else [list(range(world))]
    per_node = layout.per_node if layout else [local]
    rounds = link_rounds(layout.groups) if layout else []
    total = compute_bench.total_ticks(device, quick) + 1
    total += collectives.total_ticks(device, per_node, quick, members, names, len(rounds)) if world > 1 else 0
    bar = _Progress(total, progress and rank == 0)
    try:
        if meta is None and cuda:
            meta = dist.new_group(backend="gloo")  # for objects and barriers off the GPU
        sync = (lambda: dist.barrier(group=meta)) if world > 1 else (lambda: None)
        comp = compute_bench.run_all(device, precision, quick, bar.tick, sync)
        comp["probes"] = None
        if not cuda:  # the runtime's own layers, priced on this rank's tables (layer_probe.py)
            mine = GPUSpec(**gpu_profile(dev, comp, precision))
            timer = Timer(device, min_window_s=0.02, repeats=3 if quick else 5, sync=sync)
            comp["probes"] = layer_probe.measure(timer, mine, precision, TORCH_DTYPES[precision])
            comp["timing_spread"] = max(comp["timing_spread"], timer.spread())
        bar.tick("layer probes", 1.0)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {"device": dev, "compute": comp}, group=meta)
        if layout is not None:
            colls = collectives.run_groups(device, per_node, quick, members, bar.tick, names)
            times = collectives.run_links(device, quick, [[list(p.pairs) for p in r] for r in rounds], bar.tick)
            links = [(plan, pts) for plans, per_round in zip(rounds, times) for plan, pts in zip(plans, per_round)]
        else:
            colls = collectives.run_all(device, local, quick, bar.tick, names) if world > 1 else {}
    finally:
        bar.close()
    if rank != 0:
        return None
    out = {"device": dev, "precision": precision, "backend": "nccl" if cuda else "gloo", "world": world,
           "local": local, "quick": quick, "torch": torch.__version__, "host": socket.gethostname()}
    if layout is not None:
        return {**out, **_grouped(layout, gathered, colls, links)}
    return {**out, "compute": combine([g["compute"] for g in gathered]), "collectives": colls}


def _grouped(layout: Layout, gathered: list[dict[str, Any]], colls: list[dict[str, Any]],
             links: list[tuple[LinkPlan, list[tuple[int, float]]]]) -> dict[str, Any]:
    """Rank 0's measurements of a grouped run: per group its nodes (their ranks: its GPUs per node is their
    length), device, compute (medians over its ranks only) and collectives; per link between groups, its pairs of
    ranks and (bytes, seconds) points."""
    groups = []
    for (name, nodes), ranks, pts in zip(layout.groups.items(), layout.members, colls):
        groups.append({"name": name, "kind": layout.kinds[name], "nodes": nodes, "device": gathered[ranks[0]]["device"],
                       "compute": combine([gathered[r]["compute"] for r in ranks]), "collectives": pts})
    return {"groups": groups, "links": [{"groups": list(p.groups), "pairs": [list(x) for x in p.pairs], "points": pts}
                                        for p, pts in links]}


def combine(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-shape medians over ranks (every rank measured the same list)."""
    import numpy as np

    first = per_rank[0]
    med = lambda key, i, f: float(np.median([r[key][i][f] for r in per_rank]))  # noqa: E731
    out = {
        "gemm": [{**g, "seconds": med("gemm", i, "seconds")} for i, g in enumerate(first["gemm"])],
        "attention": [{**a, "fwd_s": med("attention", i, "fwd_s"), "bwd_s": med("attention", i, "bwd_s")}
                      for i, a in enumerate(first["attention"])],
        "copy_Bps": float(np.median([r["copy_Bps"] for r in per_rank])),
        "tiny_op_s": float(np.median([r["tiny_op_s"] for r in per_rank])),
        "probes": None,
    }
    for key in ("column_sum_Bps", "adamw_Bps"):
        if key in first:
            out[key] = float(np.median([r[key] for r in per_rank]))
    out["timing_spread"] = max(r.get("timing_spread", 0.0) for r in per_rank)  # the busiest rank's
    if first.get("probes"):
        out["probes"] = [{**p, "seconds": med("probes", i, "seconds"), "compute_s": med("probes", i, "compute_s")}
                         for i, p in enumerate(first["probes"])]
    return out


def _worker(rank: int, world: int, port: int, quick: bool, result: str, progress: bool) -> None:
    """A spawned rank: join the group, measure, rank 0 writes its measurements as JSON to ``result``."""
    torch = load_torch()
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        meas = measure(rank, world, world, quick, progress)
        if rank == 0:
            Path(result).write_text(json.dumps(meas))
    finally:
        dist.destroy_process_group()


def run_local(nproc: int, quick: bool, progress: bool = True) -> dict[str, Any]:
    """Measure with ``nproc`` ranks spawned on this machine; returns rank 0's measurements."""
    torch = load_torch()
    import torch.multiprocessing as mp

    fd, result = tempfile.mkstemp(prefix="autopar-profile-", suffix=".json")
    os.close(fd)
    try:
        if nproc == 1:
            import torch.distributed as dist

            store = dist.HashStore()
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=store, rank=0,
                                    world_size=1)
            try:
                return measure(0, 1, 1, quick, progress)  # type: ignore[return-value]
            finally:
                dist.destroy_process_group()
        threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = threads or "1"  # the ranks inherit it, as `autopar run` starts them
        try:
            mp.start_processes(_worker, args=(nproc, _free_port(), quick, result, progress), nprocs=nproc,
                               start_method="spawn")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:  # one line: its last error line
            last = [ln for ln in str(err).strip().splitlines() if ln.strip()][-1:] or ["unknown error"]
            raise AutoparError(f"profiling failed on rank {err.error_index}: {last[0].strip()}") from None
        finally:
            if threads is None:
                del os.environ["OMP_NUM_THREADS"]
        return json.loads(Path(result).read_text())
    finally:
        Path(result).unlink(missing_ok=True)


def run_torchrun(quick: bool, progress: bool = True, group: str | None = None, nic_kind: str | None = None
                 ) -> dict[str, Any] | None:
    """Measure as one rank of a torchrun job (env:// rendezvous); rank 0 returns the measurements.

    ``group``: this node's node group (``--group``); the ranks exchange theirs first and every rank checks them
    alike (:func:`hardware_profiles.groups.node_layout`), so a bad job fails on every rank at once."""
    torch = load_torch()
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    local_rank = int(os.environ.get("LOCAL_RANK", rank % local))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        meta = dist.new_group(backend="gloo") if torch.cuda.is_available() else None
        node = int(os.environ.get("GROUP_RANK", rank // local))
        mine = rank_record(group, nic_kind, node, local_rank, local)
        records: list[Any] = [None] * world
        dist.all_gather_object(records, mine, group=meta)
        layout = node_layout(records)
        if layout is None and world % local:
            raise AutoparError(f"torchrun started {world} ranks, not a whole number of nodes of {local}")
        return measure(rank, world, local, quick, progress, layout=layout, meta=meta, local_rank=local_rank)
    finally:
        dist.destroy_process_group()


def _probe_fit(compute: dict[str, Any]) -> tuple[float | None, float | None]:
    """(seconds per modelled kernel, elementwise bytes/s) from the CPU layer probes, or (None, None) on GPUs."""
    if not compute.get("probes"):
        return None, None
    from hardware_profiles.layer_probe import fit

    return fit(compute["probes"], compute["copy_Bps"], compute["tiny_op_s"])


def build(meas: dict[str, Any], name: str) -> tuple[dict[str, Any], list[str]]:
    """The cluster profile and notes for the user from rank 0's measurements."""
    from hardware_profiles.assemble import cluster_profile
    from hardware_profiles.fit import BUSY
    from specs.cluster import COLLECTIVES

    if "groups" in meas:
        return grouped_profile(meas, name, {g["name"]: _probe_fit(g["compute"]) for g in meas["groups"]})
    notes = []
    overhead, elementwise = _probe_fit(meas["compute"])
    profile = cluster_profile(meas, name, overhead, elementwise)
    one_node = ("one node: inter-node links use the bundled defaults of this GPU's cluster (run under torchrun on "
                "several nodes to measure them)" if "inter_node" in profile else
                "one node, and no bundled cluster of this device with inter-node links to take: the profile has no "
                "inter_node section, so it plans this node only (run under torchrun on several nodes, or add an "
                "inter_node section by hand, to plan more)")
    spread = meas["compute"].get("timing_spread", 0.0)
    if spread > BUSY:
        notes.append(f"the machine was busy while measured: repeated timings of one thing differed by {spread:.0%} "
                     "(median); its rates may be low and another run may differ: profile again with nothing else "
                     "running")
    if meas["world"] == 1:
        notes.append("one rank: no peer to measure collectives with; the links use the model's defaults")
        notes.append(one_node)
    else:
        missing = [c for c in COLLECTIVES if c not in meas["collectives"]]
        if missing:
            notes.append(f"{meas['backend']} does not implement {', '.join(missing)} here; the model's defaults apply")
        if meas["world"] == meas["local"]:
            notes.append(one_node)
    return profile, notes
