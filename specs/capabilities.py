"""What autopar's runtime cannot train, said once (no torch here): it executes every value of every plan key the
planner searches (tp, pp with 1F1B and interleaving, dp, cp, sp, recompute, ZeRO 0-3, dp_overlap, tp_overlap, ep,
etp, placement), so only a model or a model state can be out of its reach; it refuses those before any worker
starts, and ``autopar plan --runnable`` refuses to plan them."""

from __future__ import annotations

from specs.model import ROPE_SCALINGS, ModelSpec
from specs.state import StateSpec


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
    if state.param_gather_after_step:
        return ("state.param_gather_after_step=true: the runtime gathers ZeRO's updated parameters behind the next "
                "step's first forwards (priced as such); set param_gather_after_step=false")
    if state.full_logits:
        return ("state.full_logits=true: the runtime's fused loss computes the logits a chunk at a time (priced as "
                "such); set full_logits=false")
    if state.grad_reduce != state.grads:
        return (f"state.grad_reduce={state.grad_reduce} with state.grads={state.grads}: the runtime reduces "
                f"gradients in their own precision; set grad_reduce={state.grads}")
    return None


def model_problem(model: ModelSpec) -> str | None:
    """Why autopar's runtime cannot train ``model``, or None: it builds its own GPT and Llama blocks, so a
    model traced from a user's nn.Module (``--model pkg.module:factory``) is planned but not run, and so is one whose
    RoPE scaling it does not compute."""
    if model.block is not None:
        return (f"model {model.name} was traced from its own nn.Module; the runtime trains its GPT and Llama blocks "
                "only: describe it as a model spec (arch gpt or llama) to train it")
    scaling = model.rope_scaling
    if scaling is not None and scaling.type not in ROPE_SCALINGS:
        return (f"model {model.name} has rope_scaling of type {scaling.type}: the runtime computes "
                f"{' and '.join(ROPE_SCALINGS)} RoPE scaling only; plan it, or drop rope_scaling to train it with "
                "plain RoPE")
    return None


def execution_problem(model: ModelSpec, state: StateSpec) -> str | None:
    """Why autopar's runtime cannot execute a plan of ``model`` keeping ``state``, or None (it executes every plan)."""
    return model_problem(model) or state_problem(state)
