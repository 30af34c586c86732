"""`autopar profile --group NAME` under torchrun: node groups measured on their own ranks, the links between them,
one profile with node_groups and between_groups that loads and plans.

One torchrun pair (two "nodes" of gloo ranks on this machine, group a of one rank and b of two, --quick) runs
once for the module; bad inputs run as plain processes with torchrun's environment (no agents: faster); the pure
pieces (grouping ranks, choosing the link's nodes, building the profile) are tested without processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hardware_profiles.collectives import group_levels, levels
from hardware_profiles.groups import (
    LinkPlan,
    grouped_profile,
    link_fit,
    link_latency,
    link_rounds,
    node_layout,
    rank_record,
)
from planner.cli import main
from specs.cluster import COLLECTIVES, bus_factor
from specs.cluster_loading import cluster_from_dict, load_cluster
from specs.errors import AutoparError

pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """(profile path, node 0's stdout) of `autopar profile --quick --group a|b` run as two torchrun nodes on this
    machine, a of one rank and b of two (groups of different GPUs per node); node b says its NICs are RoCE."""
    tmp = tmp_path_factory.mktemp("groups")
    out, port = tmp / "two-groups.yaml", _port()
    nodes = []
    for k, (nproc, flags) in enumerate(((1, ["--group", "a"]), (2, ["--group", "b", "--nic-kind", "roce"]))):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(k),
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "-m", "planner.cli", "profile", "--quick", "--out", str(out), *flags]
        nodes.append(subprocess.Popen(cmd, cwd=tmp, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = [p.communicate(timeout=300) for p in nodes]
    for p, (_, err) in zip(nodes, results):
        assert p.returncode == 0, err[-3000:]
    return out, results[0][0]


@pytest.mark.slow
def test_grouped_profile_measures_each_group_and_the_link(grouped):
    path, stdout = grouped
    c = load_cluster(str(path))
    assert c.backend == "gloo" and c.precision == "fp32" and c.name == "two-groups"
    assert c.groups == {"a": 1, "b": 2} and c.num_gpus == 3 and c.gpus_per_node == 1  # the view: nodes of the gcd
    a, b = c.node_groups
    assert (a.num_nodes, a.gpus_per_node, b.num_nodes, b.gpus_per_node) == (1, 1, 1, 2)
    for g in c.node_groups:
        assert g.gpu["gemm_table"] and g.gpu["attention_table"] and g.gpu["elementwise_bandwidth_GBps"] > 0
    assert a.collectives == {}  # one rank: no peer in its group
    assert set(b.collectives) == set(COLLECTIVES)  # measured over the group's own two ranks
    assert all(set(lv) == {"intra"} and lv["intra"]["busbw_GBps"] > 0 for lv in b.collectives.values())
    assert [g.inter_node.kind for g in c.node_groups] == ["ib", "roce"]
    (link,) = c.between_groups
    assert link.groups == ("a", "b") and link.bandwidth_Gbps_per_node > 0 and link.latency_us >= 0
    # one pair (a's rank with b's first): the link carried one pair's rate, shared by b's two GPUs when both send
    assert c.topology.between("a", "b")[0] == pytest.approx(link.bandwidth_Gbps_per_node)
    assert c.topology.per_gpu_Gbps("a", "b") == pytest.approx(link.bandwidth_Gbps_per_node / 2)
    # one-node groups take the link as their NICs, alpha as their latency: the model prices alpha once
    assert a.inter_node.latency_us == b.inter_node.latency_us > 0
    assert c.topology.between("a", "b")[1] == pytest.approx(a.inter_node.latency_us)
    lines = stdout.splitlines()
    assert lines[0].startswith(f"wrote {path}: node groups a (1 x 1 cpu), b (1 x 2 cpu)")
    assert any(x.startswith("  group a:") for x in lines) and any(x.startswith("  group b:") for x in lines)
    assert any(x.startswith("  link a-b:") for x in lines)


@pytest.mark.slow
def test_planning_works_on_the_grouped_profile(grouped, capsys):
    path, _ = grouped
    assert main(["plan", "--model", "tiny", "--cluster", str(path), "--global-batch", "8", "--format", "json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and plans[0]["step_time_s"] > 0
    assert main(["plan", "--model", "tiny", "--cluster", str(path), "--global-batch", "8", "--fix",
                 "pp=3,placement=a/b*2", "--format", "json"]) == 0
    placed = json.loads(capsys.readouterr().out)["plans"]
    assert placed and placed[0]["parallel"]["placement"] == ["a", "b", "b"]
    # the stage boundary's sends cross the measured link
    assert main(["estimate", "--model", "tiny", "--cluster", str(path), "--global-batch", "8", "--plan",
                 "pp=3,placement=a/b*2", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["breakdown"]["pp_p2p"] > 0


def _ranks(flags: list[list[str]], local_worlds: list[int], tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """`autopar profile` as every rank of a torchrun-like job (its environment, no agents): rank r runs with
    ``flags[r]``; nodes of ``local_worlds`` ranks each."""
    port, procs, rank = _port(), [], 0
    world = sum(local_worlds)
    for node, local in enumerate(local_worlds):
        for lr in range(local):
            env = {**_env(), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(lr),
                   "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)}
            cmd = [sys.executable, "-m", "planner.cli", "profile", "--quick", "--out", str(tmp_path / "x.yaml"),
                   *flags[rank]]
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
            rank += 1
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.slow
def test_group_on_some_nodes_only_is_a_one_line_error(tmp_path):
    r0, r1 = _ranks([["--group", "a"], []], [1, 1], tmp_path)
    assert r0.returncode == r1.returncode == 2
    for r in (r0, r1):  # the first rank of each node says why, in one line, no traceback
        assert r.stderr.strip().splitlines() == ["autopar: error: --group must be given on every node or on none: "
                                                 "node 1 gave none (node 0: --group a)"], r.stderr
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.slow
def test_nodes_of_one_group_of_different_sizes_are_a_one_line_error(tmp_path):
    r0, r1, r2 = _ranks([["--group", "a"], ["--group", "a"], ["--group", "a"]], [2, 1], tmp_path)
    assert r0.returncode == r1.returncode == r2.returncode == 2
    want = ("autopar: error: the nodes of group a run different numbers of ranks (node 0: 2, node 1: 1): give every "
            "node of a group the same --nproc-per-node (groups may differ)")
    assert r0.stderr.strip().splitlines() == [want] and r2.stderr.strip().splitlines() == [want]
    assert r1.stderr.strip() == ""  # not the node's first rank: silent


def test_group_outside_torchrun_is_refused(tmp_path, capsys):
    assert main(["profile", "--group", "a", "--out", str(tmp_path / "x.yaml")]) == 2
    assert main(["profile", "--nic-kind", "roce", "--out", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("autopar: error: --group is for the nodes of a torchrun job")
    assert err[1].startswith("autopar: error: --nic-kind is for the nodes of a torchrun job")


# ---- pure pieces (no processes) ---------------------------------------------------------------------
def _records(names: list[str | None], local: int = 2, kinds: list[str | None] | None = None) -> list[dict]:
    """One record per rank of nodes named ``names`` (one entry per node), ``local`` ranks each."""
    kinds = kinds or [None] * len(names)
    return [rank_record(name, kind, node, i, local) for node, (name, kind) in enumerate(zip(names, kinds))
            for i in range(local)]


def test_ranks_group_by_name_whatever_their_order():
    lay = node_layout(_records(["b", "a", "b", "a"], kinds=["roce", None, "roce", None]))
    assert lay is not None and lay.per_node == [2, 2]
    assert lay.groups == {"b": [[0, 1], [4, 5]], "a": [[2, 3], [6, 7]]}  # groups in the order of their first node
    assert lay.kinds == {"b": "roce", "a": "ib"}
    assert lay.members == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # records arrive in rank order, but a node is what GROUP_RANK says, its ranks ordered by local rank
    recs = [rank_record("a", None, 1, 1, 2), rank_record("a", None, 1, 0, 2), rank_record("b", None, 0, 0, 2),
            rank_record("b", None, 0, 1, 2)]
    assert node_layout(recs).groups == {"b": [[2, 3]], "a": [[1, 0]]}
    assert node_layout(_records([None, None])) is None


def test_groups_may_differ_in_ranks_per_node():
    recs = _records(["big"], 4) + [rank_record("small", None, 1, i, 2) for i in range(2)] + \
        [rank_record("big", None, 2, i, 4) for i in range(4)]
    lay = node_layout(recs)
    assert lay.groups == {"big": [[0, 1, 2, 3], [6, 7, 8, 9]], "small": [[4, 5]]}
    assert lay.per_node == [4, 2] and lay.members == [[0, 1, 2, 3, 6, 7, 8, 9], [4, 5]]
    # one rank against eight: a node of one rank is a group of its own size
    assert node_layout(_records(["a"], 1) + [rank_record("b", None, 1, i, 8) for i in range(8)]).per_node == [1, 8]


@pytest.mark.parametrize("records, message", [
    (_records(["a", None, "b"]), "--group must be given on every node or on none: node 1 gave none (node 0: --group a)"),
    (_records([None, "a", None]), "nodes 0, 2 gave none (node 1: --group a)"),
    (_records(["a b"]), "--group 'a b': a group name may hold only letters, digits"),
    ([rank_record("a", None, 0, 0, 2), rank_record("b", None, 0, 1, 2)], "the ranks of node 0 gave different --group"),
    ([rank_record("a", None, 0, 0, 2), rank_record(None, None, 0, 1, 2)], "different --group names ((none), a)"),
    (_records(["a", "a"], kinds=["ib", "roce"]), "the nodes of group a gave different --nic-kind (ib, roce)"),
    (_records(["a"], kinds=["infiniband"]), "--nic-kind infiniband: use one of ib, roce, ethernet"),
    (_records([None, None], kinds=["roce", "roce"]), "--nic-kind roce describes a node group's NICs"),
    (_records(["a", "b"], 2) + [rank_record("a", None, 2, 0, 1)], "the nodes of group a run different numbers of "
     "ranks (node 0: 2, node 2: 1): give every node of a group the same --nproc-per-node (groups may differ)"),
    (_records([None], 2) + [rank_record(None, None, 1, 0, 1)], "every node must run the same number of ranks; got "
     "node 0: 2, node 1: 1: give every node the same --nproc-per-node (or name node groups with --group"),
    ([rank_record("a", None, 0, 0, 2)], "node 0 runs 1 rank(s) but its ranks say LOCAL_WORLD_SIZE 2"),
])
def test_bad_group_names_are_one_line_errors(records, message):
    with pytest.raises(AutoparError) as e:
        node_layout(records)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_links_pair_local_ranks_and_use_each_node_once_per_round():
    two = link_rounds({"a": [[0, 1]], "b": [[2, 3]]})
    assert two == [[LinkPlan(("a", "b"), ((0, 2), (1, 3)))]]
    one_node_each = link_rounds({"a": [[0]], "b": [[1]], "c": [[2]]})
    assert [[x.groups for x in r] for r in one_node_each] == [[("a", "b")], [("a", "c")], [("b", "c")]]
    # groups of two nodes lend a different node to each link: every link at once, no node twice
    wide = link_rounds({"a": [[0], [1]], "b": [[2], [3]], "c": [[4], [5]]})
    assert len(wide) == 1 and [x.pairs for x in wide[0]] == [((0, 2),), ((1, 4),), ((3, 5),)]
    assert link_rounds({"a": [[0, 1]]}) == []
    # nodes of different sizes: local rank i with i for every i both have; the larger node's others sit out
    assert link_rounds({"a": [[0, 1, 2, 3]], "b": [[4, 5]]}) == [[LinkPlan(("a", "b"), ((0, 4), (1, 5)))]]
    assert link_rounds({"a": [[0]], "b": [[1, 2, 3]]})[0][0].pairs == ((0, 1),)


def test_link_fit_is_what_the_pairs_carried_and_alpha():
    sizes = [4096 * 8**i for i in range(5)]
    fit = link_fit([(b, 30e-6 + b / 5e9) for b in sizes], pairs=8)
    assert fit["bandwidth_Gbps_per_node"] == pytest.approx(5e9 * 8 * 8 / 1e9, rel=1e-3)
    assert fit["alpha_us"] == pytest.approx(30, rel=1e-3) and fit["r2"] == pytest.approx(1.0)
    assert link_fit([(b, 30e-6 + b / 5e9) for b in sizes], pairs=2)["bandwidth_Gbps_per_node"] == pytest.approx(80)
    # the latency written is alpha less the NIC hops the model adds back, never below 0
    a, b = {"inter_node": {"latency_us": 4.0}}, {"inter_node": {"latency_us": 8.0}}
    assert link_latency(30.0, a, b) == pytest.approx(24.0) and link_latency(5.0, a, b) == 0.0


def test_levels_follow_a_groups_ranks():
    intra, inter = levels(4, 2, [2, 3, 6, 7])  # a group on nodes 1 and 3 of a job of 2-rank nodes
    assert intra.groups == {2: [[2, 3], [6, 7]]} and intra.pairs == [(2, 3), (6, 7)]
    assert inter.groups == {2: [[2, 6], [3, 7]]} and inter.pairs == [(2, 6), (3, 7)]
    # one group of two nodes, one of one: the inter-node level is the first group's only
    (_, intra_lvs, intra_sizes), (_, inter_lvs, inter_sizes) = group_levels([2, 2], [[0, 1, 4, 5], [2, 3]])
    assert intra_sizes == [2] and all(lv is not None for lv in intra_lvs)
    assert inter_sizes == [2] and inter_lvs[1] is None and inter_lvs[0].groups == {2: [[0, 4], [1, 5]]}
    # groups of their own GPUs per node: two nodes of 4 (ranks 0-3, 6-9), one of 2 (4, 5), one of 1 (10)
    (_, intra_lvs, intra_sizes), (_, inter_lvs, inter_sizes) = group_levels(
        [4, 2, 1], [[0, 1, 2, 3, 6, 7, 8, 9], [4, 5], [10]])
    big, small, one = intra_lvs
    assert intra_sizes == [2, 4] and one is None
    assert big.groups == {2: [[0, 1], [2, 3], [6, 7], [8, 9]], 4: [[0, 1, 2, 3], [6, 7, 8, 9]]}
    assert small.groups == {2: [[4, 5]]} and small.pairs == [(4, 5)]
    assert inter_sizes == [2] and inter_lvs[1:] == [None, None]
    assert inter_lvs[0].groups == {2: [[0, 6], [1, 7], [2, 8], [3, 9]]}


def _gpu_group(name: str, nodes: list[list[int]], tflops: float) -> dict:
    """A GPU group's measurements (H100-like), collectives inside its nodes and, with two nodes, across them."""
    gemm = [{"m": m, "n": n, "k": k, "seconds": 2 * m * n * k / (tflops * 1e12)} for m in (2048, 8192)
            for n in (1024, 8192) for k in (1024, 8192)]
    attn = [{"seq": s, "heads": 16, "head_dim": 128, "batch": 16384 // s, "fwd_s": 2 * 16384 * 16 * s * 128 / 400e12,
             "bwd_s": 5 * 16384 * 16 * s * 128 / 330e12} for s in (1024, 4096)]
    sizes = [2**16 * 4**i for i in range(6)]
    levels_bw = {"intra": 360e9, "inter": 45e9} if len(nodes) > 1 else {"intra": 360e9}
    colls = {c: {lv: [(2, b, 20e-6 + b * bus_factor(c, 2) / bw) for b in sizes] for lv, bw in levels_bw.items()}
             for c in COLLECTIVES}
    return {"name": name, "kind": "ib", "nodes": nodes,
            "device": {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "memory_GiB": 79.1, "sm_count": 132},
            "compute": {"gemm": gemm, "attention": attn, "copy_Bps": 2.9e12, "tiny_op_s": 2.5e-6}, "collectives": colls}


def test_grouped_measurements_assemble_into_a_profile_that_plans(tmp_path, capsys):
    """The grouped assembly on GPU-like measurements (no GPU needed): each group keeps its own tables and fits, a
    one-node group takes the bundled NICs with a note, the link is per node; the file loads and plans."""
    from hardware_profiles.assemble import to_yaml

    sizes = [2**16 * 4**i for i in range(6)]
    meas = {"device": {"name": "x"}, "precision": "bf16", "backend": "nccl", "world": 24, "local": 8, "quick": True,
            "groups": [_gpu_group("fast", [list(range(8)), list(range(16, 24))], 700),
                       _gpu_group("slow", [list(range(8, 16))], 350)],
            "links": [{"groups": ["fast", "slow"], "pairs": [[i, 8 + i] for i in range(8)],
                       "points": [(b, 15e-6 + b / 2.5e9) for b in sizes]}]}
    prof, notes = grouped_profile(meas, "two-islands")
    fast, slow = prof["node_groups"]
    assert fast["num_nodes"] == 2 and slow["num_nodes"] == 1 and fast["gpus_per_node"] == 8
    assert fast["inter_node"]["nic_bandwidth_Gbps"] == pytest.approx(360, rel=1e-3)  # 45 GB/s per GPU on the wire
    assert set(fast["collectives"]["all_reduce"]) == {"intra", "inter"} and set(slow["collectives"]["p2p"]) == {"intra"}
    assert slow["inter_node"]["nic_bandwidth_Gbps"] == load_cluster("dgx-h100").inter_node.nic_bandwidth_Gbps
    assert slow["inter_node"]["efficiency"] == fast["inter_node"]["efficiency"] == 1.0  # links priced as measured
    assert any("group slow has one node" in n for n in notes)
    (link,) = prof["between_groups"]
    # alpha 15 us end to end, less the NIC hops the model adds: (fast's 20 us + slow's bundled 5 us) / 2
    assert link == {"groups": ["fast", "slow"], "bandwidth_Gbps_per_node": pytest.approx(160, rel=1e-3),
                    "latency_us": pytest.approx(15 - 12.5, rel=1e-3)}
    out = tmp_path / "two-islands.yaml"
    out.write_text(to_yaml(prof, meas, notes))
    c = load_cluster(str(out))
    assert c.groups == {"fast": 16, "slow": 8} and c.gpu.name == "h100-sxm5-80gb"
    tables = {g.name: max(p["tflops"] for p in g.gpu["gemm_table"]) for g in c.node_groups}
    assert tables["fast"] == pytest.approx(700, rel=1e-3) and tables["slow"] == pytest.approx(350, rel=1e-3)
    assert c.group_view("fast").collectives["all_reduce"]["inter"].busbw_GBps == pytest.approx(45, rel=1e-3)
    assert c.topology.per_gpu_Gbps("fast", "slow") == pytest.approx(160 / 8, rel=1e-3)  # a send is priced as measured
    assert c.topology.between("fast", "slow")[1] == pytest.approx(15, rel=1e-3)  # alpha, counted once
    assert cluster_from_dict(prof, "again").between_groups == c.between_groups
    assert main(["plan", "--model", "llama-1b", "--cluster", str(out), "--global-batch", "64", "--top", "1",
                 "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"]


def test_groups_of_different_node_sizes_assemble_into_a_profile_that_plans(tmp_path, capsys):
    """A node of 4 GPUs and two of 2: each group's levels and gpus_per_node are its own; the link measured as
    two pairs (local ranks 0 and 1 of each node) is written as what the two pairs carried, so a node of 4 GPUs
    sending at once gets no more than that; the link's alpha round-trips through the loaded topology."""
    from hardware_profiles.assemble import to_yaml

    sizes = [2**16 * 4**i for i in range(6)]
    meas = {"device": {"name": "x"}, "precision": "bf16", "backend": "nccl", "world": 8, "local": 4, "quick": True,
            "groups": [_gpu_group("big", [[0, 1, 2, 3]], 700), _gpu_group("small", [[4, 5], [6, 7]], 350)],
            "links": [{"groups": ["big", "small"], "pairs": [[0, 4], [1, 5]],
                       "points": [(b, 60e-6 + b / 3e9) for b in sizes]}]}
    prof, notes = grouped_profile(meas, "four-and-two")
    g_big, g_small = prof["node_groups"]
    assert (g_big["num_nodes"], g_big["gpus_per_node"], g_small["num_nodes"], g_small["gpus_per_node"]) == (1, 4, 2, 2)
    assert g_big["inter_node"]["nics_per_node"] == 4  # the bundled dgx-h100's NICs per GPU, on a node of 4
    assert g_small["inter_node"]["nics_per_node"] == 2  # measured across its nodes: one NIC per GPU of its own
    assert set(g_small["collectives"]["all_reduce"]) == {"intra", "inter"}
    assert set(g_big["collectives"]["all_reduce"]) == {"intra"}
    (link,) = prof["between_groups"]
    per_pair_Gbps = 3e9 * 8 / 1e9
    assert link["bandwidth_Gbps_per_node"] == pytest.approx(per_pair_Gbps * 2, rel=1e-3)  # two pairs at once
    out = tmp_path / "four-and-two.yaml"
    out.write_text(to_yaml(prof, meas, notes))
    assert "big (1 node(s) x 4" in out.read_text() and "small (2 node(s) x 2" in out.read_text()
    c = load_cluster(str(out))
    assert c.groups == {"big": 4, "small": 4} and c.gpus_per_node == 2  # the view: nodes of the gcd
    assert {g.name: g.gpus_per_node for g in c.node_groups} == {"big": 4, "small": 2}
    assert c.group_view("big").gpus_per_node == 4 and c.group_view("small").gpus_per_node == 2
    # a node of 4 sending at once shares what two pairs carried: half a pair's rate per GPU
    assert c.topology.per_gpu_Gbps("big", "small") == pytest.approx(per_pair_Gbps * 2 / 4, rel=1e-3)
    hops = (g_big["inter_node"]["latency_us"] + g_small["inter_node"]["latency_us"]) / 2
    assert link["latency_us"] == pytest.approx(60 - hops, rel=1e-3) and hops > 0
    assert c.topology.between("big", "small")[1] == pytest.approx(60, rel=1e-3)  # the measured alpha, once
    assert main(["plan", "--model", "tiny", "--cluster", str(out), "--global-batch", "8", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"]
