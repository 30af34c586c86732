"""The training entry point on every rank: ``torchrun --nproc-per-node W -m runtime.train plan.json [...]``.

``autopar run`` (:mod:`runtime.launch`) starts it; it can also be started by hand under torchrun (or as a
single process for a one-rank plan). NCCL when CUDA is available (one GPU per local rank), gloo on CPU.
Errors are one line on stderr, ``autopar error: ...``: exit code 2 for bad inputs, 1 for anything else
(``AUTOPAR_DEBUG=1`` adds the traceback).

Restarts (``autopar run --max-restarts N``): torchrun starts every worker again after one dies, with
``TORCHELASTIC_RESTART_COUNT`` set; a restarted run resumes from the latest checkpoint and writes a metrics line
``{"event": "restart", "attempt", "resumed_after_step", "lost_steps"}`` (the steps done since that checkpoint,
which it redoes). With ``--mtbf-hours`` the first checkpoint of a run is timed and Young-Daly's interval
printed and written as ``{"event": "checkpoint_interval", "after_step", "save_s", "step_s", "mtbf_hours",
"young_daly_s", "young_daly_steps", "checkpoint_every"}``.

Hangs: a watchdog (:mod:`runtime.watchdog`) ends the run with one line naming the rank that stopped when no rank
has made progress for ``--collective-timeout`` seconds.

Testing hooks (faults, hangs, stragglers, slow plans, set from the environment by tests): runtime/testing_hooks.py.

Phase times: every rank times its step's phases (:mod:`runtime.phase_clock`); with ``--metrics-out`` each step's
line carries every rank's, ``"phases_s": {phase: [seconds of rank 0, 1, ...]}`` (what ``autopar diagnose`` reads).
"""

from __future__ import annotations

import os

# A worker of torchrun's agent ends when its agent does: armed before torch's seconds of imports, during which the
# agent may end (a tune trial stopped at its time limit).
if __name__ == "__main__" and "TORCHELASTIC_RUN_ID" in os.environ:
    from runtime.ends_with import end_with_parent

    end_with_parent()

import argparse
import contextlib
import math
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runtime.checkpoint_folder import held_by_rank, instead_of, latest_checkpoint
from runtime.comm_hooks import CommHooks
from runtime.data import SAMPLE_TEXT, TokenData
from runtime.metrics import MetricsLog, last_step
from runtime.options import KEEP_CHECKPOINTS, RunOptions, check_run_options, worker_parser
from runtime.parallel.mappings import all_gather_into
from runtime.parallel.mesh import build_groups
from runtime.phase_clock import CudaMarks, PhaseClock
from runtime.testing_hooks import StepHooks
from runtime.trainer import Trainer, check_supported, peak_memory_GiB
from runtime.worker_error import report
from specs.errors import INTERRUPTED, AutoparError, RunFailed, counted
from specs.phases import PHASES
from specs.planfile import PlanFile, load_plan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return worker_parser(__doc__.splitlines()[0]).parse_args(argv)


def _gather_ranks(values: dict[str, float], group: dist.ProcessGroup, device: torch.device
                  ) -> dict[str, list[float]]:
    """Every rank's ``values`` (one collective over ``group``): ``{name: [value of rank 0, 1, ...]}``."""
    names = list(values)
    mine = torch.tensor([values[k] for k in names], dtype=torch.float64, device=device)
    every = torch.empty(dist.get_world_size(group) * len(names), dtype=torch.float64, device=device)
    all_gather_into(every, mine, group)
    rows = every.view(-1, len(names)).T.tolist()
    return {k: [float(f"{x:.6g}") for x in rows[i]] for i, k in enumerate(names)}


def _attempt(world: int) -> int:
    """Which start of the run's workers this is (0: the first), the same on every node.

    On one node torchrun's restart count says it. On several it is each node's own: when a worker dies, its node's
    agent counts a restart, but the healthy nodes' agents restart theirs as a change of membership and count none,
    so the nodes would disagree on whether to resume and meet in different stores (a hang). Where the agents share
    one store across restarts (the default), each worker adds one to a count of starts in it, first thing: every
    start of the run's ``world`` workers adds ``world`` (a worker killed before it adds leaves the count short and
    the next start's ranks apart: the window is the worker's first seconds). Elsewhere (a store made afresh each
    round) the restart count is all there is."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1)
    if nodes == 1 or "MASTER_ADDR" not in os.environ or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return count
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    return (store.add("autopar/starts", 1) - 1) // world


def _store(use: str, attempt: int, host: bool = False) -> dist.Store:
    """The run's rendezvous store (torchrun's), under a prefix of this ``attempt``'s and ``use``'s own: torchrun's
    agent keeps one store across restarts, where a restarted attempt would otherwise read the previous one's
    addresses (and be refused). ``host``: this process serves it (rank 0, when torchrun's agent does not)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=host)
    return dist.PrefixStore(f"autopar/attempt_{attempt}/{use}", store)


def _advise_interval(log: MetricsLog, step: int, save_s: float, step_s: float, mtbf_hours: float, every: int,
                     quiet: bool) -> None:
    """After the first checkpoint: Young-Daly's interval from its measured save time, as a metrics line and a note."""
    from runtime.checkpoint import young_daly_interval_s

    best_s = young_daly_interval_s(save_s, mtbf_hours * 3600.0)
    best_steps = max(1, round(best_s / step_s))
    log.event(event="checkpoint_interval", after_step=step, save_s=save_s, step_s=step_s, mtbf_hours=mtbf_hours,
              young_daly_s=best_s, young_daly_steps=best_steps, checkpoint_every=every)
    if not quiet:
        now = f"every {every} step(s)" if every else "only at its end"
        print(f"autopar: a checkpoint took {save_s:.3g} s; with a failure every {mtbf_hours:g} h, Young-Daly's "
              f"interval is {best_s:.3g} s = {best_steps} step(s) of {step_s:.3g} s (this run: {now}; "
              f"--checkpoint-every {best_steps})", flush=True)


def diverged(step: int, loss: float, grad_norm: float, ckdir: Path | None) -> AutoparError:
    """The error that stops a run whose loss or gradient norm is no longer a number, before it is checkpointed (the
    checkpoints from before it are kept)."""
    ck = latest_checkpoint(ckdir) if ckdir is not None else None
    kept = (f"; the checkpoints before it are kept (the newest, {ck}, holds the weights this step started from: if "
            f"they are already bad, {instead_of(ck)})") if ck is not None else ""
    return AutoparError(f"step {step}: the loss is {loss:g} and the gradient norm {grad_norm:g}, so training stopped "
                        f"without saving it{kept}; lower train.lr in the plan (and resume with --train-from-plan)")


def run(args: argparse.Namespace) -> int:
    """One rank's run: check the plan and options, go on from a checkpoint (a resume or a restart), train, save."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    attempt = _attempt(world)  # first: a start counted by every worker (several nodes)
    plan = load_plan(args.plan)
    if world != plan.world_size:
        raise AutoparError(f"plan {args.plan} needs {plan.world_size} processes ({plan.config.short()}) but "
                           f"{world} were started; use `autopar run` or torchrun --nproc-per-node {plan.world_size}")
    check_supported(plan, args.plan)
    o = RunOptions.from_args(args)
    ckdir = Path(o.checkpoint_dir) if o.checkpoint_dir else None
    going_on = ckdir is not None and (o.resume or attempt > 0)
    if ckdir is not None:
        _check_divergence(ckdir, attempt, rank)
    carried = None
    if going_on and not o.train_from_plan:  # the run's schedule goes on
        from runtime.checkpoint import resumed_train

        plan, carried = resumed_train(plan, ckdir)
    steps = check_run_options(plan, o, {"plan file": args.plan, "--data file": o.data}, attempt,
                              metrics=rank == 0)  # rank 0 writes metrics
    data_path, notes = o.data, []
    if going_on:  # the run goes on with the data it trained on, checkpointed as it was
        from runtime.checkpoint import resumed_data, resumed_options

        data_path, data_note = resumed_data(ckdir, o.data)
        kept, kept_note = resumed_options(ckdir, o.carried())
        o = replace(o, **kept)
        notes = [n for n in (data_note, kept_note) if n]
    data = TokenData(data_path or SAMPLE_TEXT, plan.seq, plan.model.vocab_size, plan.train.seed)
    device = _start_process_group(plan, rank, world, attempt)
    groups = build_groups(plan.config, device.type, tied_embeddings=plan.model.tie_embeddings,
                          experts=plan.model.moe is not None)
    clock = PhaseClock(CudaMarks() if device.type == "cuda" else None)
    comm = CommHooks(groups.group_names(), [clock])
    watch = None
    if "MASTER_ADDR" in os.environ:  # under torchrun: a store every rank reaches
        from runtime.watchdog import Watchdog

        watch = Watchdog(groups, _store("watchdog", attempt), o.collective_timeout).start()
        comm.add(watch)
    comm.start()
    try:  # (a run that fails leaves torch.distributed as it found it: unpatched, no watchdog thread)
        trainer = Trainer(plan, groups, device, data, steps, clock)
        reached = (last_step(o.metrics_out) or 0) if attempt and rank == 0 else 0
        resume = o.resume or (attempt > 0 and ckdir is not None and _has_checkpoint(ckdir))
        if resume:
            from runtime.checkpoint import load_checkpoint

            load_checkpoint(trainer, ckdir)
        log = MetricsLog(plan, o.metrics_out, steps, enabled=rank == 0, quiet=o.quiet, append=resume or attempt > 0,
                         predicted_step_s=args.predicted_step_time, predicted_memory_GiB=args.predicted_memory,
                         plan_path=str(Path(args.plan).resolve()), gpu=device.type == "cuda")
        if attempt:
            lost = max(0, reached - trainer.step)  # (known from the metrics file; without one, not said)
            log.event(event="restart", attempt=attempt, resumed_after_step=trainer.step, lost_steps=lost)
            if rank == 0 and not o.quiet:
                redo = f"redoing {lost} step(s)" if o.metrics_out else "redoing the steps trained since it"
                print(f"autopar: restart {attempt} after a worker failed: resuming after step {trainer.step}, {redo}",
                      flush=True)
        elif resume:  # where a resumed run's lines begin (its first step is a warm-up again)
            log.event(event="resume", resumed_after_step=trainer.step, plan_config=plan.config.short())
        if rank == 0 and not o.quiet:
            _say_what_runs(plan, device, trainer.step if resume else None, steps, carried,
                           notes if attempt == 0 else [])
        _train(o, trainer, log, clock, watch, StepHooks.from_env(rank, attempt, plan.config.short()), ckdir)
        log.close()
    finally:
        comm.stop()
        if watch is not None:
            watch.stop()
    dist.destroy_process_group()
    return 0


def _check_divergence(ckdir: Path, attempt: int, rank: int) -> None:
    """Stop a restart after a divergence (it would diverge again); a first attempt forgets an earlier one."""
    from runtime.checkpoint import forget_divergence, repeated_divergence

    repeat = repeated_divergence(ckdir) if attempt > 0 else None
    if repeat:
        raise AutoparError(repeat)
    if attempt == 0 and rank == 0:
        forget_divergence(ckdir)


def _has_checkpoint(ckdir: Path) -> bool:
    return latest_checkpoint(ckdir) is not None


def _start_process_group(plan: PlanFile, rank: int, world: int, attempt: int) -> torch.device:
    """Join the run's process group (NCCL on this rank's GPU for a CUDA plan where there is CUDA, else gloo on
    CPU); returns the rank's device."""
    cuda = torch.cuda.is_available() and plan.cluster.backend == "nccl"  # a gloo (CPU) plan stays on CPUs
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    if "MASTER_ADDR" in os.environ and attempt:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        dist.init_process_group(backend, store=_store("rendezvous", attempt, host=not agent and rank == 0), rank=rank,
                                world_size=world)
    elif "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:  # a one-rank plan started without torchrun
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def _say_what_runs(plan: PlanFile, device: torch.device, resumed_after: int | None, steps: int, carried: str | None,
                   notes: list[str]) -> None:
    """Rank 0's opening lines: what trains where and from where, what a resume carried over, and notes on the
    schedule's length and a CUDA plan run on CPUs."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    where = f"resuming after step {resumed_after}" if resumed_after is not None else "from scratch"
    print(f"autopar: training {plan.model.name} on {counted(plan.world_size, backend + ' rank')} "
          f"({plan.config.short()}), global batch {plan.global_batch} x {plan.seq} tokens, {counted(steps, 'step')}, "
          f"{where}", flush=True)
    for note in (carried, *notes):  # only a resume carries settings over
        if note:
            print(f"autopar: note: {note}", flush=True)
    if steps > plan.train.steps:
        whose = "the checkpoint's run's" if carried else "the plan's"
        print(f"autopar: note: the learning-rate schedule is {whose} ({plan.train.steps} steps): steps after "
              f"{plan.train.steps} run at min_lr {plan.train.min_lr:g}; set train.steps in the plan (autopar plan "
              "--steps N) for a longer schedule" + (" and resume with --train-from-plan" if resumed_after is not None
                                                    else ""), flush=True)
    if plan.cluster.backend == "nccl" and device.type != "cuda":
        print(f"autopar: note: no CUDA here; running the {plan.cluster.name} plan on CPU with gloo in fp32", flush=True)


def _train(o: RunOptions, trainer: Trainer, log: MetricsLog, clock: PhaseClock, watch: Any,
           hooks: StepHooks, ckdir: Path | None) -> None:
    """The steps up to ``trainer.steps``: each timed and recorded (every rank's phases and memory peaks when metrics
    are written), a diverged step stopping the run unsaved, checkpoints every ``--checkpoint-every`` steps and at
    the end (the first timed for ``--mtbf-hours``'s advice)."""
    steps, plan, rank = trainer.steps, trainer.plan, dist.get_rank()
    every = o.checkpoint_every if o.checkpoint_every is not None else plan.train.checkpoint_every
    advise = o.mtbf_hours is not None
    while trainer.step < steps:
        hooks.before_step(trainer.step + 1, clock)
        t0 = time.perf_counter()
        clock.begin()
        st = trainer.train_step()
        hooks.after_step()
        step_s = time.perf_counter() - t0
        phases = clock.take()
        if watch is not None:
            watch.stepped(trainer.step)
        every_rank = None
        if o.metrics_out:  # every rank's phase times and memory peaks, for the metrics file
            alloc, reserved = peak_memory_GiB(trainer.device)
            every_rank = _gather_ranks({**phases, "allocated": alloc, "reserved": reserved}, trainer.g.world,
                                       trainer.device)
        peak = (st.peak_memory_GiB, st.peak_reserved_GiB) if every_rank is None else (  # read later than the
            max(every_rank["allocated"]), max(every_rank["reserved"]))  # step's: the ranks' largest, as the metrics say
        log.record(trainer.step, st.loss, st.grad_norm, st.lr, step_s, *peak,
                   None if every_rank is None else {p: every_rank[p] for p in PHASES},
                   None if every_rank is None else (every_rank["allocated"], every_rank["reserved"]))
        if not (math.isfinite(st.loss) and math.isfinite(st.grad_norm)):  # every rank sees the same two numbers
            if ckdir is not None:
                from runtime.checkpoint import mark_diverged

                mark_diverged(ckdir, trainer.step, rank)
            raise diverged(trainer.step, st.loss, st.grad_norm, ckdir)
        if ckdir is not None and ((every and trainer.step % every == 0) or trainer.step == steps):
            from runtime.checkpoint import save_checkpoint

            t_save = time.perf_counter()
            save_checkpoint(trainer, ckdir, o.keep_checkpoints or KEEP_CHECKPOINTS, o.carried())
            if advise:
                advise = False
                _advise_interval(log, trainer.step, time.perf_counter() - t_save, step_s, o.mtbf_hours, every,
                                 quiet=o.quiet or rank != 0)


def main(argv: list[str] | None = None) -> int:
    rank = os.environ.get("RANK", "0")
    try:
        args = parse_args(argv)
        with held_by_rank(Path(args.checkpoint_dir) if args.checkpoint_dir else None, int(rank)):
            return run(args)
    except AutoparError as err:
        report(str(err), broke=isinstance(err, RunFailed))
        return err.exit_code  # 2 a bad input, 1 a run that broke on its way (RunFailed): the launcher tells them apart
    except KeyboardInterrupt:
        return INTERRUPTED
    except BaseException as err:  # noqa: BLE001 - one line per rank (some libraries' errors, DCP's
        # CheckpointException, derive from BaseException); AUTOPAR_DEBUG=1 for the traceback
        if isinstance(err, (SystemExit, GeneratorExit)):
            raise
        if os.environ.get("AUTOPAR_DEBUG"):
            traceback.print_exc()
        msg = " ".join(str(err).split())[:300]
        report(f"rank {rank}: {type(err).__name__}: {msg}")
        return 1


if __name__ == "__main__":
    code = main()
    if code == 0:  # a finished run closed what it wrote: skip the interpreter's teardown of torch (0.7 s a launch of
        # 4 ranks on 2 cores, every `autopar run` and `tune` trial) with nothing left to flush but the console
        with contextlib.suppress(OSError):  # (a launcher gone: nothing to tell it)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(0)
    sys.exit(code)
