"""Plain-language reasons: why the best plan beats the runner-up."""

from __future__ import annotations

from planner.placement import explain_placement
from planner.refine import PlanResult
from specs.parallel import LAYOUT, SEARCHED, key_text
from specs.placement import splits_replicas

PART_NAMES = {
    "forward_compute": "forward compute",
    "backward_compute": "backward compute",
    "recompute": "recomputation",
    "tp_cp_comm": "tensor/context-parallel communication",
    "ep_comm": "expert-parallel all-to-all",
    "pp_p2p": "pipeline send/receive",
    "pipeline_bubble": "pipeline bubble",
    "dp_comm_exposed": "exposed gradient synchronisation",
    "optimizer": "optimizer step",
}


def _fmt(s: float) -> str:
    return f"{s:.3g} s" if abs(s) >= 0.1 else f"{s * 1e3:.3g} ms"


def runner_up(plans: list[PlanResult]) -> PlanResult | None:
    """The best plan whose layout (not only overlap flags) differs from the winner's, else the second."""
    if len(plans) < 2:
        return None
    best = plans[0].config
    for p in plans[1:]:
        if any(getattr(p.config, k) != getattr(best, k) for k in LAYOUT):
            return p
    return plans[1]


def _enough(saves: list[tuple[float, str]], cost: float, most: int = 4) -> list[tuple[float, str]]:
    """The largest savings, as many as it takes for them to exceed ``cost`` (at least two where there are, at most
    ``most``), so that "they outweigh the costs" is true of what is named."""
    out: list[tuple[float, str]] = []
    for d, k in saves[:most]:
        if len(out) >= 2 and -sum(x for x, _ in out) > cost:
            break
        out.append((d, k))
    return out


def _listed(parts: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def why(best: PlanResult, other: PlanResult) -> str:
    """One or two sentences comparing two plans by the parts of the step that differ most."""
    a, b = best.estimate, other.estimate
    diffs = [f"{k}={key_text(getattr(best.config, k))} vs {key_text(getattr(other.config, k))}"
             for k in SEARCHED if getattr(best.config, k) != getattr(other.config, k)]
    if best.config.placement != other.config.placement:
        diffs.append(f"placement={key_text(best.config.placement or ('none',))} vs "
                     f"{key_text(other.config.placement or ('none',))}")
    if best.config.layers != other.config.layers:
        diffs.append("a different layer split")
    if best.config.recompute_layers != other.config.recompute_layers and best.config.recompute == "full":
        diffs.append("different per-stage recompute")
    gain = (b.step_time_s - a.step_time_s) / b.step_time_s * 100
    deltas = sorted(((a.breakdown[k] - b.breakdown.get(k, 0.0), k) for k in a.breakdown), key=lambda x: x[0])
    tiny = 1e-6 * b.step_time_s  # rounding, not a difference
    all_saves = [(d, k) for d, k in deltas if d < -tiny]
    all_costs = [(d, k) for d, k in reversed(deltas) if d > tiny]
    saves, costs = _enough(all_saves, sum(d for d, _ in all_costs)), all_costs[:2]
    # the runner-up (:func:`runner_up`) is the fastest plan laid out otherwise, which plans of the winner's layout
    # with other overlap flags may precede in the table
    rival = "the fastest plan laid out otherwise" if any(
        getattr(best.config, k) != getattr(other.config, k) for k in LAYOUT) else "the runner-up"
    if gain < 0.05:
        text = f"Best plan ({best.config.short()}) is as fast as {rival} ({other.config.short()})"
    else:
        text = f"Best plan ({best.config.short()}) is {gain:.1f}% faster than {rival} ({other.config.short()})"
    if diffs:
        text += f" [{', '.join(diffs)}]"
    if saves:
        named = [f"{_fmt(-d)} less {PART_NAMES.get(k, k)}" for d, k in saves]
        if len(saves) < len(all_saves) and -sum(d for d, _ in saves) <= sum(d for d, _ in all_costs):
            named.append("smaller savings")  # what is named does not outweigh the costs alone
        text += ": " + _listed(named)
        if costs and gain < 0.05:  # a tie: the two sides cancel
            text += ", offset by"
            text += " " + _listed([f"{_fmt(d)} more {PART_NAMES.get(k, k)}" for d, k in costs])
            if len(costs) < len(all_costs):
                text += f" ({_fmt(sum(d for d, _ in all_costs))} more in all)"
        elif costs:
            text += " outweighs" if len(named) == 1 else " outweigh"
            text += " " + _listed([f"{_fmt(d)} more {PART_NAMES.get(k, k)}" for d, k in costs])
            if len(costs) < len(all_costs):
                text += f" ({_fmt(sum(d for d, _ in all_costs))} more in all)"
    text += "."
    dm = a.memory_GiB - b.memory_GiB
    if abs(dm) >= 0.5:
        more = "more" if dm > 0 else "less"
        text += f" It uses {abs(dm):.1f} GiB {more} memory per GPU ({a.memory_GiB:.1f} vs {b.memory_GiB:.1f})."
    return text


def placement_reason(best: PlanResult, homogeneous: PlanResult | None, num_layers: int,
                     ranked: list[PlanResult] | None = None) -> str:
    """Where a placed plan puts its stages, what it gains over the cluster planned as homogeneous, and (when
    ``ranked`` holds one) over the best plan of the other way of placing: whole pipeline ranks per group, or
    replicas split over groups."""
    text = explain_placement(best.config, num_layers).rstrip(".") + "."
    if homogeneous is not None:
        gain = homogeneous.estimate.step_time_s / best.estimate.step_time_s - 1
        text += (f" Planned as if homogeneous at its slowest GPU and link, the best plan "
                 f"({homogeneous.config.short()}) takes {homogeneous.estimate.step_time_s:.3f} s a step: this one "
                 f"is {gain:+.1%} in throughput.")
    split = splits_replicas(best.config.placement)
    other = next((p for p in ranked or [] if p.config.placement is not None
                  and splits_replicas(p.config.placement) != split), None)
    if other is not None:
        kind = "holding whole pipeline ranks per group" if split else "splitting its replicas over the groups"
        gain = other.estimate.step_time_s / best.estimate.step_time_s - 1
        text += (f" The best plan {kind} ({other.config.short()}) takes {other.estimate.step_time_s:.3f} s: this "
                 f"one is {gain:+.1%} in throughput.")
    return text
