"""Per-step metrics: one JSON line per step (rank 0) and a progress line on stdout.

Each line: ``step, loss, grad_norm, lr, step_time_s, predicted_step_time_s, tokens_per_s, mfu,
peak_memory_GiB, peak_reserved_GiB, predicted_memory_GiB, plan`` (the plan file's absolute path),
``phases_s`` (every rank's phase times, runtime/phase_clock.py), and every rank's peaks beside its prediction:
``peak_memory_GiB_per_rank``, ``peak_reserved_GiB_per_rank``, ``predicted_memory_GiB_per_rank`` (its pipeline
stage's, from the plan's prediction). ``peak_memory_GiB`` and ``peak_reserved_GiB`` are
the fullest rank's (CUDA: allocated and reserved by the caching allocator; CPU: the process's peak RSS, both),
beside the memory the plan predicted per GPU (a loss or gradient norm that is not a number is written null: strict
JSON). MFU = model FLOPs (``ModelSpec.model_flops_per_token``, no recompute) x tokens / (step time x the peak of
the GPUs the plan runs on, ``ClusterSpec.peak_flops``: node groups each at their own) — the planner's estimate
divides by the same, so the two compare directly.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any

from specs.errors import RunFailed
from specs.json_numbers import sig6
from specs.planfile import PlanFile


def last_step(path: str | Path | None) -> int | None:
    """The last step a metrics file records (None when it records none, or is absent): where a run got to."""
    last = None
    if path and Path(path).is_file():  # (not a pipe or a terminal: reading those would wait)
        for line in Path(path).read_text(errors="replace").splitlines():
            try:
                last = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue  # an event line, or one cut off mid-write
    return last


def _drop_cut_line(path: Path) -> None:
    """Cut a last line that a killed or disk-full run left unfinished (no newline) off the file, so that the lines
    appended after it are lines of their own: joined to it, they made one bad line in the middle of the file,
    which its readers refuse (a cut-off line is only skipped at the end). Its step is redone by the run going on."""
    if not path.is_file() or path.stat().st_size == 0:  # (not a pipe or a terminal)
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        end = f.seek(0, os.SEEK_END)
        keep = 0
        while end > 0 and not keep:
            start = max(0, end - 65536)
            f.seek(start)
            chunk = f.read(end - start)
            cut = chunk.rfind(b"\n")
            keep, end = (start + cut + 1, 0) if cut >= 0 else (0, start)
        f.truncate(keep)


def is_metrics_data(content: Any) -> bool:
    """Whether a file's content (``specs.files.file_content``) is a metrics file's: JSON lines of steps and events
    (its last line may be cut off mid-write). What `--metrics-out` may overwrite; any other file it would destroy."""
    if isinstance(content, dict):  # one line
        return "step" in content or "event" in content
    if not isinstance(content, str):
        return False
    lines = [line for line in content.splitlines() if line.strip()]
    objs = []
    for i, line in enumerate(lines):
        try:
            objs.append(json.loads(line))
        except ValueError:
            if i < len(lines) - 1:
                return False
    return any(isinstance(o, dict) and ("step" in o or "event" in o) for o in objs) and all(
        isinstance(o, dict) for o in objs)


def _strict(value: Any) -> Any:
    """``value`` with a number that is not finite (a loss that turned to nan) as null: strict JSON, which every
    reader parses (``NaN`` is Python's extension)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strict(v) for v in value]
    return value


class MetricsLog:
    def __init__(self, plan: PlanFile, path: str | Path | None, total_steps: int, enabled: bool,
                 quiet: bool = False, append: bool = False, plan_path: str | None = None,
                 predicted_step_s: float | None = None, predicted_memory_GiB: float | None = None,
                 gpu: bool = False) -> None:
        self.plan, self.total, self.enabled, self.quiet = plan, total_steps, enabled, quiet
        self.plan_path = plan_path  # written on every line so `autopar calibrate` can re-estimate the run
        self.made_for = plan.made_for  # ... with what the plan was then: a plan file changed since is caught
        self.tokens = plan.global_batch * plan.seq
        self.flops = plan.model.model_flops_per_token(plan.seq) * self.tokens
        cfg = plan.config
        self.peak = plan.cluster.peak_flops(cfg.pp, cfg.tp * cfg.dp * cfg.cp, cfg.placement)
        # a fresh estimate when given, written as the plan's prediction is (6 significant digits)
        pred = plan.prediction
        self.predicted = sig6(predicted_step_s) if predicted_step_s else pred.get("step_time_s")
        self.predicted_memory = sig6(predicted_memory_GiB) if predicted_memory_GiB else pred.get("memory_GiB")
        self.gpu = gpu  # the progress line shows the predicted memory beside the measured one only on GPUs (a CPU
        # rank's peak RSS also counts the interpreter and its libraries)
        self.noted_peak = False  # an MFU above 100% is explained once
        # the predicted peak of each rank: its pipeline stage's (the estimate's stage_memory_GiB, one per pp rank)
        # (not when the plan was re-estimated: its stored stages were predicted for what it was before the edit)
        stages = [] if predicted_memory_GiB else plan.prediction.get("stage_memory_GiB") or []
        self.rank_prediction = ([stages[cfg.rank_coords(r)["pp"]] for r in range(cfg.world)]
                                if len(stages) == cfg.pp else None)
        self.file: IO[str] | None = None
        if enabled and path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if append:
                _drop_cut_line(Path(path))
            self.file = open(path, "a" if append else "w")  # noqa: SIM115 - closed in close()

    def record(self, step: int, loss: float, grad_norm: float, lr: float, step_time_s: float,
               peak_memory_GiB: float, peak_reserved_GiB: float | None = None,
               phases: dict[str, list[float]] | None = None,
               rank_memory: tuple[list[float], list[float]] | None = None) -> dict[str, Any]:
        """One step's line; ``phases`` and ``rank_memory`` (allocated and reserved peaks) hold every rank's."""
        row = {
            "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "step_time_s": step_time_s,
            "predicted_step_time_s": self.predicted, "tokens_per_s": self.tokens / step_time_s,
            "mfu": self.flops / (step_time_s * self.peak), "peak_memory_GiB": peak_memory_GiB,
            "peak_reserved_GiB": peak_reserved_GiB, "predicted_memory_GiB": self.predicted_memory,
        }
        if self.plan_path:
            row["plan"], row["plan_made_for"] = self.plan_path, self.made_for
        if phases is not None:
            row["phases_s"] = phases
        if rank_memory is not None:
            row["peak_memory_GiB_per_rank"], row["peak_reserved_GiB_per_rank"] = rank_memory
            if self.rank_prediction:
                row["predicted_memory_GiB_per_rank"] = self.rank_prediction
        if not self.enabled:
            return row
        self._write(row)
        if not self.quiet:
            pred = f" (plan {self.predicted:.3g} s)" if self.predicted else ""
            mem_pred = f" (plan {self.predicted_memory:.3g})" if self.predicted_memory and self.gpu else ""
            print(f"step {step:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  grad-norm {grad_norm:.3f}  "
                  f"lr {lr:.2e}  {step_time_s:.3f} s{pred}  {row['tokens_per_s']:,.0f} tok/s  "
                  f"mfu {100 * row['mfu']:.1f}%  mem {peak_memory_GiB:.2f} GiB{mem_pred}", flush=True)
            if row["mfu"] > 1 and not self.noted_peak:
                self.noted_peak = True
                cluster = self.plan.cluster  # a rank's share of the peak (CPU ranks sharing cores: of theirs)
                print(f"note: MFU above 100%: this machine computes faster than the profile's peak "
                      f"({cluster.peak_flops(1, 1) / 1e12:g} TFLOP/s per rank, {cluster.gpu.name}); "
                      "`autopar profile` measures it", flush=True)
        return row

    def event(self, **fields: object) -> None:
        """A line that is not a step (``{"event": ...}``): a resume, what a restart lost and redid."""
        self._write(fields)

    def _write(self, row: dict[str, Any]) -> None:
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(_strict(row), allow_nan=False) + "\n")
            self.file.flush()
        except OSError as err:  # a full disk, a device that refuses writes: say which file, and how to go on
            raise RunFailed(f"cannot write metrics file {self.file.name}: {err.strerror or err}; free space or give "
                            "another --metrics-out") from None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
