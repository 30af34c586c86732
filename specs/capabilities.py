"""What autopar's runtime executes, said once (no torch here): every value of every plan key the planner
searches, so ``autopar plan --runnable`` (kept for compatibility) holds no key; the runtime refuses a model or
model state it cannot train before any worker starts."""

from __future__ import annotations

from typing import Any

from specs.model import ModelSpec
from specs.parallel import ParallelConfig, key_text
from specs.state import StateSpec

# Plan keys the runtime does not execute every value of: the values it does. tp, pp (1F1B and interleaved), dp,
# cp, sp, recompute, ZeRO 0-3, dp_overlap, tp_overlap and expert parallelism (ep) all run; expert tensor
# parallelism (etp) is planned, not yet run (a key added to the search before the runtime executes it goes here,
# with what it is in _NOT_YET).
RUNTIME_EXECUTES: dict[str, tuple[Any, ...]] = {"etp": (1,)}

_NOT_YET: dict[str, str] = {"etp": "expert tensor parallelism"}


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
    if state.grad_reduce != state.grads:
        return (f"state.grad_reduce={state.grad_reduce} with state.grads={state.grads}: the runtime reduces "
                f"gradients in their own precision; set grad_reduce={state.grads}")
    return None


def runnable_keys(model: ModelSpec | None = None) -> dict[str, Any]:
    """``--fix`` keys that keep a search to what the runtime executes (one value, or a list of them), for ``model``
    (a MoE model also needs cp=1: :func:`moe_problem`)."""
    keys = {k: v[0] if len(v) == 1 else list(v) for k, v in RUNTIME_EXECUTES.items()}
    return {**keys, "cp": 1} if model is not None and model.moe is not None else keys


def model_problem(model: ModelSpec) -> str | None:
    """Why autopar's runtime cannot train ``model``, or None: it builds its own GPT and Llama blocks, so a
    model traced from a user's nn.Module (``--model pkg.module:factory``) is planned but not run."""
    if model.block is not None:
        return (f"model {model.name} was traced from its own nn.Module; the runtime trains its GPT and Llama blocks "
                "only: describe it as a model spec (arch gpt or llama) to train it")
    return None


def moe_problem(cfg: ParallelConfig, model: ModelSpec) -> str | None:
    """Why autopar's runtime cannot train ``model``'s MoE layers under ``cfg``, or None: it runs them under expert,
    tensor (with sp), pipeline and data parallelism, ZeRO-1, interleaving and recompute; not yet under context
    parallelism."""
    if model.moe is None or cfg.cp == 1:
        return None
    return (f"cp={cfg.cp}: the runtime does not train mixture-of-experts models under context parallelism yet; "
            "plan with --fix cp=1")


def execution_problem(cfg: ParallelConfig, model: ModelSpec, state: StateSpec) -> str | None:
    """Why autopar's runtime cannot execute a plan (its keys, its model, its model state), or None."""
    return runtime_problem(cfg) or model_problem(model) or moe_problem(cfg, model) or state_problem(state)
