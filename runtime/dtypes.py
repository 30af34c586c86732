"""The torch dtype of each precision name a plan or a profile uses (``specs.state.Dtype``)."""

from __future__ import annotations

import torch

from specs.state import TORCH_NAMES

TORCH_DTYPES = {k: getattr(torch, name) for k, name in TORCH_NAMES.items()}
