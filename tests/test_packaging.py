"""Every data file inside the packages (profiles, presets, sample text, the validation residuals) is shipped by
a non-editable install: `setup.cfg`'s package_data lists a pattern that matches it."""

from __future__ import annotations

import configparser
import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specs", "planner", "cost_models", "hardware_profiles", "runtime")
DATA = {".yaml", ".yml", ".json", ".txt", ".csv"}


def test_every_data_file_in_a_package_is_shipped():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    patterns = {pkg: [p.strip() for p in value.replace("\n", ",").split(",") if p.strip()]
                for pkg, value in cfg["options.package_data"].items()}
    missing = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*"):
            if path.suffix in DATA and "__pycache__" not in path.parts:
                rel = path.relative_to(ROOT / pkg).as_posix()
                if not any(fnmatch.fnmatch(rel, p) for p in patterns.get(pkg, [])):
                    missing.append(f"{pkg}/{rel}")
    assert not missing, missing
    assert (ROOT / "planner" / "residuals.json").exists()
