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

Testing hooks: ``AUTOPAR_FAULT=STEP[:RANK]`` makes rank RANK (default 0) kill itself with SIGKILL just before
step STEP (1-based), as a crashed node would (on the first attempt only: a restarted run goes on);
``AUTOPAR_HANG=STEP[:RANK]`` makes it sleep there instead, as a rank stuck in its own work would;
``AUTOPAR_STRAGGLER=RANK:compute:FACTOR[@FIRST[/EVERY]]`` makes rank RANK's forward and backward take FACTOR times
as long on steps FIRST, FIRST + EVERY, ... (default: every step), and ``RANK:send:SECONDS[@FIRST[/EVERY]]`` delays
each of its pipeline sends on those steps (a straggler for ``autopar diagnose``).

Phase times: every rank times its step's phases (:mod:`runtime.phase_clock`); with ``--metrics-out`` each step's
line carries every rank's, ``"phases_s": {phase: [seconds of rank 0, 1, ...]}`` (what ``autopar diagnose`` reads).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.comm_hooks import CommHooks
from runtime.data import SAMPLE_TEXT, TokenData
from runtime.metrics import MetricsLog, last_step
from runtime.options import KEEP_CHECKPOINTS, add_worker_arguments, check_run_options
from runtime.parallel.mappings import all_gather_into
from runtime.parallel.mesh import build_groups
from runtime.phase_clock import CudaMarks, PhaseClock
from runtime.trainer import Trainer, check_supported, peak_memory_GiB
from specs.errors import WORKER_ERROR_PREFIX, AutoparError
from specs.phases import PHASES
from specs.planfile import load_plan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m runtime.train", description=__doc__.splitlines()[0])
    ap.add_argument("plan", help="plan file (autopar plan --out)")
    add_worker_arguments(ap)
    ap.add_argument("--predicted-step-time", type=float, metavar="S",
                    help="the step time metrics carry as predicted (default: the plan's prediction)")
    ap.add_argument("--predicted-memory", type=float, metavar="GIB",
                    help="the peak memory per GPU metrics carry as predicted (default: the plan's prediction)")
    return ap.parse_args(argv)


def _fault_step(rank: int, hook: str = "AUTOPAR_FAULT") -> int | None:
    spec = os.environ.get(hook)
    if not spec or _attempt():
        return None
    step, _, who = spec.partition(":")
    return int(step) if int(who or 0) == rank else None


def _straggler(rank: int) -> tuple[dict[str, float], int, int]:
    """The phase clock's testing hook for this rank, the first step it acts on and every how many steps, from
    ``AUTOPAR_STRAGGLER=RANK:compute:FACTOR[@FIRST[/EVERY]]`` or ``RANK:send:SECONDS[@FIRST[/EVERY]]``."""
    spec = os.environ.get("AUTOPAR_STRAGGLER")
    if not spec:
        return {}, 0, 1
    spec, _, when = spec.partition("@")
    who, kind, amount = spec.split(":")
    if int(who) != rank:
        return {}, 0, 1
    first, _, every = when.partition("/")
    return {"slow_compute" if kind == "compute" else "send_delay_s": float(amount)}, int(first or 1), int(every or 1)


def _gather_ranks(values: dict[str, float], group: dist.ProcessGroup, device: torch.device
                  ) -> dict[str, list[float]]:
    """Every rank's ``values`` (one collective over ``group``): ``{name: [value of rank 0, 1, ...]}``."""
    names = list(values)
    mine = torch.tensor([values[k] for k in names], dtype=torch.float64, device=device)
    every = torch.empty(dist.get_world_size(group) * len(names), dtype=torch.float64, device=device)
    all_gather_into(every, mine, group)
    rows = every.view(-1, len(names)).T.tolist()
    return {k: [float(f"{x:.6g}") for x in rows[i]] for i, k in enumerate(names)}


def _attempt() -> int:
    """How many times torchrun has restarted the workers (0: the first run)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _store(use: str, host: bool = False) -> dist.Store:
    """The run's rendezvous store (torchrun's), under a prefix of this attempt's and ``use``'s own: torchrun's agent
    keeps one store across restarts, where a restarted attempt would otherwise read the previous one's addresses
    (and be refused). ``host``: this process serves it (rank 0, when torchrun's agent does not)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=host)
    return dist.PrefixStore(f"autopar/attempt_{_attempt()}/{use}", store)


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


def _test_delay(plan_keys: str) -> float:
    """Seconds added to every step, for tests only (``AUTOPAR_SLOW="0.5:tp=2 pp=1;30:tp=1"``: plans whose short
    form starts with the text after a colon sleep that long per step)."""
    for item in filter(None, os.environ.get("AUTOPAR_SLOW", "").split(";")):
        seconds, _, prefix = item.partition(":")
        if plan_keys.startswith(prefix):
            return float(seconds)
    return 0.0


def diverged(step: int, loss: float, grad_norm: float, ckdir: Path | None) -> AutoparError:
    """The error that stops a run whose loss or gradient norm is no longer a number, before it is checkpointed (the
    checkpoints from before it are kept)."""
    from runtime.checkpoint import latest_checkpoint

    ck = latest_checkpoint(ckdir) if ckdir is not None else None
    kept = (f"; the checkpoints before it are kept (the newest, {ck}, holds the weights this step started from: if "
            "they are already bad, delete it to resume from an earlier one)") if ck is not None else ""
    return AutoparError(f"step {step}: the loss is {loss:g} and the gradient norm {grad_norm:g}, so training stopped "
                        f"without saving it{kept}; lower train.lr in the plan (and resume with --train-from-plan)")


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world != plan.world_size:
        raise AutoparError(f"plan {args.plan} needs {plan.world_size} processes ({plan.config.short()}) but "
                           f"{world} were started; use `autopar run` or torchrun --nproc-per-node {plan.world_size}")
    check_supported(plan)
    ckdir = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    attempt = _attempt()
    carried = None
    if ckdir is not None:  # torchrun's restart after a divergence would diverge again: stop instead
        from runtime.checkpoint import forget_divergence, repeated_divergence

        repeat = repeated_divergence(ckdir) if attempt > 0 else None
        if repeat:
            raise AutoparError(repeat)
        if attempt == 0 and rank == 0:
            forget_divergence(ckdir)
    if ckdir is not None and (args.resume or attempt > 0) and not args.train_from_plan:  # the run's schedule goes on
        from runtime.checkpoint import resumed_train

        plan, carried = resumed_train(plan, ckdir)
    steps = check_run_options(plan, args.steps, args.checkpoint_dir, args.checkpoint_every,
                              args.metrics_out if rank == 0 else None, args.resume,
                              mtbf_hours=args.mtbf_hours, collective_timeout=args.collective_timeout,
                              inputs={"plan file": args.plan, "--data file": args.data},
                              keep_checkpoints=args.keep_checkpoints)  # rank 0 writes metrics
    data_path, data_note = args.data, None
    if ckdir is not None and (args.resume or attempt > 0):  # the run goes on with the data it trained on
        from runtime.checkpoint import resumed_data

        data_path, data_note = resumed_data(ckdir, args.data)
    data = TokenData(data_path or SAMPLE_TEXT, plan.seq, plan.model.vocab_size, plan.train.seed)
    cuda = torch.cuda.is_available() and plan.cluster.backend == "nccl"  # a gloo (CPU) plan stays on CPUs
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    if "MASTER_ADDR" in os.environ and attempt:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        dist.init_process_group(backend, store=_store("rendezvous", host=not agent and rank == 0), rank=rank,
                                world_size=world)
    elif "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:  # a one-rank plan started without torchrun
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    groups = build_groups(plan.config, device.type, tied_embeddings=plan.model.tie_embeddings,
                          experts=plan.model.moe is not None)
    clock = PhaseClock(CudaMarks() if cuda else None)
    straggle, straggle_from, straggle_every = _straggler(rank)
    hooks = CommHooks(groups.group_names(), [clock])
    watch = None
    if "MASTER_ADDR" in os.environ:  # under torchrun: a store every rank reaches
        from runtime.watchdog import Watchdog

        watch = Watchdog(groups, _store("watchdog"), args.collective_timeout).start()
        hooks.add(watch)
    hooks.start()
    trainer = Trainer(plan, groups, device, data, steps, clock)
    reached = (last_step(args.metrics_out) or 0) if attempt and rank == 0 else 0
    if ckdir is not None:
        from runtime.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    resume = args.resume or (attempt > 0 and ckdir is not None and latest_checkpoint(ckdir) is not None)
    if resume:
        load_checkpoint(trainer, ckdir)
    every = args.checkpoint_every if args.checkpoint_every is not None else plan.train.checkpoint_every
    log = MetricsLog(plan, args.metrics_out, steps, enabled=rank == 0, quiet=args.quiet, append=resume or attempt > 0,
                     predicted_step_s=args.predicted_step_time, predicted_memory_GiB=args.predicted_memory,
                     plan_path=str(Path(args.plan).resolve()), gpu=cuda)
    if attempt:
        lost = max(0, reached - trainer.step)
        log.event(event="restart", attempt=attempt, resumed_after_step=trainer.step, lost_steps=lost)
        if rank == 0 and not args.quiet:
            print(f"autopar: restart {attempt} after a worker failed: resuming after step {trainer.step}, "
                  f"redoing {lost} step(s)", flush=True)
    if rank == 0 and not args.quiet:
        where = f"resuming after step {trainer.step}" if resume else "from scratch"
        print(f"autopar: training {plan.model.name} on {world} {backend} ranks ({plan.config.short()}), "
              f"global batch {plan.global_batch} x {plan.seq} tokens, {steps} steps, {where}", flush=True)
        for note in (carried, data_note if attempt == 0 else None):  # only a resume carries settings over
            if note:
                print(f"autopar: note: {note}", flush=True)
        if steps > plan.train.steps:
            whose = "the checkpoint's run's" if carried else "the plan's"
            print(f"autopar: note: the learning-rate schedule is {whose} ({plan.train.steps} steps): steps after "
                  f"{plan.train.steps} run at min_lr {plan.train.min_lr:g}; set train.steps in the plan (autopar plan "
                  "--steps N) for a longer schedule" + (" and resume with --train-from-plan" if resume else ""),
                  flush=True)
        if plan.cluster.backend == "nccl" and not cuda:
            print(f"autopar: note: no CUDA here; running the {plan.cluster.name} plan on CPU with gloo in fp32",
                  flush=True)
    fault, hang, delay = _fault_step(rank), _fault_step(rank, "AUTOPAR_HANG"), _test_delay(plan.config.short())
    advise = args.mtbf_hours is not None
    while trainer.step < steps:
        if fault == trainer.step + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if hang == trainer.step + 1:
            time.sleep(1e9)
        if straggle:
            n = trainer.step + 1 - straggle_from
            clock.inject(**(straggle if n >= 0 and n % straggle_every == 0 else {}))
        t0 = time.perf_counter()
        clock.begin()
        st = trainer.train_step()
        time.sleep(delay)
        step_s = time.perf_counter() - t0
        phases = clock.take()
        if watch is not None:
            watch.stepped(trainer.step)
        every_rank = None
        if args.metrics_out:  # every rank's phase times and memory peaks, for the metrics file
            alloc, reserved = peak_memory_GiB(device)
            every_rank = _gather_ranks({**phases, "allocated": alloc, "reserved": reserved}, groups.world, device)
        log.record(trainer.step, st.loss, st.grad_norm, st.lr, step_s, st.peak_memory_GiB, st.peak_reserved_GiB,
                   None if every_rank is None else {p: every_rank[p] for p in PHASES},
                   None if every_rank is None else (every_rank["allocated"], every_rank["reserved"]))
        if not (math.isfinite(st.loss) and math.isfinite(st.grad_norm)):  # every rank sees the same two numbers
            if ckdir is not None:
                from runtime.checkpoint import mark_diverged

                mark_diverged(ckdir, trainer.step, rank)
            raise diverged(trainer.step, st.loss, st.grad_norm, ckdir)
        if ckdir is not None and ((every and trainer.step % every == 0) or trainer.step == steps):
            t_save = time.perf_counter()
            save_checkpoint(trainer, ckdir, args.keep_checkpoints or KEEP_CHECKPOINTS)
            if advise:
                advise = False
                _advise_interval(log, trainer.step, time.perf_counter() - t_save, step_s, args.mtbf_hours, every,
                                 quiet=args.quiet or rank != 0)
    log.close()
    hooks.stop()
    if watch is not None:
        watch.stop()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    rank = os.environ.get("RANK", "0")
    try:
        return run(parse_args(argv))
    except AutoparError as err:
        print(f"{WORKER_ERROR_PREFIX} {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as err:  # noqa: BLE001 - one line per rank; AUTOPAR_DEBUG=1 for the traceback
        if os.environ.get("AUTOPAR_DEBUG"):
            traceback.print_exc()
        msg = " ".join(str(err).split())[:300]
        print(f"{WORKER_ERROR_PREFIX} rank {rank}: {type(err).__name__}: {msg}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
