"""`autopar import-hf` and `export-hf`: Hugging Face weights into and out of checkpoints."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from specs.errors import AutoparError


def _hf_weights() -> Any:
    try:
        from runtime import hf_weights
    except ImportError as err:
        raise AutoparError(f"Hugging Face weights need PyTorch and safetensors: pip install torch safetensors "
                           f"({err.name} is missing)") from None
    return hf_weights


def import_hf_command(args: argparse.Namespace) -> int:
    from specs.planfile import load_plan

    hf = _hf_weights()
    plan = load_plan(args.plan)
    ck = hf.import_hf(Path(args.hf_dir), plan, Path(args.out))
    print(f"wrote {ck} (step 0 of {args.plan}); train from it: autopar run {args.plan} --checkpoint-dir "
          f"{args.out} --resume")
    return 0


def export_hf_command(args: argparse.Namespace) -> int:
    import json

    out, ck = _hf_weights().export_hf(Path(args.checkpoint_dir), Path(args.out))
    arch = json.loads((out / "config.json").read_text())["architectures"][0]
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'} (the weights of {ck}, as {arch}: the block "
          "autopar trained)")
    return 0

