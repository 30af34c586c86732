"""The rules' one-line reasons name what is wrong, and only that: the count a tensor-parallel degree fails to divide,
and one reason for expert parallelism on a dense model whichever rule meets it first."""

from __future__ import annotations

from planner.cli import main
from specs.model_loading import load_model
from specs.parallel import ParallelConfig
from specs.rules import PlanContext, plan_problem


def test_tp_names_only_the_head_count_it_does_not_divide():
    tiny = load_model("tiny")  # 8 attention heads, 4 kv heads
    assert (tiny.num_attention_heads, tiny.kv_heads) == (8, 4)
    only_kv = plan_problem(ParallelConfig(tp=8), PlanContext(tiny, 8, 16))
    assert only_kv == "tp=8 does not divide the model's 4 kv heads; choose tp from 1, 2, 4"
    both = plan_problem(ParallelConfig(tp=3), PlanContext(tiny, 3, 12))
    assert both.startswith("tp=3 does not divide the model's 8 attention heads and 4 kv heads;")
    plain = tiny.model_copy(update={"num_kv_heads": None})  # no grouped-query attention: one count
    assert plain.kv_heads == 8
    assert plan_problem(ParallelConfig(tp=3), PlanContext(plain, 3, 12)).startswith(
        "tp=3 does not divide the model's 8 attention heads;")
    six = tiny.model_copy(update={"num_attention_heads": 6, "num_kv_heads": None, "hidden_size": 96})
    # the degrees offered divide the heads, the GPUs and their nodes: not 3 or 6 on 8 GPUs, 4 a node
    assert plan_problem(ParallelConfig(tp=4, dp=2), PlanContext(six, 8, 16, gpus_per_node=4)).endswith(
        "choose tp from 1, 2")
    assert plan_problem(ParallelConfig(tp=4, dp=3), PlanContext(six, 12, 24, gpus_per_node=12)).endswith(
        "choose tp from 1, 2, 3, 6")


def test_expert_parallelism_on_a_dense_model_is_one_reason_in_plan_and_estimate(capsys):
    dense = "ep=2, etp=1: expert parallelism needs a mixture-of-experts model"
    assert dense in plan_problem(ParallelConfig(dp=4, ep=2), PlanContext(load_model("tiny"), 4, 16))
    common = ["--model", "tiny", "--cluster", "cpu-gloo", "--gpus", "4", "--global-batch", "16"]
    for argv in (["plan", *common, "--fix", "ep=2"], ["estimate", *common, "--plan", "dp=4,ep=2"]):
        assert main(argv) == 2
        assert dense in capsys.readouterr().err, argv
