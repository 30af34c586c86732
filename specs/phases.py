"""The phases a training step is timed in (runtime/phase_clock.py records them, ``autopar diagnose`` reads them).

- ``data``: reading the step's tokens;
- ``forward`` / ``backward``: the model chunks' own work (backward includes recomputation), less the
  communication inside them;
- ``tp_cp_comm``: tensor-, sequence- and context-parallel collectives inside forward and backward (waits for
  slower peers included);
- ``ep_comm``: a MoE model's expert-parallel all-to-alls and expert tensor-parallel collectives inside forward and
  backward (the estimate's ``ep_comm``);
- ``p2p_wait``: blocked on a pipeline receive (the transfer, and the bubble while the neighbour works), and at
  the step's end until the last sends are received;
- ``p2p_send``: starting the sends of activations and gradients;
- ``dp_comm``: the data-parallel gradient reduction and ZeRO gathers the step waits for (exposed), and a tied
  embedding's reduction;
- ``optimizer``: the update, the gradient norm included;
- ``other``: the rest (the step's loss and memory reductions, Python between phases).
"""

PHASES = ("data", "forward", "backward", "tp_cp_comm", "ep_comm", "p2p_wait", "p2p_send", "dp_comm", "optimizer",
          "other")
COMPUTE = ("forward", "backward")  # the model chunks' own work: the phases a run's compute is measured in
LATER_PHASES = ("ep_comm",)  # added after metrics files were first written: a file without one read as zeros


def is_step_line(obj: object) -> bool:
    """Whether a metrics line (``autopar run --metrics-out``, one JSON object a line) records a measured step: its
    ``step`` and ``step_time_s`` (what calibrate, diagnose and tune read); the others are events (a restart, what it
    redid)."""
    return isinstance(obj, dict) and "step" in obj and "step_time_s" in obj
