"""``autopar run``: check a plan, then start torchrun with its world size here (or print the multi-node commands).

:func:`launch` is what the CLI calls (``autopar run`` with no plan first writes the planner's default, a tiny
Llama on 4 CPU ranks: ``planner/defaults.py``). Workers run ``runtime.train``;
their stderr goes to a log file, and a failure comes back as one :class:`AutoparError` line (the first
``autopar error:`` a worker printed, or the exit status) naming that log.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from runtime.checkpoint_folder import (
    HELD_ENV,
    abandoned,
    checkpoint_step,
    in_use,
    latest_checkpoint,
    newest_is_broken,
    no_checkpoint,
    roll_back,
    step_folders,
)
from runtime.data import CHECKED_ENV, SAMPLE_TEXT, TokenData
from runtime.ends_with import LAUNCHER_ENV, ends_with
from runtime.metrics import last_step
from runtime.options import CARRIED, RunOptions, add_run_arguments, check_run_options, worker_argv
from specs.errors import ERROR_PREFIX, INTERRUPTED, WORKER_BROKE_PREFIX, WORKER_ERROR_PREFIX, AutoparError, RunFailed
from specs.planfile import PlanFile, load_plan

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PORT = 29500  # node rank 0's rendezvous port in the printed multi-node commands (torchrun's default)
SHARED = ("the paths are absolute: keep them on a file system every node mounts; MASTER_ADDR: node rank 0's host, "
          "set on each node")


def local_gpus() -> int | None:
    """GPUs on this machine, or None when there are none (CPU ranks: any number)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else None
    except ImportError:
        return None


def multi_node_commands(plan: PlanFile, worker: list[str], max_restarts: int = 0) -> list[str]:
    """The torchrun line to run on every node, and the equivalent srun line for Slurm; for a plan placed on node
    groups, one line per group (:func:`group_commands`)."""
    if plan.config.placement is not None or len(set(plan.cluster.node_gpus.values())) > 1:
        return group_commands(plan, worker, max_restarts)
    nodes = -(-plan.world_size // plan.cluster.gpus_per_node)
    per_node = plan.world_size // nodes
    tail = " ".join(shlex.quote(a) for a in worker)

    def rdzv(run_id: str) -> str:
        return f"--rdzv-backend c10d --rdzv-id {run_id}" + (f" --max-restarts {max_restarts}" if max_restarts else "")

    # srun runs it through each node's bash, which finds node 0's host there: quoted whole for the shell it is typed in
    on_node = (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} {rdzv('autopar-$SLURM_JOB_ID')} "
               f"--rdzv-endpoint $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1):{PORT} {tail}")
    return [
        f"torchrun --nnodes {nodes} --nproc-per-node {per_node} {rdzv('autopar')} --rdzv-endpoint $MASTER_ADDR:{PORT} "
        f"{tail}",
        f"srun --nodes {nodes} --ntasks-per-node 1 bash -c {shlex.quote(on_node)}",
    ]


def worker_command(plan_path: str, steps: int, metrics_out: str, data: str | None = None) -> list[str]:
    """What to run on every node of a multi-node plan for ``steps`` steps with metrics (:func:`multi_node_commands`,
    as `autopar run` prints them)."""
    plan_path, data, metrics_out = (_absolute(p) for p in (plan_path, data, metrics_out))
    worker = worker_argv(plan_path, RunOptions(steps=steps, data=data, metrics_out=metrics_out))
    return multi_node_commands(load_plan(plan_path), ["-m", "runtime.train", *worker])


def _absolute(path: str | None) -> str | None:
    """A path as every node reads it (the commands for other nodes run in a folder of their own), ``..`` taken out."""
    return None if path is None else os.path.abspath(path)


def group_nodes(plan: PlanFile) -> list[tuple[str, int, int]]:
    """(group, first node rank, nodes) of each run of nodes a plan on node groups puts on one group, in rank order:
    from global rank 0, each node holds the next ``gpus_per_node`` ranks of its group (``ParallelConfig.rank_group``
    says which for a placed plan; the rules keep a node's GPUs in one group; a plan without a placement, on groups
    whose nodes differ in size, takes the groups' nodes in profile order)."""
    cfg = plan.config
    per_node = plan.cluster.node_gpus
    order = [g.name for g in plan.cluster.node_groups for _ in range(g.num_nodes * g.gpus_per_node)]
    out: list[tuple[str, int, int]] = []
    rank = node = 0
    while rank < plan.world_size:  # without a placement, the groups' nodes in profile order
        g = order[rank] if cfg.placement is None else cfg.rank_group(rank)
        if out and out[-1][0] == g:
            out[-1] = (g, out[-1][1], out[-1][2] + 1)
        else:
            out.append((g, node, 1))
        rank, node = rank + per_node[g], node + 1
    return out


def group_commands(plan: PlanFile, worker: list[str], max_restarts: int = 0) -> list[str]:
    """One torchrun line per run of a group's nodes, each node told its rank and its GPUs (static rendezvous:
    torchrun's c10d rendezvous numbers nodes in the order they join, and the placement needs each group's nodes at
    its ranks; torchrun gives each node the ranks after those of the nodes before it)."""
    runs = group_nodes(plan)
    nodes = sum(count for _, _, count in runs)
    per_node = plan.cluster.node_gpus
    tail = " ".join(shlex.quote(a) for a in worker)
    out = [f"# every node: MASTER_ADDR=<the host of node rank 0, the first {runs[0][0]} node>"]
    for g, first, count in runs:
        ranks = f"{first}" if count == 1 else f"{first}-{first + count - 1}"
        out.append(f"# group {g}, node ranks {ranks}: on its node i (i = 0..{count - 1})")
        restarts = f"--max-restarts {max_restarts} " if max_restarts else ""
        out.append(f"torchrun --nnodes {nodes} --nproc-per-node {per_node[g]} --node-rank $(({first} + i)) "
                   f"{restarts}--master-addr $MASTER_ADDR --master-port {PORT} {tail}")
    return out


def launch(plan_path: str, options: RunOptions | None = None, nproc: int | None = None,
           env: dict[str, str] | None = None, timeout_s: float | None = None, predicted_step_s: float | None = None,
           predicted_memory_GiB: float | None = None, resumable: bool = True) -> int:
    """Validate everything cheap to validate, then run the plan under torchrun with ``options``; returns 0 on
    success. ``options.max_restarts``: torchrun restarts every worker up to that many times after one dies; they
    resume from the latest checkpoint (``runtime.train`` works out which start of the workers it is: ``_attempt``).
    ``predicted_step_s`` / ``predicted_memory_GiB``: the step time and peak memory the metrics carry as predicted
    (the planner's fresh estimate of a plan edited since its prediction; default: the plan's).
    ``resumable``: whether the caller can resume the run (`autopar run`): its Ctrl-C line then says how (a tune's
    trial cannot: it says only where the trial stopped).

    Raises AutoparError (one line) for a bad plan, data file or checkpoint directory, a world size this
    machine cannot hold, failed workers, or workers still running after ``timeout_s`` seconds (stopped).
    """
    o = options or RunOptions()
    checkpoint_dir, resume = o.checkpoint_dir, o.resume
    with in_use(Path(checkpoint_dir)) if checkpoint_dir and not o.dry_run else contextlib.nullcontext():
        # (one run at a time in the folder, from its checks to its end)
        plan = load_plan(plan_path)
        world = plan.world_size
        if nproc is not None and nproc != world:
            raise AutoparError(f"the plan needs {world} processes ({plan.config.short()}), not {nproc}")
        from runtime.trainer import check_supported

        check_supported(plan, plan_path)
        if resume and checkpoint_dir and not o.train_from_plan:  # the steps the workers run: the schedule they take
            from runtime.checkpoint import resumed_train

            plan, _ = resumed_train(plan, Path(checkpoint_dir))
        total = check_run_options(plan, o, {"plan file": plan_path, "--data file": o.data})
        if checkpoint_dir:
            check_checkpoints(Path(checkpoint_dir), resume, total, plan, o.dry_run)
        trained_on = o.data
        if resume and checkpoint_dir:  # the file the checkpoint's run trained on, unless --data gives another
            from runtime.checkpoint import resumed_data

            trained_on, _ = resumed_data(Path(checkpoint_dir), o.data)
        tokens = TokenData(trained_on or SAMPLE_TEXT, plan.seq, plan.model.vocab_size, plan.train.seed)  # errors now
        if total * plan.global_batch > tokens.windows:  # the run reads the file more than once: said, not silent
            print(f"autopar: {trained_on or 'the bundled sample'} holds {tokens.windows:,} sequences of {plan.seq} "
                  f"tokens; the run's {total * plan.global_batch:,} read it "
                  f"{total * plan.global_batch / tokens.windows:.3g} times over, in a new order each pass", flush=True)
        spans = _spans_nodes(plan)
        at = _absolute if spans else (lambda p: p)  # each node's shell is in a folder of its own
        placed = replace(o, data=at(o.data), metrics_out=at(o.metrics_out), checkpoint_dir=at(checkpoint_dir))
        worker = ["-m", "runtime.train", *worker_argv(str(at(plan_path)), placed, predicted_step_s,
                                                       predicted_memory_GiB)]
        gpus = local_gpus()
        if not spans and gpus is not None and world > gpus:
            raise AutoparError(f"the plan needs {world} GPUs but this machine has {gpus}; run it on its cluster "
                               f"({plan.cluster.name}) or re-plan with --gpus {gpus}")
        if resume and checkpoint_dir:  # from a checkpoint older than others (latest pointed back): set aside, the run
            root = Path(checkpoint_dir)  # checked (several nodes: their shared folder, seen from here) and the
            if abandoned(root) and not o.dry_run:  # checkpoint it goes on from whole (the workers' check comes after
                # the move; a dry run moves nothing)
                from runtime.checkpoint import check_whole

                check_whole(latest_checkpoint(root))
            _roll_back(root, o.dry_run)
        if spans:
            print(f"autopar: this plan spans several nodes; run on every node ({SHARED}):\n  " +
                  "\n  ".join(multi_node_commands(plan, worker, o.max_restarts)), flush=True)
            return 0
        args = ["--standalone", "--nproc-per-node", str(world),
                *o.flags("max_restarts"), *worker]
        if o.dry_run:
            print(" ".join(shlex.quote(c) for c in TORCHRUN + args), flush=True)
            return 0
        full_env = {**os.environ, **(env or {})}
        # autopar's own packages first: `-m` would put the current folder first on the workers' path, where a
        # project's own `runtime` or `specs` package would shadow ours (Python >= 3.11 honours PYTHONSAFEPATH); the
        # current folder stays on the path, last, for a model factory the user keeps beside the plan
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH"), os.getcwd()]))
        full_env["PYTHONSAFEPATH"] = "1"
        full_env.setdefault("OMP_NUM_THREADS", "1")
        if checkpoint_dir:  # held here: the workers' rank 0 does not take it again
            full_env[HELD_ENV] = str(Path(checkpoint_dir).resolve())
        full_env[CHECKED_ENV] = tokens.verdict()  # the data file checked here: its workers do not read it again
        full_env[LAUNCHER_ENV] = str(os.getpid())  # (a worker whose agent ended before it could follow it: ends_with)
        kept = o.flags(*CARRIED, "max_restarts")  # the resume command keeps them
        try:
            rc = _run_workers(args, full_env, timeout_s)
        except AutoparError as caught:  # a worker failed: where to go on from, unless the error says already (or
            # is about that checkpoint: a corrupt one)
            moved = tokens.changed()  # (a truncated file kills a worker with SIGBUS, which names no file)
            err = AutoparError(f"{moved}: {caught}; give --data a file that stays as it is for the whole run"
                               ) if moved else caught  # (a file changed under the run: the input, exit 2)
            again = resume_command(plan_path, total, o.metrics_out, checkpoint_dir, kept)
            last = latest_checkpoint(Path(checkpoint_dir)) if checkpoint_dir else None
            if not resumable or again is None or "resume" in str(caught) or str(last) in str(caught):
                raise err from None
            raise type(err)(f"{err}; {again}") from None
        if rc == INTERRUPTED:
            line = interrupted(plan_path, total, o.metrics_out, checkpoint_dir, resumable, kept)
            print(f"autopar: {line}", file=sys.stderr, flush=True)
        elif rc == 0 and not o.quiet:
            print(f"autopar: {finished(total, o.metrics_out, checkpoint_dir)}", flush=True)
        return rc


def finished(steps: int, metrics_out: str | None, checkpoint_dir: str | None) -> str:
    """What a run that reached its last step left behind, and where."""
    parts = [f"reached step {steps}"]
    newest = latest_checkpoint(Path(checkpoint_dir)) if checkpoint_dir else None
    if newest is not None:
        parts.append(f"checkpoints in {checkpoint_dir} (newest {newest.name}; `--resume` goes on from it)")
    if metrics_out:
        parts.append(f"metrics in {metrics_out}")
    return "; ".join(parts)


def check_checkpoints(root: Path, resume: bool, total_steps: int, plan: PlanFile | None = None,
                      dry_run: bool = False) -> None:
    """What ``root`` holds suits the run: with ``resume`` a checkpoint short of ``total_steps`` of the same run as
    ``plan``; without, no run's checkpoints (a fresh run would write over them and mix two runs in one folder). A
    ``dry_run`` may be printing the command for other machines: a checkpoint of the plan's run on GPUs or on CPUs
    (which keep another state) passes."""
    broken = newest_is_broken(root) if resume else None
    if broken:
        raise broken
    held = [] if resume else step_folders(root)
    if held:  # complete or not: a fresh run's checkpoints would mix with them
        raise AutoparError(f"{root} holds a run's checkpoints (the newest {held[-1].name}); add --resume to continue "
                           "that run, or give an empty or new --checkpoint-dir")
    last = latest_checkpoint(root)
    if resume and last is None:
        raise no_checkpoint(root)
    if resume and checkpoint_step(last) >= total_steps:
        raise AutoparError(f"the checkpoint in {root} is at step {checkpoint_step(last)}, and this run stops at step "
                           f"{total_steps}: nothing to train; give a larger --steps")
    if resume and plan is not None:  # another run's checkpoint: refused here, not by every worker after launch
        import torch

        from runtime.checkpoint import read_meta, same_run
        from runtime.trainer import executed_state

        meta = read_meta(last)
        on_gpus = local_gpus() is not None or _spans_nodes(plan)
        devices = ["cuda", "cpu"] if dry_run else ["cuda" if on_gpus else "cpu"]
        refusals = []
        for device in devices:
            try:
                same_run(last, meta, plan, executed_state(plan, torch.device(device)))
                return
            except AutoparError as err:
                refusals.append(err)
        raise refusals[0 if on_gpus else -1]


def _roll_back(root: Path, dry_run: bool) -> None:
    """Set aside the checkpoints newer than the one a resume goes on from (:func:`roll_back`), saying so; a dry run
    says what the run would move."""
    if dry_run:
        newer = abandoned(root)
        if newer:
            print(f"autopar: a dry run moves nothing; the run would move {', '.join(p.name for p in newer)} (newer "
                  f"than {latest_checkpoint(root).name}, which it resumes from) into a rolled-back folder in {root}",
                  flush=True)
        return
    done = roll_back(root)
    if done:  # (even with --quiet: it moved the user's files)
        print(f"autopar: {done}", flush=True)


def _spans_nodes(plan: PlanFile) -> bool:
    """Whether the plan runs on several nodes (launch prints each node's command: the workers run on its GPUs)."""
    return plan.cluster.num_nodes > 1 and plan.world_size > plan.cluster.gpus_per_node


def interrupted(plan_path: str, steps: int, metrics_out: str | None, checkpoint_dir: str | None,
                resumable: bool = True, options: list[str] | None = None) -> str:
    """One line after Ctrl-C (or a stop signal): the step reached (from the metrics), the last complete checkpoint and
    the command that resumes from it, with the run's checkpointing ``options`` (where the caller can resume at
    all)."""
    reached = last_step(metrics_out)
    text = f"interrupted after step {reached} of {steps}" if reached is not None else "interrupted"
    if not resumable:
        return text
    if not checkpoint_dir:
        return text + "; no checkpoints were kept (give --checkpoint-dir to be able to resume)"
    last = latest_checkpoint(Path(checkpoint_dir))
    if last is not None and checkpoint_step(last) >= steps:  # stopped after the last step's checkpoint
        return f"{text}; the run's last checkpoint, {last}, is at its last step: nothing is left to train"
    again = resume_command(plan_path, steps, metrics_out, checkpoint_dir, options)
    if again is None:
        return text + f"; no complete checkpoint in {checkpoint_dir} yet: run again from the start"
    return f"{text}; {again}"


def resume_command(plan_path: str, steps: int, metrics_out: str | None, checkpoint_dir: str | None,
                   options: list[str] | None = None) -> str | None:
    """``last complete checkpoint: ...; resume with: autopar run ... --resume ...`` (the run's checkpointing
    ``options`` kept), or None where there is no checkpoint to resume from."""
    last = latest_checkpoint(Path(checkpoint_dir)) if checkpoint_dir else None
    if last is None:
        return None
    again = ["autopar", "run", plan_path, "--checkpoint-dir", str(checkpoint_dir), "--resume"]
    again += ["--steps", str(steps)] + (["--metrics-out", metrics_out] if metrics_out else []) + (options or [])
    return f"last complete checkpoint: {last}; resume with: " + " ".join(shlex.quote(a) for a in again)


@contextlib.contextmanager
def _stopped_by(*signals: int) -> Iterator[None]:
    """While the workers run, a stop signal (a scheduler's or `kill`'s SIGTERM, a closed terminal's SIGHUP) stops
    them as Ctrl-C does: without it this process died alone, and torchrun and its workers trained on."""
    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():  # (signals reach the main thread only)
        yield
        return
    old = {s: signal.signal(s, stop) for s in signals}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _run_workers(args: list[str], env: dict[str, str], timeout_s: float | None = None) -> int:
    """Run torchrun with ``args``: 0, :data:`INTERRUPTED`, or an error naming the workers' log.
    torchrun's own folder (its per-attempt files; without ``--log-dir``, one ``torchelastic_*`` folder left in the
    temporary folder for every run) is a temporary one removed after the run: what failed is in the workers' log."""
    folder = tempfile.mkdtemp(prefix="autopar-torchrun-")
    try:
        return _logged_run([*TORCHRUN, "--log-dir", folder, *args], env, timeout_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _logged_run(cmd: list[str], env: dict[str, str], timeout_s: float | None) -> int:
    fd, log_path = tempfile.mkstemp(prefix="autopar-run-", suffix=".log")
    errors: list[str] = []
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace",
                                preexec_fn=ends_with(os.getpid()))

        def pump() -> None:
            for line in proc.stderr:  # type: ignore[union-attr]
                log.write(line)
                if line.startswith((WORKER_ERROR_PREFIX, WORKER_BROKE_PREFIX)) and line not in errors:
                    errors.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            with _stopped_by(signal.SIGTERM, signal.SIGHUP):
                rc = proc.wait(timeout=timeout_s)
        except KeyboardInterrupt:  # the interrupted line says what to do next; the log holds nothing to read
            proc.terminate()  # torchrun stops its workers
            proc.wait()
            os.unlink(log_path)
            return INTERRUPTED
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun stops its workers
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise RunFailed(f"training stopped at its time limit of {timeout_s:g} s (workers' log: {log_path})"
                            ) from None
        reader.join()
    if rc == 0:
        os.unlink(log_path)
        return 0
    text = Path(log_path).read_text(errors="replace")
    why = _failure(text, errors, rc)
    raise (AutoparError if _input_error(why, errors, _root_exit(text)) else RunFailed)(
        f"{why} (workers' log: {log_path})")


def _failure(log: str, errors: list[str], rc: int) -> str:
    """One line on why the workers failed: torchrun's root cause if a worker died of a signal (the others'
    errors are then only about the lost peer) unless the workers stopped with one of autopar's errors first, else
    the first error a worker printed."""
    root = log.rpartition("Root Cause (first observed failure):")[2]
    rank = re.search(r"rank\s*:\s*(\d+)", root)
    code = re.search(r"exitcode\s*:\s*(-?\d+)[^(\n]*(?:\(pid: \d+\))?\s*(\(\w+\))?", root)
    own = [e for e in errors if rank and f"rank {rank.group(1)}:" in e]
    if rank and code and int(code.group(1)) < 0:
        said = [e for e in errors if not re.match(r"rank \d+: ", _worker_text(e))]  # autopar's own errors, not a
        if said and int(code.group(1)) == -signal.SIGABRT:  # lost peer's exception: the workers said why before
            return _worker_text(said[0])  # one aborted on its way out (a kill, say the OOM killer's, is the cause)
        sig = (code.group(2) or f"signal {-int(code.group(1))}").strip("()")
        return f"training failed: worker rank {rank.group(1)} was killed by {sig}"
    hang = [e for e in errors if "stopped making progress" in e]  # the watchdog's verdict: the cause, not a symptom
    if hang:
        return _worker_text(hang[0])
    if errors:
        return _worker_text((own or errors)[0])
    return f"training failed: torchrun exited with status {rc}"


def _root_exit(log: str) -> int | None:
    """The exit status of the worker torchrun reports as the root cause of a failure (negative: a signal), or None."""
    code = re.search(r"exitcode\s*:\s*(-?\d+)", log.rpartition("Root Cause (first observed failure):")[2])
    return int(code.group(1)) if code else None


def _input_error(why: str, errors: list[str], root_exit: int | None) -> bool:
    """Whether the workers stopped on a bad input (exit 2) rather than broke on their way (1): ``why``, the reason
    :func:`_failure` gives, is a worker's own line, not marked as a broken run's (``WORKER_BROKE_PREFIX``), and the
    worker that failed first exited with autopar's status for a bad input; where its status says nothing (a signal
    after its line, none found), a line of autopar's own that is not a worker's internal error (``rank N:
    TypeError: ...``) or the watchdog's hang verdict."""
    said = [e for e in errors if why == _worker_text(e)]
    if not said or any(e.startswith(WORKER_BROKE_PREFIX) for e in said):
        return False  # torchrun's or autopar's own account of a killed worker or a failed start; a worker's RunFailed
    if root_exit is not None and root_exit > 0:
        return root_exit == AutoparError.exit_code
    return not re.match(r"rank \d+: ", why) and "stopped making progress" not in why


def _worker_text(line: str) -> str:
    """A worker's error line without its prefix, and without a second rank's copy run into it (workers write whole
    lines, runtime/worker_error.py; an older or longer write may still interleave)."""
    return re.split(_PREFIXES, re.sub(f"^{_PREFIXES}", "", line))[0].strip()


_PREFIXES = f"(?:{re.escape(WORKER_BROKE_PREFIX)}|{re.escape(WORKER_ERROR_PREFIX)})"



def main(argv: list[str] | None = None) -> int:
    """``python -m runtime.launch [plan.json] [--steps N] ...``: the same as ``autopar run``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m runtime.launch", description=__doc__.splitlines()[0])
    add_run_arguments(ap)
    a = ap.parse_args(argv)
    try:
        if a.plan is None:
            raise AutoparError("give a plan file (`autopar plan ... --out plan.json`); `autopar run` with no plan "
                               "plans and trains a tiny default model")
        if a.replan or a.gpus is not None or a.resume_from is not None:
            raise AutoparError("--replan, --gpus and --resume-from are `autopar run`'s: use `autopar run --resume "
                               "--replan --gpus N` or `autopar run PLAN --resume-from STEP`")
        return launch(a.plan, RunOptions.from_args(a))
    except AutoparError as err:
        print(f"{ERROR_PREFIX} {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
