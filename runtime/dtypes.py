"""The torch dtype of each precision name a plan or a profile uses (``specs.state.Dtype``)."""

from __future__ import annotations

import torch

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
