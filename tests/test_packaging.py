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


def _declared() -> tuple[set[str], set[str]]:
    """setup.cfg's install_requires and the extras' requirements, as lower-case distribution names."""
    import re

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    names = lambda text: {re.split(r"[<>=!~\[ ;]", r.strip(), maxsplit=1)[0].lower()  # noqa: E731
                          for r in text.splitlines() if r.strip()}
    base = names(cfg["options"]["install_requires"])
    extras = set().union(*(names(v) for v in cfg["options.extras_require"].values()))
    return base, extras


DISTRIBUTION = {"yaml": "pyyaml"}  # import name -> distribution name where they differ


def test_every_third_party_import_is_declared():
    """A module the planning side imports at its top (specs, cost_models, planner: what `autopar plan` loads without
    torch) is in install_requires; any other third-party import is in install_requires or an extra. torch depends
    on networkx, so an install with the `run` extra hid a missing networkx once."""
    import ast
    import sys

    base, extras = _declared()
    ours = set(PACKAGES)
    missing = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            top = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    root = mod.split(".")[0]
                    if root in ours or root in sys.stdlib_module_names or root == "__future__":
                        continue
                    dist = DISTRIBUTION.get(root, root).lower()
                    planning = pkg in ("specs", "cost_models", "planner") and id(node) in top
                    if dist not in base and (planning or dist not in extras):
                        missing.append(f"{path.relative_to(ROOT)}: {mod}")
    assert not missing, missing
