"""autopar planner: search (enumeration + ILP), explanations, what-if sweeps, calibration and the command line."""
