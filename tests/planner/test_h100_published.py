"""The H100 profile against measured runs (benchmarks/validate_h100.py): our reference peers and MosaicML's sweep."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import pytest

from specs.cluster import load_cluster

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("validate_h100", ROOT / "benchmarks" / "validate_h100.py")
vh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vh)


def test_mosaic_rows_map_to_the_published_models():
    """Each llm-foundry row becomes a plan of the model it measured: the parameter count it published, exactly
    (learned position embeddings grow with the sequence), and the GPUs, batch and micro-batch it ran."""
    rows = vh._rows("mosaicml_llm_foundry_h100_bf16.csv")
    assert len(rows) == 70
    for r in rows:
        plan = vh.mosaic_plan(r)
        assert plan.model.num_params == int(r["num_params"]), r
        cfg = plan.config
        assert (cfg.dp, cfg.mbs) == (int(r["gpus"]), int(r["micro_batch"]))
        assert cfg.microbatches(plan.global_batch) == int(r["grad_accum"])


def test_bundled_h100_profile_predicts_the_compiled_reference_peer():
    """The cost model prices a fused stack: the compiled plain Llama measured on one H100 is its like-for-like."""
    compiled = [p for p in vh.peer_runs() if "compile" in p["peer"]]
    assert len(compiled) == 2
    assert all(abs(p["error"]) <= 0.10 for p in compiled), compiled


def test_calibrating_on_five_runs_predicts_the_held_out_sweep():
    """`autopar calibrate`'s fit on one 8-GPU run per model size predicts MosaicML's other runs at up to 4k tokens
    (other GPU counts, micro-batches, ZeRO stages and checkpointing) with a median error within 10%, where the
    bundled profile, made for a fused stack, is off by about 30%."""
    rows, scales = vh.mosaic(load_cluster("dgx-h100"))
    assert sum(r["calibration_run"] for r in rows) == 5
    held = [r for r in rows if not r["calibration_run"] and r["seq"] <= 4096]
    calibrated = statistics.median(abs(r["calibrated_error"]) for r in held)
    bundled = statistics.median(abs(r["bundled_error"]) for r in held)
    assert calibrated <= 0.10 and calibrated < bundled / 2, (calibrated, bundled, scales)


# Model FLOPs per sequence as each recipe's README states them (benchmarks/data/README.md). Nemotron-4's README
# counts K and V at full width (24 x layers x hidden^2 for the attention projections) though its config runs 8
# query groups: its number is checked against the same model without grouped-query attention.
DGXC_STATED_FLOPS = {"llama3.1-8b": 4.74e14, "llama3.1-70b": 3.94e15, "llama3.1-405b": 2.17e16,
                     "nemotron4-15b": 434.5e12, "nemotron4-340b": 1.01e16, "gpt3-175b": 2.20e15}
# Published parameter counts: Llama 3.1 8B and 70B (Hugging Face safetensors totals), Nemotron-4 15B (Parmar et
# al. 2024: 12.5B non-embedding, 3.2B embedding) and 340B (NVIDIA 2024: 331.6B non-embedding, 9.4B embedding).
DGXC_PARAMS = {"llama3.1-8b": 8_030_261_248, "llama3.1-70b": 70_553_706_496}
DGXC_SPLIT_PARAMS_B = {"nemotron4-15b": (12.5, 3.2), "nemotron4-340b": (331.6, 9.4)}


def test_dgxc_rows_map_to_the_runs_their_configs_describe():
    """Each DGX Cloud row becomes the run its NeMo config describes: all its GPUs, its gradient accumulation, the
    published model sizes and the model FLOPs its README states (the 405B runs with a GPT-2 vocabulary, the README
    counts Llama 3's: both within 1%)."""
    rows = vh._rows("nvidia_dgxc_h100_bf16.csv")
    assert len(rows) == 35
    for r in rows:
        model, cluster, cfg, batch = vh.nemo_case(r)
        assert cfg.world == cluster.num_gpus == int(r["gpus"]), r
        assert cfg.microbatches(batch) == int(r["grad_accum"]), r
        assert model.vocab_size % (128 * cfg.tp) == 0 and model.vocab_size - int(r["vocab"]) < 128 * cfg.tp
        name = r["model"].split(" (")[0]
        if "proxy" in r["model"]:
            continue
        raw = model.model_copy(update={"vocab_size": 128256 if name == "llama3.1-405b" else int(r["vocab"])})
        if name.startswith("nemotron"):
            raw = raw.model_copy(update={"num_kv_heads": None})
        stated = DGXC_STATED_FLOPS[name]
        assert abs(raw.model_flops_per_token() * raw.seq_length / stated - 1) < 0.01, r
        plain = model.model_copy(update={"vocab_size": int(r["vocab"])})
        embedding = plain.vocab_size * plain.hidden_size * 2
        if name in DGXC_PARAMS:
            assert plain.num_params == DGXC_PARAMS[name]
        if name in DGXC_SPLIT_PARAMS_B:
            body, emb = DGXC_SPLIT_PARAMS_B[name]
            assert abs((plain.num_params - embedding) / 1e9 - body) < 0.1 and abs(embedding / 1e9 - emb) < 0.1


def test_bundled_h100_profile_on_nvidia_recipes():
    """The bundled profile prices NeMo's H100 runs (the stack the model follows) from the configs alone: every
    run within 15%, two thirds within 10%, the median within 10%, and never slower than measured by more than 5%
    (the misses here are one-sided: the model is optimistic; benchmarks/RESULTS.md)."""
    rows = vh.nemo()
    errors = [r["error"] for r in rows]
    assert max(abs(e) for e in errors) <= 0.15, rows
    assert sum(abs(e) <= 0.10 for e in errors) >= 2 * len(errors) / 3, rows
    assert statistics.median(abs(e) for e in errors) <= 0.10, rows
    assert max(errors) <= 0.05, rows


def test_tp_overlap_prices_the_gemm_in_ring_pieces():
    """With tp overlap a projection's forward and input-gradient GEMMs run as tp pieces of 1/tp of the tokens
    (runtime/parallel/collective_matmul.py): priced as those pieces, never faster than the whole GEMM, slower
    where the pieces leave output tiles idle, and equal when there is one piece."""
    from cost_models.compute import ComputeModel

    cm = ComputeModel(load_cluster("dgx-h100").gpu)
    whole_f, whole_b = cm.gemm_fwd_bwd(4096, 2560, 16384)
    piece_f, piece_b = cm.gemm_fwd_bwd(4096, 2560, 16384, chunks=8)
    assert piece_f == pytest.approx(8 * cm.gemm(512, 2560, 16384))
    wgrad = cm.gemm(16384, 2560, 4096)  # one GEMM on the re-gathered input, in pieces or not
    assert piece_b == pytest.approx(8 * cm.gemm(512, 16384, 2560) + wgrad)
    assert whole_b == pytest.approx(cm.gemm(4096, 16384, 2560) + wgrad)
    assert piece_f > 1.2 * whole_f and piece_b > whole_b
    assert cm.gemm_fwd_bwd(4096, 2560, 16384, chunks=1) == pytest.approx((whole_f, whole_b))


def test_wgrad_benchmark_shapes_are_each_recipes_weight_gradients():
    """benchmarks/wgrad_accumulation.py times, per recipe, one layer's four weight-gradient GEMMs on one GPU:
    (out, in) of each tensor-parallel weight shard, K = one micro-batch's tokens on that GPU."""
    spec = importlib.util.spec_from_file_location("wgrad_accumulation", ROOT / "benchmarks" / "wgrad_accumulation.py")
    wa = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wa)
    rows = {r["model"]: r for r in vh._rows("nvidia_dgxc_h100_bf16.csv")}
    model, _, cfg, _ = vh.nemo_case(rows["llama3.1-70b"])  # tp=4 cp=2, 8192-token sequences, GQA 8 groups
    assert wa.wgrad_shapes(model, cfg) == {"qkv": (2560, 8192, 4096), "proj": (8192, 2048, 4096),
                                           "mlp_in": (14336, 8192, 4096), "mlp_out": (8192, 7168, 4096)}
    model, _, cfg, _ = vh.nemo_case(rows["nemotron4-15b"])  # tp=4, 4 sequences of 4096, non-gated MLP
    assert wa.wgrad_shapes(model, cfg)["mlp_in"] == (6144, 6144, 16384)
