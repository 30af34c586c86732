"""What autopar's runtime executes, said once (no torch here): every value of every plan key the planner
searches, so ``autopar plan --runnable`` (kept for compatibility) holds no key; the runtime refuses a model or
model state it cannot train before any worker starts."""

from __future__ import annotations

from typing import Any

from specs.model import ModelSpec
from specs.parallel import ParallelConfig, key_text
from specs.state import StateSpec

# Plan keys the runtime does not execute every value of: the values it does. Every key runs today (tp, pp with 1F1B
# and interleaving, dp, cp, sp, recompute, ZeRO 0-3, dp_overlap, tp_overlap, ep, etp, placement); a key added to
# the search before the runtime executes it goes here, with what it is in _NOT_YET.
RUNTIME_EXECUTES: dict[str, tuple[Any, ...]] = {}

_NOT_YET: dict[str, str] = {}


def runtime_problem(cfg: ParallelConfig) -> str | None:
    """Why autopar's runtime cannot execute ``cfg``, or None."""
    for key, values in RUNTIME_EXECUTES.items():
        v = getattr(cfg, key)
        if v not in values:
            runs = " or ".join(f"{key}={key_text(x)}" for x in values)
            return (f"{key}={key_text(v)}: the runtime does not execute {_NOT_YET[key]} yet (it runs {runs}); "
                    "plan with --runnable")
    return None


def state_problem(state: StateSpec) -> str | None:
    """Why autopar's runtime cannot keep the model state ``state`` (a plan file's ``state``), or None."""
    if state.params == "fp16":
        return ("state.params=fp16: the runtime has no loss scaling for fp16 parameters; "
                "use bf16 (state.params=bf16) or fp32")
    if state.fused_accumulation:
        return ("state.fused_accumulation=true: the runtime adds each micro-batch's gradients in a pass of its own "
                "(priced as such); set fused_accumulation=false")
    if state.overlap_pieces:
        return ("state.overlap_pieces: the runtime's collective matmul runs every overlapped GEMM in tp pieces "
                "(priced as such); leave overlap_pieces out")
    if state.sm_margin:
        return ("state.sm_margin: the runtime's collective matmul leaves every SM to the GEMM (priced as such); "
                "leave sm_margin out")
    if state.full_logits:
        return ("state.full_logits=true: the runtime's fused loss computes the logits a chunk at a time (priced as "
                "such); set full_logits=false")
    if state.grad_reduce != state.grads:
        return (f"state.grad_reduce={state.grad_reduce} with state.grads={state.grads}: the runtime reduces "
                f"gradients in their own precision; set grad_reduce={state.grads}")
    return None


def runnable_keys() -> dict[str, Any]:
    """``--fix`` keys that keep a search to what the runtime executes (one value, or a list of them)."""
    return {k: v[0] if len(v) == 1 else list(v) for k, v in RUNTIME_EXECUTES.items()}


def model_problem(model: ModelSpec) -> str | None:
    """Why autopar's runtime cannot train ``model``, or None: it builds its own GPT and Llama blocks, so a
    model traced from a user's nn.Module (``--model pkg.module:factory``) is planned but not run."""
    if model.block is not None:
        return (f"model {model.name} was traced from its own nn.Module; the runtime trains its GPT and Llama blocks "
                "only: describe it as a model spec (arch gpt or llama) to train it")
    return None


def execution_problem(cfg: ParallelConfig, model: ModelSpec, state: StateSpec) -> str | None:
    """Why autopar's runtime cannot execute a plan (its keys, its model, its model state), or None."""
    return runtime_problem(cfg) or model_problem(model) or state_problem(state)
