"""autopar's specs layer: errors, model / cluster / GPU specs and their loaders, the parallel configuration
(its keys and rules), pipeline schedules, training state precisions, what the runtime executes, plan files.

It imports nothing else of the project; the cost models, the runtime and the planner all build on it.
"""

__version__ = "0.1.0"
