"""`autopar run`: the plan file to launch (given, re-planned for a resumed run, or the default job), re-estimated
when edited by hand."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from rich.markup import escape

from specs.errors import AutoparError, needs_torch


def run_command(args: argparse.Namespace) -> int:
    try:
        from runtime.data import writable_cache_dir
        from runtime.launch import launch
        from runtime.options import RunOptions, check_run_values
    except ImportError as err:
        raise needs_torch("`autopar run`", err) from None
    from runtime.checkpoint_folder import in_use, pointed_back

    # values no run takes: said before a default plan is made or a checkpoint folder touched
    check_run_values(RunOptions.from_args(args))

    root = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    step = _resume_from(args)  # (it sets --resume)
    options = RunOptions.from_args(args)
    with in_use(root) if root is not None and not args.dry_run else contextlib.nullcontext(), \
            pointed_back(root, step) if step is not None else contextlib.nullcontext():  # type: ignore[arg-type]
        # one run at a time in the folder from here to its end; --resume-from's latest put back if it is refused
        plan_path = args.plan
        if args.replan:
            plan_path = _replan(args)
        elif args.gpus is not None:
            from planner.defaults import plan_command

            how = (f"; to train the default job on {args.gpus} ranks, plan it first: `{plan_command(args.gpus)} --out "
                   "plan.json`, then `autopar run plan.json`" if plan_path is None else "")
            raise AutoparError(f"--gpus is for --replan (a plan file fixes its own GPU count){how}")
        if plan_path is None and args.resume and args.checkpoint_dir:
            plan_path = _checkpoint_plan(Path(args.checkpoint_dir), args.dry_run)
        if plan_path is None:
            then = "its command" if args.dry_run else None
            plan_path = str(_plan_default(writable_cache_dir() / "default-plan.json", then))
        from specs.planfile import load_plan

        plan = load_plan(plan_path)  # once, for the checks before launch
        from runtime.trainer import check_supported

        check_supported(plan, plan_path)  # (before a note on its prediction: a refusal is one line)
        fresh = _fresh_prediction(plan, plan_path)
        from planner.prediction import tuned_note

        if fresh is None and (note := tuned_note(plan.prediction, plan_path)):
            print(f"autopar: {note}", flush=True)
        moe = plan.model.moe
        if moe is not None and moe.capacity_factor is not None:
            print(f"autopar: {plan.model.name}'s capacity factor {moe.capacity_factor:g} prices its experts' buffers "
                  "(padded to that many times the mean load, fewer tokens where under 1); the runtime routes dropless: "
                  "every expert takes the tokens routed to it, so the run's steps follow the routing instead",
                  flush=True)
        _check_gpu_memory(plan, plan_path, fresh)
        if not args.dry_run:
            _check_host_memory(plan, plan_path)
        return launch(plan_path=plan_path, predicted_step_s=fresh and fresh.step_time_s,
                      predicted_memory_GiB=fresh and fresh.memory_GiB, options=options)


def _resume_from(args: argparse.Namespace) -> int | None:
    """``--resume-from STEP``'s step, checked (None when not given): the run resumes from that checkpoint; ``latest``
    points at it from here, and the launch sets the newer ones aside once the run's checks pass."""
    from runtime.checkpoint_folder import checkpoint_step, latest_checkpoint, no_checkpoint, resumable, resume_step

    if args.resume_from is None:
        return None
    if not args.checkpoint_dir:
        raise AutoparError("--resume-from needs --checkpoint-dir (where the checkpoints are)")
    step = resume_step(args.resume_from, Path(args.checkpoint_dir))
    if args.dry_run:
        root = Path(args.checkpoint_dir)
        if not root.is_dir():
            raise no_checkpoint(root)
        resumable(root, step)  # (a step it does not hold: said as the run would)
        current = latest_checkpoint(root)
        if current is not None and checkpoint_step(current) == step:  # what --resume goes on from: nothing to move
            args.resume = True
            return None
        raise AutoparError("--resume-from points the checkpoint folder at an earlier checkpoint, and a dry run "
                           "changes nothing: drop --dry-run (or dry-run from the newest with --resume)")
    if not Path(args.checkpoint_dir).is_dir():
        raise no_checkpoint(Path(args.checkpoint_dir))
    args.resume = True
    return step


def _checkpoint_plan(root: Path, dry_run: bool = False) -> str:
    """``run --resume --checkpoint-dir D`` without a plan file: the plan that wrote D's newest checkpoint, written
    beside the checkpoints (a dry run writes nothing there: :func:`_written`); returns its path."""
    from runtime.checkpoint import saved_plan

    plan = saved_plan(root)
    path = _written(plan, root / "resumed-plan.json", dry_run)
    print(f"autopar: no plan file given: resuming under the plan of the newest checkpoint ({plan.config.short()} on "
          f"{plan.world_size} GPUs); {_wrote(path, root / 'resumed-plan.json')}", flush=True)
    return str(path)


def _written(plan: Any, path: Path, dry_run: bool) -> Path:
    """Save ``plan`` to ``path``, or, in a dry run (which writes nothing of the user's), to a temporary file whose
    path is returned instead."""
    import tempfile

    from specs.planfile import save_plan

    if dry_run:
        path = Path(tempfile.mkdtemp(prefix="autopar-dry-run-")) / path.name
    save_plan(plan, path)
    return path


def _wrote(path: Path, meant: Path) -> str:
    """What a run says of the plan it wrote to ``path`` (``meant``, unless a dry run put it elsewhere)."""
    return f"wrote it to {path}" if path == meant else f"a dry run: not written to {meant}; shown from {path}"


def _full_size(cluster: Any) -> Any:
    """A plan's cluster, able to grow back to its real node: a cluster resized below a node keeps that node's size
    (``full_node_gpus``, which ``resized`` restores); a plan file written before it did, on a bundled cluster, gets
    the bundled node. Any other cluster as the plan holds it."""
    from specs.cluster_loading import list_clusters, load_cluster

    if cluster.full_node_gpus is None and cluster.name in list_clusters() and cluster.num_nodes == 1:
        bundled = load_cluster(cluster.name).model_copy(update={"tp_across_nodes": cluster.tp_across_nodes})
        cut = bundled.resized(gpus=cluster.num_gpus).model_copy(update={"full_node_gpus": None})
        if bundled.gpus_per_node > cluster.gpus_per_node and cut == cluster:
            return bundled
    return cluster


def _replan(args: argparse.Namespace) -> str:
    """``run --resume --replan --gpus N``: the fastest plan the runtime runs for the checkpoint's model and global
    batch on N GPUs of its cluster, written beside the checkpoints; returns its path."""
    from planner.prediction import plan_prediction
    from planner.search import search
    from planner.space import NoPlan
    from runtime.checkpoint import saved_plan
    from specs.planfile import make_plan

    if args.gpus is not None and args.gpus < 1:
        raise AutoparError(f"--gpus must be at least 1, got {args.gpus}")
    if not (args.resume and args.checkpoint_dir and args.gpus):
        raise AutoparError("--replan needs --resume, --checkpoint-dir and --gpus N (the GPUs to plan for)")
    if args.plan is not None:
        raise AutoparError("--replan plans again from the checkpoint's own plan: leave out the plan file")
    old = saved_plan(Path(args.checkpoint_dir))
    cluster = _full_size(old.cluster).resized(gpus=args.gpus)
    try:
        res = search(old.model, cluster, old.global_batch, top=1, state=old.state)
    except NoPlan as err:  # its advice may be to change what a resumed run keeps (the global batch)
        raise AutoparError(f"no plan of {old.model.name} with the checkpoint's global batch {old.global_batch} (a "
                           f"resumed run keeps it) runs on {args.gpus} GPUs ({err.problem or err}); re-plan for "
                           "another number of GPUs") from None
    if not res.plans:
        raise AutoparError(f"no plan of {old.model.name} with global batch {old.global_batch} fits on {args.gpus} "
                           f"GPUs of {cluster.name}; re-plan for more GPUs")
    best = res.plans[0]
    meant = Path(args.checkpoint_dir) / f"replanned-{args.gpus}gpus.json"
    pred = plan_prediction(old.model, cluster, best.config, best.estimate, old.global_batch, old.state)
    path = _written(make_plan(old.model, cluster, old.global_batch, best.config, pred, old.train, old.state), meant,
                    args.dry_run)
    gpus = f"{args.gpus} GPU{'s' if args.gpus > 1 else ''}"
    print(f"autopar: re-planned for {gpus}: {best.config.short()} (was {old.config.short()} on "
          f"{old.world_size}), {best.estimate.step_time_s:.4g} s a step predicted; {_wrote(path, meant)}", flush=True)
    return str(path)


def _fresh_prediction(plan: Any, plan_path: str) -> Any:
    """The estimate of a plan file edited by hand since its prediction (its keys, batch, sequence, model, cluster or
    state changed), made again on the GPUs it uses, with a note; None when the plan's own prediction holds."""
    from cost_models.step import estimate

    if plan.prediction and plan.prediction_is_current:
        return None
    est = estimate(plan.model, plan.used_cluster, plan.config, plan.global_batch, state=plan.state)
    why = (f"was edited since its prediction ({plan.prediction.get('step_time_s', 0):.4g} s a step); re-estimated"
           if plan.prediction else "has no prediction; estimated")
    print(f"autopar: {plan_path} {why} for {plan.config.short()}: {est.step_time_s:.4g} s", flush=True)
    return est


def _check_gpu_memory(plan: Any, plan_path: str, fresh: Any) -> None:
    """A GPU plan whose predicted peak on some pipeline stage is above its GPUs' memory (a plan file edited by hand:
    the planner writes none) is refused before launch: it would run out of memory at its first step."""
    from cost_models.step import estimate

    if plan.cluster.backend != "nccl":
        return  # CPU ranks: the host-memory check
    est = fresh or estimate(plan.model, plan.used_cluster, plan.config, plan.global_batch, state=plan.state)
    stage, need, have = est.fullest_stage
    if need > have:
        where = f" on pipeline stage {stage}" if plan.config.pp > 1 else ""
        raise AutoparError(f"{plan_path}: {plan.config.short()} needs {need:.1f} GiB per GPU{where} by the memory "
                           f"model, above the GPU's {have:g} GiB: it would run out of memory; re-plan with "
                           "`autopar plan`, or add zero, recompute or more pipeline stages")


def available_GiB() -> float | None:
    """Memory this machine can still give (Linux's MemAvailable), or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kib / 2**20


def _check_host_memory(plan: Any, plan_path: str) -> None:
    """A plan whose ranks all train on this machine's CPU (a gloo plan, or a CUDA plan on a machine without CUDA,
    run in fp32) keeps every rank's weights, optimizer state and activations in this machine's memory: refused
    before launch when the memory model prices them above what the machine has available, where the kernel would
    kill the run (or the machine) instead."""
    import torch

    from cost_models.step import estimate
    from runtime.launch import local_gpus
    from runtime.trainer import executed_state

    if plan.cluster.backend == "nccl" and local_gpus() is not None or plan.cluster.num_nodes > 1:
        return  # on GPUs, or on several machines (run prints their commands)
    free = available_GiB()
    if free is None or "fp32" not in plan.cluster.gpu.peak_tflops:
        return
    cpu = plan.used_cluster.model_copy(update={"precision": "fp32", "backend": "gloo"})
    est = estimate(plan.model, cpu, plan.config, plan.global_batch, validate=False,
                   state=executed_state(plan, torch.device("cpu")))  # the state the CPU ranks keep
    need = sum(est.stage_memory_GiB) * plan.world_size / plan.config.pp  # every rank of each stage
    if need > free:
        how = "" if plan.cluster.backend == "gloo" else " in fp32 (no CUDA here)"
        raise AutoparError(f"{plan_path}: its {plan.world_size} ranks would train on this machine's CPU{how} and "
                           f"need about {need:.1f} GiB by the memory model; this machine has {free:.1f} GiB "
                           "available: run it on its cluster, or plan a smaller model or batch")


def _plan_default(path, then: str | None = None) -> str:
    """Plan the default job (tiny Llama, 4 CPU ranks), print the plan, write it to ``path``; ``then`` says what
    follows (default: training it)."""
    from planner.defaults import CLUSTER, FIXED, GLOBAL_BATCH, MODEL, RANKS, default_plan, plan_command
    from planner.explain import runner_up, why
    from planner.report import console, estimate_tables, plans_table

    out, res = default_plan(path)
    con = console()
    fixed = " ".join(f"{k}={v}" for k, v in FIXED.items())
    con.print(f"autopar: no plan given: planning the {MODEL} model for {RANKS} {CLUSTER} ranks "
              f"(global batch {GLOBAL_BATCH}), {fixed} held to show tensor and pipeline parallelism at work "
              f"(`{plan_command()}` plans it freely); {res.candidates:,} configurations priced in {res.seconds:.2f} s")
    con.print(plans_table([p.row() for p in res.plans], "plans"))
    other = runner_up(res.ranked)
    if other:
        con.print(f"[bold]why:[/bold] {escape(why(res.plans[0], other))}")
    con.print(estimate_tables(res.plans[0].estimate, "")[1])
    if then is not None:
        con.print(f"autopar: wrote {escape(str(out))}; {then}:")
        return out
    con.print(f"autopar: wrote {escape(str(out))}; training it (CPU timings are noisy; the bundled cpu-gloo profile "
              "is rough, `autopar profile` measures this machine)")
    return out

