"""autopar planner: specs, search, plan files, what-if sweeps and the command line."""

__version__ = "0.1.0"
