"""Resolving ``--model``: a bundled preset, a spec or config file, or ``pkg.module:factory`` (traced)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from specs.errors import AutoparError, did_you_mean, validated, validation_message
from specs.files import read_mapping
from specs.hf_config import hf_notes, hf_to_spec, in_config_terms, looks_like_hf
from specs.model import LIMITS, ModelSpec, past_vocab, size_problem

PRESET_DIR = Path(__file__).parent / "presets"


def model_from_dict(data: dict[str, Any], source: str, notes: list[str] | None = None) -> ModelSpec:
    """Build a spec from a mapping in autopar's format or a Hugging Face config, with one-line errors; ``notes``
    gains what of a Hugging Face config the spec leaves out (:func:`specs.hf_config.hf_notes`)."""
    if not isinstance(data, dict):
        raise AutoparError(f"model spec {source}: expected a mapping of fields, got {type(data).__name__}")
    if looks_like_hf(data):
        if notes is not None:
            notes.extend(f"model {source}: {n}" for n in hf_notes(data))
        fields = hf_to_spec(data, source)  # its errors name the config's keys already
        try:
            return ModelSpec(**fields)
        except ValidationError as err:  # a rule of the spec's, said with the config's keys
            raise AutoparError(f"Hugging Face config {source}: "
                               f"{in_config_terms(validation_message(err, ModelSpec), data)}") from None
    data = dict(data)
    data.setdefault("name", Path(source).stem if source else "model")
    past = past_vocab(data["token_ids"], data.get("vocab_size")) if isinstance(data.get("token_ids"), dict) else ""
    if past:  # (a stored plan or checkpoint of an earlier version loads without them: ModelSpec leaves them out)
        raise AutoparError(f"model spec {source}: token_ids: {past} past the vocabulary (vocab_size "
                           f"{data['vocab_size']}); give ids below it or leave them out")
    return validated(ModelSpec, data, f"model spec {source}")


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_model(ref: str, seq: int | None = None, notes: list[str] | None = None) -> ModelSpec:
    """Resolve a model reference: preset name, spec/config file path (a folder: its config.json, as Hugging Face
    models are downloaded), or ``pkg.module:factory``; ``notes`` gains what of a Hugging Face config the spec leaves
    out."""
    path = Path(ref)
    if path.is_symlink() and not path.exists():
        raise AutoparError(f"model file {ref} is a link to nothing (broken, or a loop of links); give the file itself")
    if path.is_dir():  # a downloaded Hugging Face model folder
        if not (path / "config.json").is_file():
            raise AutoparError(f"model folder {ref} has no config.json; give the model's config.json, a YAML/JSON "
                               "spec or a preset")
        path = path / "config.json"
    if path.suffix in (".yaml", ".yml", ".json") or path.exists() or "/" in ref or os.sep in ref:  # a path
        if not path.exists():
            raise AutoparError(
                f"model file {ref} does not exist; give a preset ({', '.join(list_presets())}) or a path")
        spec = model_from_dict(read_mapping(path, "model spec"), str(path), notes)
    elif (PRESET_DIR / f"{ref}.yaml").exists():
        spec = model_from_dict(read_mapping(PRESET_DIR / f"{ref}.yaml", "preset"), ref)
    elif ":" in ref:
        from specs.trace import model_from_module  # imports torch: only on this path

        spec = model_from_module(ref, seq)
    else:
        raise AutoparError(
            f"unknown model '{ref}'{did_you_mean(ref, list_presets())}; use a preset "
            f"({', '.join(list_presets())}), a YAML/JSON spec, a Hugging Face config.json or pkg.module:factory"
        )
    problem = None if seq is None else size_problem("--seq", seq, LIMITS["seq_length"])
    if problem:
        raise AutoparError(problem)
    return spec.with_seq(seq)
