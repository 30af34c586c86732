#!/usr/bin/env python
"""Benchmark the runtime's Triton kernels against torch eager, torch.compile and Liger-Kernel.

    python benchmarks/kernels.py [--quick] [--json out.json] [--ops rms_norm,flce]

Shapes come from the reference Llama (hidden 2048, 16 heads of 128, ffn 5504, vocab 32000, micro-batch 2 x
seq 4096 = 8192 tokens). The script first checks our kernels against the torch reference on the GPU
(forward and every gradient, fp32 and bf16), then, per op and shape, times forward and forward+backward
with ``triton.testing.do_bench`` (median, L2 flushed between runs) and records the peak memory one
forward+backward allocates beyond its inputs. Variants: ``ours`` (Triton), ``eager`` (the torch reference
the runtime uses on CPU), ``torch.F`` (PyTorch's own fused op where one exists), ``compile``
(``torch.compile`` of the reference) and ``liger`` (Liger-Kernel, when importable). All tensors are bf16
except the ``flce(amp)`` rows: fp32 master weight under bf16 autocast, as in training. A failing variant is
reported and skipped; the rest still run. ``--tune`` first sweeps our launch knobs (rows per program,
warps, backward programs per SM, SwiGLU block, FLCE chunk size and vocab block) and keeps the fastest.
Needs a CUDA GPU and exits with a message otherwise
(``--smoke`` runs the whole script on CPU, interpreter, tiny shapes, to test the script itself).
Exit status 1 when a correctness check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EPS = 1e-5


@dataclass
class Dims:
    tokens: int = 8192
    hidden: int = 2048
    heads: int = 16
    head_dim: int = 128
    ffn: int = 5504
    vocab: int = 32000
    seq: int = 4096


SMOKE_DIMS = Dims(tokens=48, hidden=40, heads=4, head_dim=16, ffn=72, vocab=250, seq=24)


@dataclass
class Case:
    """One op at one shape: a maker of fresh inputs, and the variants to time on them."""

    op: str
    shape: str
    make: Callable[[], tuple[dict, list[torch.Tensor]]]  # -> (kwargs, grad outputs; [] for a scalar loss)
    variants: dict[str, Callable[..., object]] = field(default_factory=dict)
    autocast: bool = False


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _liger():
    try:
        from liger_kernel.transformers import functional as LF
        return LF
    except Exception:  # noqa: BLE001 - any import problem means "not available"
        return None


def _liger_fused_add():
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except Exception:  # noqa: BLE001
        return None
    return lambda x, r, w, eps: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False)


def _liger_rope(LF, q, k, cos, sin):
    """Liger takes [batch, heads, seq, dim] (a transposed view here, free) and full-width cos/sin."""
    cos_f, sin_f = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    qo, ko = LF.liger_rope(q.transpose(1, 2), k.transpose(1, 2), cos_f, sin_f)
    return qo.transpose(1, 2), ko.transpose(1, 2)


def _with_eps(fn):
    return lambda **kw: fn(**kw, eps=EPS)


def _ours(fn):
    import runtime.kernels as K

    def run(**kw):
        previous = K.get_backend()
        K.set_backend("triton")
        try:
            return fn(**kw)
        finally:
            K.set_backend(previous)
    return run


def _vocab_parallel_world1(dev: str):
    """The TP path (stats kernel + all_gather + grad kernel) on a one-rank group: its overhead."""
    import torch.distributed as dist

    import runtime.kernels as K

    def run(x, weight, target):
        if not dist.is_initialized():
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            dist.init_process_group("nccl" if dev == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=0, world_size=1)
        return K.vocab_parallel_linear_cross_entropy(x, weight, target, 0, dist.group.WORLD)
    return _ours(run)


def build_cases(dims: Dims, dev: str, quick: bool, with_compile: bool) -> list[Case]:
    import runtime.kernels as K
    from runtime.kernels import cross_entropy_op, layer_norm_op, rms_norm_op, rope_op, swiglu_op

    LF = _liger() if dev == "cuda" else None
    liger_add = _liger_fused_add() if LF is not None else None
    bf16, d = torch.bfloat16, dims
    cases: list[Case] = []

    def compiled(fn, eps=False):
        if not with_compile:
            return None
        c = torch.compile(fn, dynamic=False)
        return _with_eps(c) if eps else c

    def add(case: Case, **variants):
        case.variants.update({k.replace("__", "."): v for k, v in variants.items() if v is not None})
        cases.append(case)

    def randn(*shape, scale=1.0, shift=0.0, dtype=bf16):
        return (torch.randn(*shape, device=dev) * scale + shift).to(dtype)

    norm_shapes = [(d.tokens, d.hidden)]
    if not quick:
        norm_shapes += [(d.tokens, 2 * d.hidden), (2 * d.tokens, d.hidden)]
    for n, h in norm_shapes:
        def mk_rms(n=n, h=h):
            return {"x": _leaf(randn(n, h)), "weight": _leaf(randn(h, scale=0.1, shift=1))}, [randn(n, h)]
        add(Case("rms_norm", f"{n}x{h}", mk_rms),
            ours=_ours(_with_eps(K.rms_norm)),
            eager=_with_eps(rms_norm_op.rms_norm_reference),
            torch__F=(lambda x, weight: F.rms_norm(x, (x.shape[-1],), weight, EPS)) if hasattr(F, "rms_norm")
            else None,
            compile=compiled(rms_norm_op.rms_norm_reference, eps=True),
            liger=(lambda x, weight: LF.liger_rms_norm(x, weight, EPS, in_place=False)) if LF else None)

        def mk_add(n=n, h=h):
            kw = {"x": _leaf(randn(n, h)), "residual": _leaf(randn(n, h)),
                  "weight": _leaf(randn(h, scale=0.1, shift=1))}
            return kw, [randn(n, h), randn(n, h)]
        add(Case("add_rms_norm", f"{n}x{h}", mk_add),
            ours=_ours(_with_eps(K.add_rms_norm)),
            eager=_with_eps(rms_norm_op.add_rms_norm_reference),
            compile=compiled(rms_norm_op.add_rms_norm_reference, eps=True),
            liger=(lambda x, residual, weight: liger_add(x, residual, weight, EPS)) if liger_add else None)

        def mk_ln(n=n, h=h):
            kw = {"x": _leaf(randn(n, h, shift=1)), "weight": _leaf(randn(h, scale=0.1, shift=1)),
                  "bias": _leaf(randn(h, scale=0.1))}
            return kw, [randn(n, h)]
        add(Case("layer_norm", f"{n}x{h}", mk_ln),
            ours=_ours(_with_eps(K.layer_norm)),
            eager=_with_eps(layer_norm_op.layer_norm_reference),
            torch__F=lambda x, weight, bias: F.layer_norm(x, (x.shape[-1],), weight, bias, EPS),
            compile=compiled(layer_norm_op.layer_norm_reference, eps=True),
            liger=(lambda x, weight, bias: LF.liger_layer_norm(x, weight, bias, EPS)) if LF else None)

    for n, f in [(d.tokens, d.ffn)] + ([] if quick else [(d.tokens, 14336 if dev == "cuda" else 2 * d.ffn)]):
        def mk_sw(n=n, f=f):
            return {"gate": _leaf(randn(n, f)), "up": _leaf(randn(n, f))}, [randn(n, f)]
        add(Case("swiglu", f"{n}x{f}", mk_sw),
            ours=_ours(K.swiglu), eager=swiglu_op.swiglu_reference,
            compile=compiled(swiglu_op.swiglu_reference),
            liger=(lambda gate, up: LF.liger_swiglu(gate, up)) if LF else None)

        def mk_sw_packed(n=n, f=f):  # the model's layout: gate/up are the halves of one gate_up projection
            return {"gate_up": _leaf(randn(n, 2 * f))}, [randn(n, f)]
        add(Case("swiglu", f"{n}x{f} packed [g|u]", mk_sw_packed),
            ours=_ours(K.swiglu_packed),
            ours_chunked=_ours(lambda gate_up: K.swiglu(*gate_up.chunk(2, -1))),
            eager=swiglu_op.swiglu_packed_reference,
            compile=compiled(swiglu_op.swiglu_packed_reference),
            liger=(lambda gate_up: LF.liger_swiglu(*gate_up.chunk(2, -1))) if LF else None)

    bsz = max(1, d.tokens // d.seq)
    rope_shapes = [(bsz, d.seq, d.heads, d.heads, d.head_dim)]
    if not quick:
        rope_shapes.append((bsz, d.seq, 2 * d.heads, d.heads // 2, d.head_dim))  # GQA
    for b, s, h, hk, hd in rope_shapes:
        def mk_rope(b=b, s=s, h=h, hk=hk, hd=hd):
            inv = 1.0 / 10000 ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd)
            ang = torch.arange(s, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
            kw = {"q": _leaf(randn(b, s, h, hd)), "k": _leaf(randn(b, s, hk, hd)),
                  "cos": ang.cos(), "sin": ang.sin()}
            return kw, [randn(b, s, h, hd), randn(b, s, hk, hd)]
        add(Case("rope", f"b{b} s{s} h{h}/{hk} d{hd}", mk_rope),
            ours=_ours(K.rope), eager=rope_op.rope_reference, compile=compiled(rope_op.rope_reference),
            liger=(lambda q, k, cos, sin: _liger_rope(LF, q, k, cos, sin)) if LF else None)

    ce_shapes = [(d.tokens, d.hidden, d.vocab)]
    if not quick:
        ce_shapes.append((d.tokens, 2 * d.hidden, 128256 if dev == "cuda" else 2 * d.vocab))
    for amp in (False, True):
        for n, h, v in ce_shapes[: 1 if amp else None]:
            def mk_ce(n=n, h=h, v=v, amp=amp):
                w = randn(v, h, scale=1 / math.sqrt(h), dtype=torch.float32 if amp else bf16)
                t = torch.randint(0, v, (n,), device=dev)
                t[::97] = -100
                return {"x": _leaf(randn(n, h)), "weight": _leaf(w), "target": t}, []
            add(Case("flce(amp)" if amp else "flce", f"{n}x{h} V{v}", mk_ce, autocast=amp),
                ours=_ours(K.linear_cross_entropy),
                eager=cross_entropy_op.linear_cross_entropy_reference,
                compile=compiled(cross_entropy_op.linear_cross_entropy_reference),
                liger=(lambda x, weight, target: LF.liger_fused_linear_cross_entropy(x, weight, target))
                if LF else None)
            if not amp and not quick:
                cases[-1].variants["ours(vocab-parallel,world=1)"] = _vocab_parallel_world1(dev)
    return cases


# ----------------------------------------------------------------------------------------- running
def _outputs(out) -> list[torch.Tensor]:
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return [o for o in outs if isinstance(o, torch.Tensor)]


def _fwd_bwd(fn, kw, gos, autocast: bool, dev: str) -> None:
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
        outs = _outputs(fn(**kw))
    torch.autograd.backward(outs, gos or None)


def _fwd(fn, kw, autocast: bool, dev: str) -> None:
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
        fn(**kw)


def _bench(fn: Callable[[], None], leaves: list[torch.Tensor], quick: bool, dev: str) -> float:
    """Median milliseconds."""
    if dev == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, grad_to_none=leaves,
                              return_mode="median"))
    times = []
    for _ in range(3):
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def _peak_mib(fn: Callable[[], None], leaves: list[torch.Tensor], dev: str) -> float:
    if dev != "cuda":
        return float("nan")
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _leaves(kw: dict) -> list[torch.Tensor]:
    return [v for v in kw.values() if isinstance(v, torch.Tensor) and v.requires_grad]


def _time_variant(fn: Callable[..., object], case: Case, quick: bool, dev: str) -> dict:
    kw, gos = case.make()
    leaves = _leaves(kw)
    for _ in range(3 if dev == "cuda" else 1):  # compile / allocator warm-up
        _fwd_bwd(fn, kw, gos, case.autocast, dev)
    return {
        "fwd_bwd_ms": _bench(lambda: _fwd_bwd(fn, kw, gos, case.autocast, dev), leaves, quick, dev),
        "fwd_ms": _bench(lambda: _fwd(fn, kw, case.autocast, dev), leaves, quick, dev),
        "peak_mib": _peak_mib(lambda: _fwd_bwd(fn, kw, gos, case.autocast, dev), leaves, dev),
    }


def run_case(case: Case, quick: bool, dev: str) -> list[dict]:
    rows = []
    for name, fn in case.variants.items():
        row = {"op": case.op, "shape": case.shape, "variant": name}
        try:
            row.update(_time_variant(fn, case, quick, dev))
        except Exception as e:  # noqa: BLE001 - one failing variant must not stop the others
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()
        if dev == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
    ms = {r["variant"]: r.get("fwd_bwd_ms") for r in rows}
    for r in rows:
        for ref in ("eager", "compile", "liger"):
            if r.get("fwd_bwd_ms") and ms.get(ref):
                r[f"speedup_vs_{ref}"] = ms[ref] / r["fwd_bwd_ms"]
    return rows


def _max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def verify(case: Case, fp32: bool, dev: str) -> tuple[bool, str]:
    """Ours vs the eager reference: every output and input gradient, relative to the reference's max."""
    kw, gos = case.make()
    if fp32:
        kw = {k: (_leaf(v.float()) if v.requires_grad else v.float()) if v.is_floating_point() else v
              for k, v in kw.items()}
        gos = [g.float() for g in gos]
    leaves = [v for v in kw.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    results = []
    for name in ("ours", "eager"):
        for t in leaves:
            t.grad = None
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=case.autocast):
            outs = _outputs(case.variants[name](**kw))
        torch.autograd.backward(outs, gos or None)
        results.append([o.detach() for o in outs] + [t.grad for t in leaves])
    tol = 1e-4 if fp32 and not case.autocast else 3e-2
    errs = [_max_rel_err(a, b) for a, b in zip(*results)]
    ok = all(math.isfinite(e) and e <= tol for e in errs)
    return ok, f"max rel err {max(errs):.2e} (tol {tol:.0e})"


def print_table(rows: list[dict]) -> None:
    head = (f"{'op':13s} {'shape':22s} {'variant':29s} {'fwd ms':>8s} {'fwd+bwd ms':>10s} {'peak MiB':>9s} "
            f"{'x eager':>7s} {'x compile':>9s} {'x liger':>7s}")
    print(head)
    print("-" * len(head))
    last = None
    for r in rows:
        if last is not None and (r["op"], r["shape"]) != last:
            print()
        last = (r["op"], r["shape"])
        if "error" in r:
            print(f"{r['op']:13s} {r['shape']:22s} {r['variant']:29s} ERROR {r['error']}")
            continue

        def sp(k: str, r: dict = r) -> str:
            return f"{r[k]:.2f}x" if k in r else "-"
        print(f"{r['op']:13s} {r['shape']:22s} {r['variant']:29s} {r['fwd_ms']:8.3f} {r['fwd_bwd_ms']:10.3f} "
              f"{r['peak_mib']:9.1f} {sp('speedup_vs_eager'):>7s} {sp('speedup_vs_compile'):>9s} "
              f"{sp('speedup_vs_liger'):>7s}")


# ------------------------------------------------------------------------------------------ tuning
def tune(dims: Dims, dev: str, quick: bool) -> dict:
    """Sweep the kernels' launch knobs at the reference shape; keep (and return) the fastest of each."""
    from runtime.kernels import cross_entropy_op, layer_norm_op, rms_norm_op, swiglu_op

    # the last case of each op at the reference shape: for swiglu the model's packed [gate | up] layout
    cases = {c.op: c for c in build_cases(dims, dev, quick=True, with_compile=False)}
    best: dict[str, dict] = {}

    def timed(case: Case, fwd_only: bool) -> float:
        kw, gos = case.make()
        leaves = _leaves(kw)
        fn = case.variants["ours"]
        _fwd_bwd(fn, kw, gos, case.autocast, dev)
        if fwd_only:
            return _bench(lambda: _fwd(fn, kw, case.autocast, dev), leaves, quick, dev)
        return _bench(lambda: _fwd_bwd(fn, kw, gos, case.autocast, dev), leaves, quick, dev)

    def sweep(label: str, case: Case, setters: dict[str, Callable[[object], None]], grid: list[dict],
              fwd_only: bool = False) -> dict:
        results = []
        for point in grid:
            for k, v in point.items():
                setters[k](v)
            try:
                results.append((timed(case, fwd_only), point))
            except Exception as e:  # noqa: BLE001 - an invalid point is skipped
                print(f"  {label} {point}: {type(e).__name__}: {e}")
        ms, point = min(results, key=lambda r: r[0])
        for k, v in point.items():
            setters[k](v)
        print(f"  {label:28s} best {point} {ms:.3f} ms ({'fwd' if fwd_only else 'fwd+bwd'}; "
              f"worst {max(r[0] for r in results):.3f} ms over {len(results)} points)")
        return {**point, "ms": ms}

    for op, mod in (("rms_norm", rms_norm_op), ("layer_norm", layer_norm_op)):
        cfg = mod.CONFIG

        def setter(name, cfg=cfg):
            return lambda v: setattr(cfg, name, v)
        knobs = ("fwd_elems", "fwd_warps", "bwd_elems", "bwd_programs_per_sm", "bwd_warps")
        setters = {k: setter(k) for k in knobs}
        warps = (None, 4, 8, 16)
        fwd_grid = [{"fwd_elems": e, "fwd_warps": w} for e in (2048, 4096, 8192) for w in warps]
        best[op + " fwd"] = sweep(op + " fwd", cases[op], setters, fwd_grid, fwd_only=True)
        bwd_grid = [{"bwd_elems": e, "bwd_programs_per_sm": p, "bwd_warps": w}
                    for e in (2048, 4096, 8192) for p in (1, 2, 4) for w in warps]
        best[op + " bwd"] = sweep(op + " fwd+bwd", cases[op], setters, bwd_grid)
    sw_setters = {"BLOCK": lambda v: setattr(swiglu_op, "BLOCK", v),
                  "NUM_WARPS": lambda v: setattr(swiglu_op, "NUM_WARPS", v)}
    sw_grid = [{"BLOCK": b, "NUM_WARPS": w} for b in (1024, 2048, 4096) for w in (None, 4, 8, 16)]
    best["swiglu"] = sweep("swiglu fwd+bwd", cases["swiglu"], sw_setters, sw_grid)
    ce_setters = {"LOGITS_CHUNK_ELEMENTS": lambda v: setattr(cross_entropy_op, "LOGITS_CHUNK_ELEMENTS", v),
                  "MAX_BLOCK_V": lambda v: setattr(cross_entropy_op, "MAX_BLOCK_V", v)}
    best["flce"] = sweep("flce fwd+bwd", cases["flce"], ce_setters,
                         [{"LOGITS_CHUNK_ELEMENTS": 1 << c, "MAX_BLOCK_V": b} for c in (24, 25, 26, 27)
                          for b in (8192, 16384, 32768)])
    return best


def _version(dist_name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(dist_name)
    except Exception:  # noqa: BLE001
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Triton kernels vs torch eager, torch.compile and Liger-Kernel.")
    ap.add_argument("--quick", action="store_true", help="reference shapes only, fewer repetitions")
    ap.add_argument("--json", help="write checks and timings to this JSON file")
    ap.add_argument("--ops", help="subset of rms_norm,add_rms_norm,layer_norm,swiglu,rope,flce")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    ap.add_argument("--tune", action="store_true", help="first sweep our launch knobs and keep the fastest")
    ap.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes: tests the script")
    args = ap.parse_args(argv)

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        dev, dims, with_compile = "cpu", SMOKE_DIMS, False
    else:
        if not torch.cuda.is_available():
            print("benchmarks/kernels.py needs a CUDA GPU; none found, nothing to do (--smoke: CPU run).")
            return 0
        os.environ.pop("TRITON_INTERPRET", None)
        dev, dims, with_compile = "cuda", Dims(), not args.no_compile
    try:
        import triton
    except ImportError:
        print("benchmarks/kernels.py needs triton; it is not installed.")
        return 0
    # each shape compiles once; do not fall back to eager after a few recompiles (names differ across versions)
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)

    info = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)",
            "torch": torch.__version__, "triton": triton.__version__,
            "liger_kernel": _version("liger-kernel")}
    print(" | ".join(f"{k}: {v}" for k, v in info.items()))
    if dev == "cuda" and _liger() is None:
        print("(Liger-Kernel not importable: no liger column; `pip install liger-kernel` to compare)")

    tuned = None
    if args.tune:
        print("\n== tuning our launch knobs at the reference shape ==")
        tuned = tune(dims, dev, args.quick)

    cases = build_cases(dims, dev, args.quick, with_compile)
    order = {op: i for i, op in enumerate(dict.fromkeys(c.op for c in cases))}
    cases.sort(key=lambda c: order[c.op])  # stable: grouped by op, shapes in order
    if args.ops:
        wanted = set(args.ops.split(","))
        cases = [c for c in cases if c.op.split("(")[0] in wanted]

    print("\n== correctness: ours vs the torch reference (outputs and all gradients) ==")
    checks = []
    first_of_op: set[str] = set()
    for c in cases:  # every case in bf16 (or amp), the first shape of each op in fp32 too
        precisions = (False,) if c.autocast or c.op in first_of_op else (True, False)
        first_of_op.add(c.op)
        for fp32 in precisions:
            label = f"{c.op} {c.shape} {'fp32' if fp32 else 'bf16'}"
            try:
                ok, msg = verify(c, fp32, dev)
            except Exception as e:  # noqa: BLE001
                ok, msg = False, f"{type(e).__name__}: {e}"
            checks.append({"case": label, "ok": ok, "detail": msg})
            print(f"{'PASS' if ok else 'FAIL'}  {label:45s} {msg}")

    print("\n== median ms of forward and forward+backward; peak memory of one forward+backward ==")
    t0 = time.time()
    rows = [r for c in cases for r in run_case(c, args.quick, dev)]
    print_table(rows)
    print(f"\n({time.time() - t0:.0f}s; 'x liger' > 1.00: ours is faster; flce 'fwd' includes its gradients)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "tuned": tuned, "checks": checks, "results": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
