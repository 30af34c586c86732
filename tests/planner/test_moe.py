"""Mixture-of-experts models from the spec to the plan: published counts, what the cost model prices, the search
choosing expert parallelism, and bad input in one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_bad_inputs import fails

from cost_models.step import estimate
from planner.cli import main
from planner.search import search
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model
from specs.moe import MoESpec
from specs.parallel import ParallelConfig


# ---- the spec -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,total,active", [
    ("mixtral-8x7b", 46.7e9, 12.9e9),  # Jiang et al. 2024, "Mixtral of Experts"
    ("mixtral-8x22b", 141e9, 39e9),  # Mistral AI's release notes
    ("qwen2-moe-a2.7b", 14.3e9, 2.7e9),  # Qwen1.5-MoE-A2.7B model card
    ("olmoe-1b-7b", 6.9e9, 1.3e9),  # Muennighoff et al. 2024 (QK-norm's 65k parameters not modelled)
])
def test_presets_have_the_published_parameter_counts(name, total, active):
    m = load_model(name)
    assert m.num_params == pytest.approx(total, rel=0.01)
    assert m.active_params == pytest.approx(active, rel=0.02)


@pytest.mark.parametrize("freq,dense", [(1, 0), (2, 0), (1, 1), (3, 2), (4, 7)])
def test_moe_layer_counts_match_the_pattern(freq, dense):
    moe = MoESpec(num_experts=4, experts_per_token=1, moe_ffn_hidden_size=8, layer_freq=freq, first_dense_layers=dense)
    for n in range(0, 20):
        assert moe.moe_layers_before(n) == sum(moe.is_moe_layer(i) for i in range(n))


def test_one_expert_taking_every_token_is_the_dense_model():
    """A MoE layer of one expert (top-1, the dense width, no imbalance) is the dense MLP plus a router: its parameters,
    and on one GPU its time and memory, are the dense model's plus the router's small share."""
    dense = load_model("llama3-8b").with_seq(4096)
    moe = dense.model_copy(update={"moe": MoESpec(num_experts=1, experts_per_token=1,
                                                  moe_ffn_hidden_size=dense.ffn, load_imbalance=1.0)})
    assert moe.num_params - dense.num_params == dense.num_layers * dense.hidden_size  # the routers
    assert moe.model_flops_per_token() == pytest.approx(dense.model_flops_per_token(), rel=1e-3)
    cluster = load_cluster("dgx-h100").resized(8)
    cfg = ParallelConfig(tp=1, pp=1, dp=8, mbs=1, zero=1)
    a, b = (estimate(m, cluster, cfg, 64) for m in (dense, moe))
    assert 1.0 < b.step_time_s / a.step_time_s < 1.06
    assert 1.0 < b.memory_GiB / a.memory_GiB < 1.06


def test_experts_split_over_ep_and_their_state_over_the_expert_replicas():
    """Expert weights shrink with ep; ZeRO-1 shards their optimizer state over dp*cp*tp/(ep*etp) replicas."""
    m = load_model("mixtral-8x7b")
    cluster = load_cluster("dgx-h100").resized(64)
    base = ParallelConfig(tp=2, pp=4, dp=8, mbs=1, sp=True, zero=1, ep=1)
    w = {ep: estimate(m, cluster, replace(base, ep=ep), 256).memory_breakdown for ep in (1, 2, 4, 8)}
    experts_per_layer = 3 * m.hidden_size * m.moe.moe_ffn_hidden_size * m.moe.num_experts
    layers = m.num_layers // base.pp
    for ep in (2, 4, 8):  # bf16 weights: the experts' 2 bytes per parameter go down by 1/ep
        saved = (w[1]["weights"] - w[ep]["weights"]) * 2**30
        assert saved == pytest.approx(2 * layers * experts_per_layer * (1 - 1 / ep), rel=1e-6)
    # the expert replicas: ep=8 leaves 16/8 = 2 of them, so the optimizer's 12 bytes per expert parameter are halved
    opt8 = w[8]["optimizer"] * 2**30
    expert_params = layers * experts_per_layer / 8
    dense_opt = opt8 - 12 * expert_params / 2
    assert dense_opt > 0 and w[1]["optimizer"] * 2**30 == pytest.approx(dense_opt + 12 * expert_params * 8 / 16,
                                                                        rel=1e-6)


def test_all_to_all_is_priced_on_the_links_it_crosses():
    """ep inside a node rides NVLink; the same ep across nodes (tp=1, ep=16 spans two nodes) pays the NICs, and
    slower NICs cost more all-to-all."""
    m = load_model("mixtral-8x7b")
    cluster = load_cluster("dgx-h100").resized(64)
    cfg = ParallelConfig(tp=1, pp=4, dp=16, mbs=1, ep=8, vpp=1, zero=1)
    inside = estimate(m, cluster, cfg, 256).breakdown["ep_comm"]
    across = estimate(m.model_copy(update={"moe": m.moe.model_copy(update={"num_experts": 16})}), cluster,
                      replace(cfg, ep=16), 256).breakdown["ep_comm"]
    assert across > 2 * inside > 0
    slow = cluster.model_copy(update={"inter_node": cluster.inter_node.model_copy(
        update={"nic_bandwidth_Gbps": cluster.inter_node.nic_bandwidth_Gbps / 4})})
    m16 = m.model_copy(update={"moe": m.moe.model_copy(update={"num_experts": 16})})
    assert estimate(m16, slow, replace(cfg, ep=16), 256).breakdown["ep_comm"] > 2 * across


def test_imbalance_and_capacity_slow_the_experts():
    m = load_model("mixtral-8x7b")
    cluster = load_cluster("dgx-h100").resized(64)
    cfg = ParallelConfig(tp=1, pp=4, dp=16, mbs=1, ep=8, zero=1)
    t = {r: estimate(m.model_copy(update={"moe": m.moe.with_imbalance(r)}), cluster, cfg,
                     256).step_time_s for r in (1.0, 1.5)}
    capped = estimate(m.model_copy(update={"moe": m.moe.model_copy(update={"load_imbalance": 1.5,
                                                                           "capacity_factor": 1.0})}),
                      cluster, cfg, 256).step_time_s
    assert t[1.5] > 1.1 * t[1.0]
    assert capped == pytest.approx(t[1.0])  # padded to capacity 1.0: the balanced load


def test_unknown_routing_is_priced_at_the_default_and_its_band_reaches_balanced(capsys):
    """A spec that leaves moe.load_imbalance unset is priced at the default imbalance, and its band reaches down to
    the step at balanced routing; a spec that sets it (any value) gets the plain band."""
    from planner.uncertainty import band

    m = load_model("mixtral-8x7b")
    assert m.moe.load_imbalance == 1.5 and not m.moe.routing_known
    cluster = load_cluster("dgx-h100").resized(64)
    cfg = ParallelConfig(tp=1, pp=4, dp=16, mbs=1, ep=8, zero=1)
    at = {r: estimate(m.model_copy(update={"moe": m.moe.with_imbalance(r)}), cluster, cfg,
                      256).step_time_s for r in (1.0, 1.5)}
    assert estimate(m, cluster, cfg, 256).step_time_s == pytest.approx(at[1.5])  # the default, 1.5
    keys = "tp=1,pp=4,ep=8,mbs=1,zero=1"
    assert main(["estimate", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch",
                 "256", "--plan", keys, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    b = band(True)
    assert out["balanced_routing_step_s"] == pytest.approx(at[1.0], rel=1e-5)
    assert out["step_time_band_s"] == pytest.approx([at[1.0] * b.low, at[1.5] * b.high], rel=1e-4)
    assert main(["plan", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "256",
                 "--top", "2", "--format", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert all(p["balanced_routing_step_s"] < p["step_time_s"] for p in plan["plans"])
    assert "load imbalance is not known" in plan["why"]


def test_a_known_imbalance_keeps_the_plain_band(tmp_path, capsys):
    from planner.uncertainty import band

    spec = load_model("mixtral-8x7b").model_dump(mode="json")
    del spec["moe"]["load_imbalance_known"]  # a spec written by hand: giving load_imbalance makes it known
    spec["moe"]["load_imbalance"] = 1.5
    path = tmp_path / "m.json"
    path.write_text(json.dumps(spec))
    assert main(["estimate", "--model", str(path), "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "256",
                 "--plan", "tp=1,pp=4,ep=8,mbs=1,zero=1", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    b = band(True)
    assert "balanced_routing_step_s" not in out
    assert out["step_time_band_s"] == pytest.approx([out["step_time_s"] * b.low, out["step_time_s"] * b.high],
                                                    rel=1e-4)


# ---- the planner ----------------------------------------------------------------------------------------------
def test_mixtral_on_64_h100s_uses_expert_parallelism():
    res = search(load_model("mixtral-8x7b"), load_cluster("dgx-h100").resized(64), 512, top=3)
    best = res.plans[0].config
    assert best.ep > 1 and (best.tp * best.cp * best.dp) % (best.ep * best.etp) == 0
    assert best.zero <= 1 and (best.tp == 1 or best.sp)


def test_whatif_shows_the_all_to_all_share_growing_as_bandwidth_falls(capsys):
    assert main(["whatif", "--model", "mixtral-8x7b", "--cluster", "dgx-h100", "--gpus", "64", "--global-batch", "512",
                 "--vary", "inter_node_bw=400,100,25", "--fix", "tp=2,sp=true,pp=4,ep=8,etp=2,mbs=1,vpp=1,zero=1",
                 "--format", "json"]) == 0
    points = json.loads(capsys.readouterr().out)["curves"]["best"]
    share = {p["value"]: p["breakdown"]["ep_comm"] / p["step_time_s"] for p in points}
    assert share[400] < share[100] < share[25]


def test_dense_models_search_no_expert_keys():
    res = search(load_model("llama3-8b"), load_cluster("dgx-h100").resized(16), 64, top=1)
    assert (res.plans[0].config.ep, res.plans[0].config.etp) == (1, 1)


# ---- bad input: one line, exit 2 ------------------------------------------------------------------------------
MOE = ("name: m\narch: llama\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\nffn_hidden_size: 128\n"
       "vocab_size: 100\nseq_length: 64\nmoe: {num_experts: 6, experts_per_token: %d, moe_ffn_hidden_size: 32}\n")
EST = ["estimate", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "8"]


@pytest.mark.parametrize("spec,plan,needle", [
    (MOE % 2, "tp=1,ep=4", "ep=4 does not divide the model's 6 experts; choose ep from 1, 2\n"),  # (3, 6: not on 4 GPUs)
    (MOE % 7, "tp=1", "experts_per_token 7 is more than moe.num_experts 6"),
    (MOE % 2, "tp=2,ep=2", "with MoE layers needs sp=true"),
    (MOE % 2, "tp=1,ep=2,zero=2", "ZeRO-2/3 of a mixture-of-experts model is not modelled"),
    (MOE % 2, "tp=1,pp=2,ep=2,etp=2", "ep*etp = 2*2 must divide dp*cp*tp = 2*1*1"),
    (MOE % 2, "etp=3", "ep*etp = 1*3 must divide a stage's dp*cp*tp, a divisor of the 4 GPUs, which 3 is not"),
    (None, "tp=1,ep=2", "expert parallelism needs a mixture-of-experts model"),
])
def test_bad_moe_input_is_one_line(tmp_path, capsys, spec, plan, needle):
    model = "tiny"
    if spec is not None:
        (tmp_path / "m.yaml").write_text(spec)
        model = str(tmp_path / "m.yaml")
    assert needle in fails(capsys, *EST, "--model", model, "--plan", plan)


def test_moe_hf_configs_read_and_refused(tmp_path, capsys):
    qwen = {"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 4, "intermediate_size": 128, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
            "num_experts": 6, "num_experts_per_tok": 2, "decoder_sparse_step": 2, "vocab_size": 100,
            "max_position_embeddings": 64}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(qwen))
    m = load_model(str(p))
    assert m.moe is not None and m.qkv_bias and m.moe.shared_expert_gate and not m.moe.norm_topk_prob
    assert [m.moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]  # Qwen: (i + 1) % step == 0
    p.write_text(json.dumps({**qwen, "mlp_only_layers": [0]}))
    assert "dense layers at chosen positions" in fails(capsys, *EST, "--model", str(p), "--plan", "tp=1")
    p.write_text(json.dumps({**qwen, "model_type": "deepseek_v2", "n_routed_experts": 6}))
    assert "mixture-of-experts model autopar does not read" in fails(capsys, *EST, "--model", str(p), "--plan", "tp=1")


def test_a_qwen3_moe_config_is_the_published_model(tmp_path):
    """Qwen3-30B-A3B's config.json (Hugging Face, Qwen/Qwen3-30B-A3B: its fields as published) reads as its model
    card says, 30.5B parameters and 3.3B active, with no shared expert and normalised top-k weights; the preset
    plans the same shapes."""
    cfg = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
           "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
           "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
           "tie_word_embeddings": False, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
           "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001, "attention_bias": False}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    m = load_model(str(p))
    assert m.num_params / 1e9 == pytest.approx(30.5, abs=0.1) and m.active_params / 1e9 == pytest.approx(3.3, abs=0.1)
    assert m.moe.num_shared_experts == 0 and m.moe.norm_topk_prob and not m.qkv_bias
    assert m.num_params == load_model("qwen3-30b-a3b").num_params


def test_every_moe_plan_the_planner_writes_is_one_the_runtime_executes(tmp_path, capsys):
    """Expert, expert-tensor and context parallelism included: `--runnable` changes nothing, and `autopar run`'s
    checks accept the plan files."""
    from specs.capabilities import execution_problem
    from specs.planfile import load_plan

    out = tmp_path / "moe.json"
    common = ["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "8", "--global-batch", "16",
              "--format", "json"]
    for fix in ("ep=2,etp=2,tp=2,sp=true", "ep=4,cp=2", "ep=8"):
        assert main([*common, "--fix", fix, "--out", str(out)]) == 0
        free = json.loads(capsys.readouterr().out)["plans"][0]["parallel"]
        plan = load_plan(out)
        assert execution_problem(plan.model, plan.state) is None, fix
        assert main([*common, "--fix", fix, "--runnable"]) == 0
        assert json.loads(capsys.readouterr().out)["plans"][0]["parallel"] == free


def test_published_moe_rows_map_onto_valid_plans():
    """Every row of benchmarks/data/moe_h100_published.csv is a plan the rules accept for its model and GPUs, and
    the benchmark prices it (its numbers are reported in RESULTS.md, not asserted)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import validate_moe
    rows = validate_moe.rows()
    assert len(rows) >= 3
    for row in rows:
        out = validate_moe.predict(row)
        assert out["predicted_tflops"] > 0 and out["measured_tflops"] > 0


def test_the_aux_loss_all_reduce_is_tensor_parallel_communication_not_expert_parallel():
    """The aux loss's counts are all-reduced over a sequence's tp x cp ranks (the runtime's phase clock books that
    group to tp_cp_comm): priced there too, so a plan without expert parallelism has no ep_comm, and with it
    ep_comm is the all-to-alls alone."""
    model, cluster = load_model("tiny-moe"), load_cluster("cpu-gloo", gpus=4)
    assert model.moe.aux_loss_coef > 0
    plain = estimate(model, cluster, ParallelConfig(tp=2, dp=2, sp=True), 8)
    assert plain.breakdown["ep_comm"] == 0.0
    no_aux = model.model_copy(update={"moe": model.moe.model_copy(update={"aux_loss_coef": 0.0})})
    without = estimate(no_aux, cluster, ParallelConfig(tp=2, dp=2, sp=True), 8)
    assert plain.breakdown["tp_cp_comm"] > without.breakdown["tp_cp_comm"]  # the aux all-reduce is there
    with_ep = [estimate(m, cluster, ParallelConfig(tp=2, dp=2, ep=2, sp=True), 8) for m in (model, no_aux)]
    assert with_ep[0].breakdown["ep_comm"] == pytest.approx(with_ep[1].breakdown["ep_comm"])


def test_run_says_a_capacity_factor_is_priced_not_applied(tmp_path, capsys):
    """A spec's capacity factor prices the experts' padded (or, under 1, capped) buffers; the runtime routes
    dropless, and `autopar run` says so before it starts instead of leaving the steps to disagree silently."""
    spec = load_model("tiny-moe")
    spec = spec.model_copy(update={"moe": spec.moe.model_copy(update={"capacity_factor": 0.5})})
    (tmp_path / "m.json").write_text(json.dumps(spec.model_dump(mode="json", exclude_none=True)))
    plan = tmp_path / "p.json"
    assert main(["plan", "--model", str(tmp_path / "m.json"), "--cluster", "cpu-gloo", "--gpus", "2",
                 "--global-batch", "8", "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "capacity factor 0.5 prices" in out and "routes dropless" in out
    assert main(["run", str(_tiny_moe_plan(tmp_path)), "--dry-run"]) == 0
    assert "capacity factor" not in capsys.readouterr().out


def _tiny_moe_plan(tmp_path):
    path = tmp_path / "plain.json"
    assert main(["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "2", "--global-batch", "8",
                 "--out", str(path)]) == 0
    return path
