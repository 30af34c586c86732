"""Hugging Face weights in and out of autopar checkpoints, for the layouts :mod:`runtime.hf_layouts` maps (Llama,
Mistral, Qwen2, Mixtral and GPT-2). Other model_types are refused before a weight is read: their weights mean
something else in transformers (Gemma's norms and MLP, Phi-3's fusions).

* ``autopar import-hf HF_DIR --plan plan.json --out CKPT``: the directory's ``config.json`` must describe the
  plan's model; its safetensors weights (``model.safetensors`` or the shards an index file lists) become a step-0
  checkpoint of that plan (AdamW moments zero, the fp32 master copy where the plan keeps one), which
  ``autopar run plan.json --checkpoint-dir CKPT --resume`` (or any other plan of the model) starts from.
* ``autopar export-hf CKPT --out HF_DIR``: the newest checkpoint's parameters (its fp32 master copy where kept)
  as ``config.json`` + ``model.safetensors`` that ``transformers`` loads with ``from_pretrained``.

Checkpoints hold each parameter whole by model name (:mod:`runtime.portable_state`), so neither direction cares
which plan wrote or reads them. Both run in one process, without a process group.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel
from torch.distributed.checkpoint.api import CheckpointException

from runtime.checkpoint import corrupt_error, corrupt_files, fingerprint, hash_threads, publish, read_meta
from runtime.checkpoint_folder import META, STEP_NAME, instead_of, latest_checkpoint, newest_is_broken, step_name
from runtime.dtypes import TORCH_DTYPES
from runtime.hf_layouts import (
    GPT2_PREFIX,
    check_importable,
    hf_config,
    is_buffer,
    mixtral_like,
    names,
    part_shapes,
    rows,
    stacked,
    token_ids,
    transposed,
)
from specs.capabilities import model_problem
from specs.errors import AutoparError
from specs.files import check_output_dir, default_mode, read_mapping
from specs.hf_config import looks_like_hf
from specs.model import ModelSpec
from specs.model_loading import load_model
from specs.moe import MoESpec
from specs.planfile import PlanFile

# what a config must share with the plan's model
_SHAPE = ("arch", "num_layers", "hidden_size", "num_attention_heads", "kv_heads", "hd", "ffn", "vocab_size",
          "tie_embeddings", "qkv_bias", "norm_eps", "rope_theta", "rope_scaling", "rope_dims", "position_rows", "moe",
          "sliding_window")  # export-hf writes the plan's window back: a Mistral into a Llama plan would lose it


def _shown(value: object) -> object:
    """A spec field as its file writes it (a section: its given fields)."""
    if isinstance(value, MoESpec):
        return value.trained()  # the load imbalance only prices the model
    return value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value


# ---- in ---------------------------------------------------------------------------------------------
def _read_safetensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise AutoparError(f"{index} is not a safetensors index (no weight_map); re-download the model") from None
    elif (hf_dir / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise AutoparError(f"{hf_dir} has no model.safetensors nor model.safetensors.index.json; autopar reads "
                           "safetensors weights (convert .bin files with transformers' save_pretrained)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(str(hf_dir / f)))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own and OS errors
            raise AutoparError(f"{hf_dir / f} cannot be read ({type(err).__name__}: "
                               f"{str(err).splitlines()[0][:120] if str(err) else ''}); re-download it") from None
    return out


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that it runs in one process when no process group exists: what these commands mean to do."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _shapes(plan: PlanFile) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape in autopar's model of the plan (built on the meta device: no memory)."""
    from runtime.models import build_model

    return {k: tuple(v.shape) for k, v in build_model(plan.model, device="meta").named_parameters()}


def import_hf(hf_dir: Path, plan: PlanFile, out: Path) -> Path:
    """Write a step-0 checkpoint of ``plan`` from the Hugging Face model in ``hf_dir``; returns its directory."""
    wanted = names(plan.model)  # refuses a model of no supported layout first
    check_output_dir(out, "checkpoint folder")
    held = latest_checkpoint(out)
    if held is not None:
        raise AutoparError(f"{out} already holds a run's checkpoints ({held.name}); import into an "
                           "empty or new folder")
    cfg = hf_dir / "config.json"
    if not cfg.is_file():
        raise AutoparError(f"{hf_dir} has no config.json: give the directory of a Hugging Face model")
    raw = read_mapping(cfg, "Hugging Face config")
    if not looks_like_hf(raw):
        raise AutoparError(f"{cfg} is not a Hugging Face config (no model_type or num_hidden_layers); give the "
                           "directory of a Hugging Face model")
    check_importable(cfg, raw)
    hf_spec = load_model(str(cfg))  # read as `--model` reads it: one-line errors, keys given twice refused
    spec = plan.model
    problem = model_problem(spec)
    if problem:
        raise AutoparError(problem)
    # every layer a mixture of experts: the dense MLP's width is a number no weight has (Mixtral's config keeps the
    # experts' width there; a spec may keep another)
    unused = {"ffn"} if mixtral_like(spec) else set()
    for key in (k for k in _SHAPE if k not in unused):
        theirs, ours = (_shown(getattr(s, key)) for s in (hf_spec, spec))
        if theirs != ours:
            raise AutoparError(f"{cfg} has {key}={theirs!r} but the plan's model has {ours!r}; plan for this model "
                               f"(autopar plan --model {cfg} ...)")
    weights = _read_safetensors(hf_dir)
    if spec.arch == "gpt" and not any(k.startswith(GPT2_PREFIX) for k in weights):  # the original GPT-2 files
        weights = {k if k == "lm_head.weight" else GPT2_PREFIX + k: v for k, v in weights.items()}
    if spec.tie_embeddings and "lm_head.weight" in weights:  # some tied checkpoints store the copy too
        head, embed = weights.pop("lm_head.weight"), weights.get(wanted["embed.tok.weight"][0])
        if embed is not None and not torch.equal(head, embed):  # transformers loads such a folder untied
            raise AutoparError(f"{hf_dir} has an lm_head.weight that differs from its embeddings, but its config "
                               "ties them (tie_word_embeddings): transformers loads it untied; set "
                               "tie_word_embeddings false in its config.json and plan again")
    shapes = _shapes(plan)
    params, used = {}, set()
    for ours, parts in wanted.items():
        missing = [p for p in parts if p not in weights]
        if missing:
            raise AutoparError(f"{hf_dir} has no weight {missing[0]}: not a complete {spec.arch} checkpoint of "
                               f"{spec.num_layers} layers")
        for part, need in zip(parts, part_shapes(spec, ours, len(parts), shapes[ours])):
            if tuple(weights[part].shape) != need:
                raise AutoparError(f"{hf_dir}: {part} has shape {tuple(weights[part].shape)}, but the plan's model "
                                   f"needs {need}; the weights are not of this model")
        params[ours] = torch.cat([weights[p].float() for p in parts]) if len(parts) > 1 else weights[parts[0]].float()
        if transposed(spec, ours):  # GPT-2's Conv1D: [in, out]
            params[ours] = params[ours].t()
        params[ours] = params[ours].view(shapes[ours])  # stacked experts: [E * rows, cols] -> [E, rows, cols]
        used.update(parts)
    extra = sorted(k for k in set(weights) - used if not is_buffer(k))
    if extra:
        raise AutoparError(f"{hf_dir} has weights autopar's model does not have (e.g. {extra[0]}); autopar reads "
                           "Llama, Mistral, Qwen2, Mixtral and GPT-2 layouts")
    state = plan.state
    sd: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        sd[f"param/{name}"] = t.to(TORCH_DTYPES[state.params]).contiguous()
        sd[f"exp_avg/{name}"] = torch.zeros_like(t)
        sd[f"exp_avg_sq/{name}"] = torch.zeros_like(t)
        if state.master_weights:
            sd[f"master/{name}"] = t.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{step_name(0)}.partial"
    with _single_process():
        dcp.save(sd, checkpoint_id=str(tmp), no_dist=True)
    return publish(out, tmp, {"step": 0, "samples": 0, "data": None, "total_steps": plan.train.steps,
                              "plan": fingerprint(plan, state), "source": str(hf_dir), "rng": False,
                              "plan_file": plan.model_dump(mode="json", by_alias=True)})


# ---- out --------------------------------------------------------------------------------------------
def exported_checkpoint(ckpt_dir: Path) -> Path:
    """The checkpoint ``export-hf`` reads: ``ckpt_dir`` itself where it is one (a ``step_N`` folder: an earlier step
    chosen), else the newest under it, refused where a newer one is broken (resuming refuses it too; exporting the
    one before without a word handed over older weights)."""
    if STEP_NAME.fullmatch(ckpt_dir.name) and (ckpt_dir / META).is_file():
        return ckpt_dir
    broken = newest_is_broken(ckpt_dir) if ckpt_dir.is_dir() else None
    if broken:
        raise AutoparError(f"{broken} (or export an earlier one by its folder, {ckpt_dir}/step_N)")
    ck = latest_checkpoint(ckpt_dir)
    if ck is None:
        raise AutoparError(f"no checkpoint in {ckpt_dir}; give the --checkpoint-dir of a run, or one checkpoint's "
                           "step_N folder in it")
    return ck


def read_parameters(ck: Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The model and its parameters (fp32 master copies where kept) of checkpoint ``ck`` (a ``step_N`` folder)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = read_meta(ck, exporting=True)
    bad = corrupt_files(ck, meta, threads=hash_threads())
    if bad:
        raise corrupt_error(ck, bad, exporting=True)
    try:
        spec = ModelSpec(**meta["plan"]["model"])
        stored = FileSystemReader(str(ck)).read_metadata().state_dict_metadata
    except Exception:  # noqa: BLE001 - any unreadable meta.json or .metadata
        raise AutoparError(f"checkpoint {ck} is corrupt (unreadable {META} or .metadata); "
                           f"{instead_of(ck, exporting=True)}") from None
    kind = "master" if any(k.startswith("master/") for k in stored) else "param"
    sd = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in stored.items()
          if k.startswith(kind + "/")}
    try:
        with _single_process():
            dcp.load(sd, checkpoint_id=str(ck), no_dist=True)
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP wraps the reader's errors (a BaseException)
        raise AutoparError(f"checkpoint {ck} is corrupt or incomplete ({type(err).__name__}); "
                           f"{instead_of(ck, exporting=True)}") from None
    params = {k.split("/", 1)[1]: v for k, v in sd.items()}
    extra = sorted(set(params) - set(names(spec)))
    if extra:
        raise AutoparError(f"checkpoint {ck} holds parameters its model ({spec.num_layers} layers) does not have "
                           f"(e.g. {extra[0]}): its {META} does not describe it; {instead_of(ck, exporting=True)}")
    return spec, params


def export_hf(ckpt_dir: Path, out: Path) -> tuple[Path, Path]:
    """Write ``config.json`` and ``model.safetensors`` of :func:`exported_checkpoint` of ``ckpt_dir`` into ``out``;
    returns ``out`` and the checkpoint exported."""
    from safetensors.torch import save_file

    check_output_dir(out, "Hugging Face model folder")
    held = sorted(p.name for p in out.iterdir() if p.name in ("config.json", "generation_config.json")
                  or p.name.endswith((".safetensors", ".bin", ".safetensors.index.json"))) if out.is_dir() else []
    if held:  # what the export writes, or another model's weights beside it
        raise AutoparError(f"{out} already holds a model ({held[0]}); give a new directory, or one without a model "
                           "in it (tokenizer files may stay)")
    if out.is_dir() and latest_checkpoint(out) is not None:  # e.g. --out naming the checkpoint folder itself
        raise AutoparError(f"{out} holds a run's checkpoints; give a new directory, or one without checkpoints")
    inside = next((p for p in (out, *out.resolve().parents) if STEP_NAME.fullmatch(p.name) and (p / META).is_file()),
                  None)
    if inside is not None:  # pruning the checkpoint would remove the export with it
        raise AutoparError(f"{out} is inside checkpoint {inside}, which is removed with all it holds when newer "
                           "checkpoints are kept in its place; give a folder outside it")
    ck = exported_checkpoint(ckpt_dir)
    spec, params = read_parameters(ck)
    tensors: dict[str, torch.Tensor] = {}
    for ours, parts in names(spec).items():
        if ours not in params:
            raise AutoparError(f"the checkpoint in {ckpt_dir} has no parameter {ours}; it is incomplete")
        t = params[ours].float()
        if len(parts) == 1:
            tensors[parts[0]] = (t.t() if transposed(spec, ours) else t).contiguous()
            continue
        if stacked(ours):
            t = t.reshape(-1, t.shape[-1])
        for name, piece in zip(parts, t.split(rows(spec, ours))):
            tensors[name] = piece.contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    default_mode(out / "model.safetensors")  # safetensors writes it private (0600); a model is shared like any file
    (out / "config.json").write_text(json.dumps(hf_config(spec), indent=1) + "\n")
    ids = {k: v for k, v in token_ids(spec).items() if v is not None}
    if ids:  # what generate() stops at and starts from (transformers reads it beside the config)
        (out / "generation_config.json").write_text(json.dumps({**ids, "_from_model_config": True}, indent=1) + "\n")
    return out, ck
