"""autopar runtime: executes a plan on torch.distributed (NCCL on GPUs, gloo on CPUs)."""
