"""Context parallelism (cp > 1): what the runtime executes is the single-process model, and what the cost model
prices.

* the zig-zag split: every position on exactly one rank, every rank the same causal work;
* the attention blocks (all-gathered K/V, log-sum-exp merge) against torch's causal attention, fused and plain;
* numerical equivalence with the single-process reference (gradients after step 1, losses over 3 steps, 1e-5) for
  cp = 2 and 4 with tp (+sp), pp, dp (ZeRO 0/1), recompute, tied embeddings, Llama (GQA) and GPT (flash);
* activation memory: a rank at cp = 4 keeps the share of a cp = 1 rank's activations that the cost model's
  activation term says (``cost_models.memory.layer_activation_bytes``), measured with saved-tensor hooks.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from cost_models.memory import layer_activation_bytes
from runtime.parallel.context_parallel import (
    FlashCPUBlocks,
    FlashCUDABlocks,
    MathBlocks,
    block_kernel,
    blocks_backward,
    blocks_forward,
    local_chunks,
    local_positions,
)
from specs.errors import AutoparError
from specs.model import ModelSpec

# ---- single process ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_split_covers_the_sequence_and_balances_causal_work(cp):
    seq = 32
    parts = [local_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(parts).tolist()) == list(range(seq))
    work = {int((p + 1).sum()) for p in parts}  # keys each rank's queries attend to
    assert len(work) == 1
    assert local_positions(seq, 2, 1).tolist() == [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    with pytest.raises(AutoparError, match="divisible by 2\\*cp"):
        local_positions(20, 4, 0)


@pytest.mark.parametrize("impl", [FlashCPUBlocks, MathBlocks], ids=["flash-cpu", "math"])
@pytest.mark.parametrize("cp,heads,kv", [(2, 4, 4), (4, 4, 2), (3, 6, 2)])
def test_blocks_are_causal_attention_over_the_whole_sequence(impl, cp, heads, kv):
    """Each rank's blocks over the full K/V (as the all-gather leaves them) give its rows of causal attention, and
    their gradients summed over the ranks are the full attention's."""
    torch.manual_seed(0)
    b, s, d = 2, 8 * cp, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64, requires_grad=True) for n in (heads, kv, kv))
    g = heads // kv
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
    do = torch.randn_like(want)
    want.backward(do)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kf, vf = k.detach().float(), v.detach().float()
    for r in range(cp):
        pos = local_positions(s, cp, r)
        ql = q.detach().float()[:, :, pos]
        o, lse = blocks_forward(impl, ql, kf, vf, local_chunks(cp, r), 1 / math.sqrt(d))
        assert torch.allclose(o.double(), want.detach()[:, :, pos], atol=1e-5)
        a, bk, c = blocks_backward(impl, do[:, :, pos].float(), ql, kf, vf, o, lse, local_chunks(cp, r),
                                   1 / math.sqrt(d))
        dq[:, :, pos] += a.double()
        dk += bk.double()
        dv += c.double()
    for got, ref in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert torch.allclose(got, ref, atol=1e-5)


def test_cuda_flash_blocks_take_grouped_kv_and_run_where_they_should():
    """CUDA's flash kernel (numerics: tests/runtime/gpu_smoke.py on a GPU) has meta kernels: on the meta device the
    blocks give the shapes and dtypes the math blocks give, grouped K/V gradients summed back to their heads; the
    kernel is chosen by device and dtype."""
    b, s, cp, heads, kv, d = 1, 64, 2, 8, 2, 16
    q = torch.empty(b, heads, s // cp, d, device="meta", dtype=torch.bfloat16)
    k, v = (torch.empty(b, kv, s, d, device="meta", dtype=torch.bfloat16) for _ in range(2))
    o, lse = blocks_forward(FlashCUDABlocks, q, k, v, local_chunks(cp, 0), 0.25)
    assert (o.shape, o.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (b, heads, s // cp), torch.float32)
    grads = blocks_backward(FlashCUDABlocks, o, q, k, v, o, lse, local_chunks(cp, 0), 0.25)
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in (q, k, v)]
    assert block_kernel(q) is FlashCUDABlocks and block_kernel(q.float()) is MathBlocks
    assert block_kernel(torch.empty(1, 1, 1, 512, device="meta", dtype=torch.bfloat16)) is MathBlocks  # head dim
    assert block_kernel(torch.empty(1, 1, 1, 8)) is FlashCPUBlocks


def test_data_positions_take_a_ranks_tokens_and_targets(tmp_path):
    import numpy as np

    from runtime.data import TokenData

    path = tmp_path / "t.u16"
    np.random.default_rng(0).integers(0, 100, 5000).astype(np.uint16).tofile(path)
    data = TokenData(path, seq=16, vocab_size=100, seed=3)
    inp, tgt = data.batch(2, 8, 1, 2)
    parts = [data.batch(2, 8, 1, 2, local_positions(16, 4, r)) for r in range(4)]
    got_in, got_tgt = torch.zeros_like(inp), torch.zeros_like(tgt)
    for r, (i, t) in enumerate(parts):
        assert i.shape == (4, 4)
        got_in[:, local_positions(16, 4, r)], got_tgt[:, local_positions(16, 4, r)] = i, t
    assert torch.equal(got_in, inp) and torch.equal(got_tgt, tgt)


# ---- multi-rank: the single-process model --------------------------------------------------------------------

# ---- multi-rank: activation memory is the cost model's ---------------------------------------------------------

MEM_SPEC = ModelSpec(name="tiny-llama-4k", arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                     num_kv_heads=2, ffn_hidden_size=128, vocab_size=64, seq_length=4096)


def test_activation_bytes_per_rank_follow_the_cost_model(pool):
    """A seq-4096 two-layer Llama (GQA) at cp = 4 keeps 1/4 of what one rank keeps at cp = 1, as priced (5%).

    bf16, so that the cp = 1 attention keeps GQA-sized K and V as the context-parallel one does (in fp32 the runtime's
    CoreAttention repeats them across the query heads before torch's attention and keeps the copies). Measured:
    0.2500 of the cp = 1 bytes on every rank."""
    one = pool.run("rt_cases:cp_activation_bytes", 1, MEM_SPEC.model_dump_json(), "bfloat16")[0]
    four = [r for r in pool.run("rt_cases:cp_activation_bytes", 4, MEM_SPEC.model_dump_json(), "bfloat16")
            if r is not None]
    assert one["tokens"] == 4096 and [r["tokens"] for r in four] == [1024] * 4
    priced = [float(layer_activation_bytes(MEM_SPEC, 2, 1, cp, 1, False, 0)[0]) for cp in (1, 4)]
    for r in four:
        measured = r["bytes"] / one["bytes"]
        assert measured == pytest.approx(priced[1] / priced[0], rel=0.05), (measured, priced, r, one)
