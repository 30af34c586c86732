"""The inputs every planning command shares (model, cluster, global batch, headroom) and their progress line."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from cost_models.headroom import check_headroom
from specs.errors import AutoparError


def load_inputs(args: argparse.Namespace, cores_note: bool = True) -> tuple[Any, Any]:
    """The model and the (resized) cluster of an estimate / plan / whatif command, with the common options checked."""
    from specs.cluster_loading import load_cluster
    from specs.model import MAX_GLOBAL_BATCH, size_problem
    from specs.model_loading import load_model

    notes: list[str] = []
    model = load_model(args.model, args.seq, notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    cluster = load_cluster(args.cluster, gpus=args.gpus, nodes=args.nodes)
    if args.allow_cross_node_tp:
        cluster = cluster.model_copy(update={"tp_across_nodes": True})
    if cores_note and cluster.compute_slowdown > 1:  # a CPU profile's node holds more ranks than it runs at once
        print(f"note: {cluster.name}: {cluster.gpus_per_node} ranks a node share its {cluster.gpu.cores} cores (each "
              f"priced {cluster.compute_slowdown:.3g}x slower); --gpus {cluster.gpu.cores} plans a core each",
              file=sys.stderr)
    b = args.global_batch
    problem = None if b is None else size_problem("--global-batch", b, MAX_GLOBAL_BATCH)
    if problem:
        raise AutoparError(problem)
    check_headroom(args.headroom, cluster)
    return model, cluster


def spec_files(args: argparse.Namespace) -> dict[str, str | None]:
    """The model spec and cluster profile a command reads, by what they are (for outputs not to overwrite)."""
    return {"model spec": args.model, "cluster profile": args.cluster}


def progress_line(done: int, total: int, elapsed_s: float, share: float | None = None, what: str = "candidates"
                  ) -> str:
    """``priced 1,200/17,709 candidates, about 14 s left``: the rate so far carried to the end, of the work done
    (``share``, where the pricing knows it) or else of the candidates."""
    line = f"priced {done:,}/{total:,} {what}"
    part = share if share is not None else done / total if total else 0.0
    if 0 < part < 1 and elapsed_s > 0:
        left = elapsed_s / part * (1 - part)
        line += f", about {left:.0f} s left" if left < 120 else f", about {left / 60:.0f} min left"
    return line


PLAIN_EVERY_S = 30.0  # off a terminal (a batch job's log), a progress line at most this often, after as long


def progress(what: str = "candidates"):
    """A progress callback ``(done, total, share=None)`` printing to stderr for long work (never on stdout, so JSON
    stays clean): ``what`` is priced. Its ``stage(name)`` names another stage of the work, counted and timed from
    then on (a search on node groups: the plans to place ranked, placed, the best placements searched again). On a
    terminal one line rewritten in place; elsewhere (a Slurm log) a plain line every :data:`PLAIN_EVERY_S` seconds
    once the work has taken that long."""
    now = [what, time.perf_counter()]  # the stage of the work and when it began

    def stage(name: str) -> None:
        now[:] = [name, time.perf_counter()]

    if not sys.stderr.isatty():
        last = [now[1]]

        def plain(done: int, total: int, share: float | None = None) -> None:
            t = time.perf_counter()
            if done < total and t - last[0] >= PLAIN_EVERY_S:
                last[0] = t
                print(f"autopar: {progress_line(done, total, t - now[1], share, now[0])}", file=sys.stderr,
                      flush=True)

        plain.stage = stage  # type: ignore[attr-defined]
        return plain

    def report(done: int, total: int, share: float | None = None) -> None:
        if done >= total:  # the work is done: the line is cleared for what follows (a table, an error)
            print(f"\r{' ' * 62}\r", end="", file=sys.stderr, flush=True)
            return
        text = progress_line(done, total, time.perf_counter() - now[1], share, now[0])
        print(f"\r  {text:<60}", end="", file=sys.stderr, flush=True)

    report.stage = stage  # type: ignore[attr-defined]
    return report
