"""The what-if plot of each kind (GPU count: log-log with ideal scaling; bandwidth; GPU type: bars) labels every
point with its plan, and no label, tick label or legend entry overlaps another or leaves the figure."""

from __future__ import annotations

import itertools
import math

import pytest

from planner.cli import main
from planner.whatif import normalize, sweep, with_gpu
from planner.whatif_plot import MIN_EFF_SPAN, NO_PLAN, figure, plan_label, si
from specs.cluster_loading import load_cluster
from specs.model_loading import load_model
from specs.placement import groups_text

KINDS = [  # (model, gpus, batch, key, values, compare)
    ("llama3-70b", None, 512, "gpus", [64, 128, 256, 512, 1024], {"dp_overlap": False}),
    ("llama3-8b", 64, 512, "inter_node_bw", [50.0, 100.0, 200.0, 400.0, 800.0], None),
    ("llama3-8b", 64, 512, "gpu", ["a100-sxm4-80gb", "h100-sxm5-80gb", "h200-sxm-141gb", "b200-180gb"],
     {"zero": 1}),
    ("llama3-8b", 16, 512, "gpu", ["a100-sxm4-80gb", "h100-pcie-80gb", "h100-sxm5-80gb", "h200-sxm-141gb",
                                   "b200-180gb", "l40s-48gb", "v100-sxm2-32gb"], {"dp_overlap": False}),
]


@pytest.mark.parametrize("name,gpus,batch,key,values,compare", KINDS, ids=[f"{k[3]}{len(k[4])}" for k in KINDS])
def test_every_point_labelled_and_nothing_overlaps(name, gpus, batch, key, values, compare):
    model, cluster = load_model(name), load_cluster("dgx-h100", gpus=gpus)
    curves = {"best": sweep(model, cluster, batch, key, values, {})}
    if compare:
        curves["compare"] = sweep(model, cluster, batch, key, values, {}, compare=compare)
    normalize(curves, key)
    fig = figure(curves, key, model.name, cluster.name)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    labels = [t for t in fig.findobj() if getattr(t, "get_gid", lambda: None)() == "plan-label"]
    want = sorted(plan_label(p["parallel"]) for pts in curves.values() for p in pts if p.get("tokens_per_s"))
    assert sorted(t.get_text() for t in labels) == want  # every point, with its plan
    def shown(ax, labels, lim, i):  # drawn: inside the axis' view (the locator may list ticks beyond it)
        lo, hi = sorted(lim)
        return [t for t in labels if t.get_visible() and t.get_text() and lo <= t.get_position()[i] <= hi]

    ticks = [t for ax in fig.axes for t in (*shown(ax, ax.get_xticklabels(), ax.get_xlim(), 0),
                                            *shown(ax, ax.get_yticklabels(), ax.get_ylim(), 1))]
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    titles = [ax.title for ax in fig.axes if ax.get_title()]
    assert len(legends) == 1 and len(titles) == 1
    boxes = [(f"label {t.get_text()}", t.get_window_extent(r)) for t in labels]
    boxes += [(f"tick {t.get_text()}", t.get_window_extent(r)) for t in ticks]
    boxes += [("legend", legends[0].get_window_extent(r)), ("title", titles[0].get_window_extent(r))]
    top, low = fig.axes[:2]
    boxes.append(("x label and notes", low.xaxis.label.get_window_extent(r)))
    notes = list(dict.fromkeys(p["note"] for pts in curves.values() for p in pts if p.get("note")))
    label = " ".join(low.get_xlabel().split())  # (wrapped)
    assert all(f"[{k}] {n}" in label for k, n in enumerate(notes, 1)), label  # each note once, numbered
    marked = [t.get_text() for t in low.get_xticklabels() if "[" in t.get_text()]
    assert len(marked) == len({p["value"] for pts in curves.values() for p in pts if p.get("note")}), marked
    if key == "gpu" and len(values) > 4:  # the GPUs whose node link is not the cluster's are marked
        assert "l40s-48gb [" in " ".join(marked) and "h100-sxm5-80gb [" not in " ".join(marked)
    data = [(f"{name} axes", ax.get_window_extent(r)) for name, ax in (("throughput", top), ("efficiency", low))]
    for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
        assert not ba.overlaps(bb), f"{a} overlaps {b}"
    for (a, ba), (b, bb) in itertools.product(boxes, data):  # no label over the data (bars: above their bar)
        assert key == "gpu" or not a.startswith("label") or not ba.overlaps(bb), f"{a} overlaps the {b}"
    if key == "gpu":  # the plans written up from the bars end inside their axes (the figure is laid out as saved)
        inside = top.get_window_extent(r)
        assert all(box.y1 <= inside.y1 for what, box in boxes if what.startswith("label")), "a label crosses the top"
    whole = fig.bbox
    for what, box in boxes:
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1, what
    if key != "gpu":  # the data have the throughput axes' height: their span fills most of it
        lo, hi = top.get_ylim()
        ys = [p["tokens_per_s"] for pts in curves.values() for p in pts if p.get("tokens_per_s")]
        f = math.log if top.get_yscale() == "log" else (lambda v: v)
        assert (f(max(ys)) - f(min(ys))) / (f(hi) - f(lo)) > 0.6 or max(ys) / min(ys) < 1.3
    if key == "gpus":
        assert top.get_yscale() == "log" and top.get_xscale() == "log"
        assert any(line.get_label() == "ideal (linear) scaling" for line in top.get_lines())


def test_labels_and_numbers():
    assert plan_label({"tp": 8, "pp": 4, "dp": 32, "cp": 2, "vpp": 8, "mbs": 3, "sp": True, "recompute": "selective",
                       "zero": 1, "dp_overlap": True}) == "tp8 pp4 dp32 cp2 mb3 v8 sp sel z1"
    assert plan_label({"tp": 2, "pp": 1, "dp": 8, "ep": 4, "etp": 2, "mbs": 1, "recompute": "full"}) == \
        "tp2 pp1 dp8 ep4 etp2 mb1 full"  # an MoE plan's expert parallelism is on its label
    assert plan_label({"tp": 1, "pp": 1, "dp": 8, "cp": 1, "vpp": 1, "mbs": 1, "sp": False, "recompute": "none",
                       "zero": 0}) == "tp1 pp1 dp8 mb1"
    assert [si(x) for x in (950, 1234, 2.5e6, 7e5)] == ["950", "1.23k", "2.5M", "700k"]


def test_a_gpu_point_without_the_clusters_precision_is_an_error_point():
    """--vary gpu=v100 on a bf16 cluster: that point says the V100 has no bf16 instead of pricing it at its fp16
    peak; the other points are planned."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-a100", gpus=8)
    pts = sweep(model, cluster, 64, "gpu", ["a100-sxm4-80gb", "v100-sxm2-32gb"], {})
    assert pts[0].get("tokens_per_s") and "tokens_per_s" not in pts[1]
    assert "v100-sxm2-32gb has no bf16" in pts[1]["error"]
    assert "in a cluster profile's precision" in pts[1]["error"]  # the advice is a profile's: whatif sets none


def test_a_gpu_point_gets_its_own_node_link_and_says_so(capsys):
    """--vary gpu on DGX H100 nodes: an H100 PCIe or an L40S point is priced with PCIe inside the node (not the
    cluster's NVSwitch) and carries a one-line note; a GPU with the cluster's own link gets none. Slower links
    cannot make the same GPU's step faster."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", gpus=16)
    c, note = with_gpu(cluster, "h100-pcie-80gb")
    assert c.intra_node.bandwidth_GBps == 64 and "PCIe (64 GB/s per GPU)" in note and "450 GB/s" in note
    assert with_gpu(cluster, "h200-sxm-141gb")[1] is None
    slower = cluster.model_copy(update={"intra_node": cluster.intra_node.model_copy(update={"bandwidth_GBps": 230})})
    assert with_gpu(slower, "h100-sxm5-80gb") == (slower, None)  # its own GPU keeps a (calibrated) link
    pts = sweep(model, cluster, 64, "gpu", ["h100-sxm5-80gb", "l40s-48gb"], {})
    assert "note" not in pts[0] and "l40s-48gb nodes have PCIe" in pts[1]["note"]
    pcie_link = {p["value"]: p["step_time_s"] for p in sweep(model, cluster, 64, "intra_node_bw", [450.0, 32.0], {})}
    assert pcie_link[32.0] >= pcie_link[450.0]
    assert main(["whatif", "--model", "llama3-8b", "--cluster", "dgx-h100", "--gpus", "16", "--global-batch", "64",
                 "--vary", "gpu=h100-sxm5-80gb,l40s-48gb"]) == 0
    assert "note: l40s-48gb nodes have PCIe (32 GB/s per GPU)" in " ".join(capsys.readouterr().out.split())


def test_a_gpu_type_without_a_plan_is_labelled_in_the_bar_plot():
    """--vary gpu with a GPU that has no plan (a V100 on a bf16 cluster): its bar's place, in each curve, says
    "no plan" at the base of both axes instead of standing blank; the labels stay inside the axes and clear of
    the plan labels."""
    model, cluster = load_model("tiny"), load_cluster("dgx-a100", gpus=8)
    values = ["a100-sxm4-80gb", "v100-sxm2-32gb", "h100-sxm5-80gb"]
    curves = {"best": sweep(model, cluster, 64, "gpu", values, {}),
              "zero=1": sweep(model, cluster, 64, "gpu", values, {}, compare={"zero": 1})}
    normalize(curves, "gpu")
    fig = figure(curves, "gpu", model.name, cluster.name)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    marks = [t for t in fig.findobj() if getattr(t, "get_gid", lambda: None)() == "no-plan"]
    assert {t.get_text() for t in marks} == {NO_PLAN}
    # one per curve on each axes, at the V100's place (index 1), the two curves' bars side by side
    for ax in fig.axes[:2]:
        xs = sorted(t.get_position()[0] for t in marks if t.axes is ax)
        assert xs == pytest.approx([0.8, 1.2])
        for t in (t for t in marks if t.axes is ax):
            box = t.get_window_extent(r)
            assert ax.bbox.x0 <= box.x0 and box.x1 <= ax.bbox.x1 and ax.bbox.y0 <= box.y0 <= ax.bbox.y1
    labels = [t.get_window_extent(r) for t in fig.findobj() if getattr(t, "get_gid", lambda: None)() == "plan-label"]
    assert len(labels) == 4 and not any(t.get_window_extent(r).overlaps(b) for t in marks for b in labels)


def test_a_point_without_a_plan_is_labelled_on_the_line_plot():
    """--vary gpus where the smallest cluster holds no plan: its place on the GPU axis says "no plan" where its plan
    would be named, not blank."""
    model, cluster = load_model("llama3-70b"), load_cluster("dgx-h100")
    curves = {"best": sweep(model, cluster, 512, "gpus", [8, 64], {})}
    normalize(curves, "gpus")
    assert "error" in curves["best"][0] and curves["best"][1]["tokens_per_s"] > 0
    fig = figure(curves, "gpus", model.name, cluster.name)
    marks = [t for t in fig.findobj() if getattr(t, "get_gid", lambda: None)() == "no-plan"]
    assert [(t.get_text(), t.get_position()[0]) for t in marks] == [(NO_PLAN, 8)]
    top, low = fig.axes[:2]
    assert top.get_xlim()[0] < 8 < top.get_xlim()[1]  # the mark stands inside the axes, not clipped at its edge


def test_efficiencies_close_to_one_are_drawn_flat_without_an_offset():
    """A sweep whose efficiencies differ by 1e-4 (one plan throughout) reads as flat at 1, not as an axis of
    +9.999e-1 offsets: the axis spans at least MIN_EFF_SPAN, its labels are the values."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100")
    curves = {"best": sweep(model, cluster, 512, "gpus", [8, 16], {"tp": 8})}
    normalize(curves, "gpus")
    effs = [p["scaling_efficiency"] for p in curves["best"]]
    assert 0 < abs(effs[0] - effs[1]) < 1e-2, effs
    fig = figure(curves, "gpus", model.name, cluster.name)
    fig.canvas.draw()
    low = fig.axes[1]
    lo, hi = low.get_ylim()
    assert hi - lo == pytest.approx(MIN_EFF_SPAN) and lo < min(effs) <= max(effs) < hi
    assert low.yaxis.get_major_formatter().get_offset() == ""


def test_a_sweep_of_group_names_is_drawn_as_bars_with_each_plans_placement():
    """--vary group_net:eth=eth,roce sweeps names, not numbers: bars as for GPU types (it crashed computing an x
    span of names), each labelled with its plan and where its stages sit, and an axis that names the group."""
    model, cluster = load_model("llama3-8b"), load_cluster("ib-roce-eth-a100")
    key = "group_net:eth"
    curves = {"best": sweep(model, cluster, 512, key, ["eth", "roce"], {})}
    normalize(curves, key)
    fig = figure(curves, key, model.name, cluster.name)
    fig.canvas.draw()
    top, low = fig.axes[:2]
    assert [t.get_text() for t in low.get_xticklabels()] == ["eth", "roce"]
    assert "node group eth" in low.get_xlabel()
    labels = sorted(t.get_text() for t in fig.findobj() if getattr(t, "get_gid", lambda: None)() == "plan-label")
    placed = [p["parallel"]["placement"] for p in curves["best"]]
    assert all(p for p in placed) and labels == sorted(plan_label(p["parallel"]) for p in curves["best"])
    assert all(plan_label(p["parallel"]).endswith(" " + groups_text(p["parallel"]["placement"])) for p in curves["best"])
    r = fig.canvas.get_renderer()  # the labels, longer with a placement, end inside the axes (they ran into the title)
    for t in (t for t in top.texts if t.get_gid() == "plan-label"):
        assert t.get_window_extent(r).y1 <= top.bbox.y1 + 1, t.get_text()


def test_a_linear_axis_never_shows_negative_tokens_and_a_short_log_axis_keeps_its_numbers():
    """The room left for the compared curve's labels went below zero tokens/s on a linear axis; a single point on a
    log axis spanning less than a decade had no tick label to read its value from."""
    model = load_model("llama3-8b")
    cluster = load_cluster("ib-roce-eth-a100")
    key = "group_bw:eth"
    curves = {"best": sweep(model, cluster, 512, key, [25.0, 100.0], {}),
              "placement=none": sweep(model, cluster, 512, key, [25.0, 100.0], {}, compare={"placement": ("none",)})}
    normalize(curves, key)
    top = figure(curves, key, model.name, cluster.name).axes[0]
    assert top.get_ylim()[0] >= 0
    tiny = load_model("tiny")
    curves = {"best": sweep(tiny, load_cluster("cpu-gloo"), 16, "gpus", [2], {})}
    normalize(curves, "gpus")
    fig = figure(curves, "gpus", tiny.name, "cpu-gloo")
    fig.canvas.draw()
    top = fig.axes[0]
    lo, hi = top.get_ylim()
    texts = [t.get_text() for t in (*top.get_yticklabels(), *top.get_yticklabels(minor=True))
             if t.get_text() and lo <= t.get_position()[1] <= hi]
    assert texts, "no y tick label inside the axis"


def test_an_intra_node_link_beyond_the_platforms_is_priced_with_a_note():
    """--vary intra_node_bw=10000 on H100s: a what-if may ask for it (a profile may not claim it), so the point is
    planned and says that its GPUs' platform has no such link; a link within reach says nothing."""
    model, cluster = load_model("llama3-8b"), load_cluster("dgx-h100", gpus=64)
    near, far = sweep(model, cluster, 512, "intra_node_bw", [450.0, 10000.0], {})
    assert "note" not in near and far["tokens_per_s"] > 0
    assert "more than 1.25x the NVLink/NVSwitch (450 GB/s per GPU)" in far["note"]


def test_a_node_groups_bandwidth_sweep_has_a_log_axis_and_a_plot_name_is_checked_first(tmp_path, capsys):
    """group_bw doubles as inter_node_bw does: a log axis, where 10 and 12.5 Gb/s keep their labels apart; a --plot
    name matplotlib cannot write is refused before the sweep."""
    model, cluster = load_model("llama3-8b"), load_cluster("ib-roce-a100")
    key = "group_bw:roce"
    curves = {"best": sweep(model, cluster, 512, key, [10.0, 12.5, 25.0, 100.0], {})}
    normalize(curves, key)
    fig = figure(curves, key, model.name, cluster.name)
    assert fig.axes[1].get_xscale() == "log"
    assert main(["whatif", "--model", "tiny", "--cluster", "dgx-h100", "--global-batch", "64", "--vary", "gpus=8,16",
                 "--plot", str(tmp_path / "x.txt")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "matplotlib writes no .txt image; name a .png" in out.err
