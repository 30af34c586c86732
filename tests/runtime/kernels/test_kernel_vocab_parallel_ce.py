"""Vocab-parallel fused linear + CE on 2 gloo ranks vs the single-device version (Triton interpreter).

Two processes are spawned once for the module; each runs every case, with the kernel and with the torch
reference, and saves its results; the tests then compare them with the single-device reference here.
"""

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kernel_testutils import assert_close, needs_triton

from runtime.kernels import cross_entropy_op as CE

pytestmark = needs_triton

WORLD = 2
# name: (tokens, hidden, vocab, shard sizes, n_ignored, dtype, chunk_tokens, max_block_v)
CASES = {
    "fp32": ((29,), 40, 250, (125, 125), 4, torch.float32, None, None),
    "fp32_uneven_chunks_blocks": ((3, 11), 24, 251, (131, 120), 6, torch.float32, 8, 64),
    "bf16": ((37,), 32, 200, (100, 100), 3, torch.bfloat16, 16, None),
}


def _case_inputs(name):
    lead, hidden, vocab, shards, n_ignored, dtype, _, _ = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(*lead, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / math.sqrt(hidden) * 3).to(dtype)
    t = torch.randint(0, vocab, lead, generator=g)
    t.view(-1)[1:1 + n_ignored] = -100
    return x, w, t, shards


def _worker(rank, init_file, out_dir):
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        import runtime.kernels as K

        results = {}
        for name, (*_, chunk, max_block) in CASES.items():
            x, w, t, shards = _case_inputs(name)
            start = sum(shards[:rank])
            w_shard = w[start:start + shards[rank]]
            if max_block is not None:
                CE.MAX_BLOCK_V = max_block
            for impl in ("triton", "torch"):
                K.set_backend(impl)
                xl, wl = x.clone().requires_grad_(), w_shard.clone().requires_grad_()
                if impl == "triton" and chunk is not None:
                    loss = CE.vocab_parallel_linear_cross_entropy_triton(xl, wl, t, start, dist.group.WORLD,
                                                                         chunk_tokens=chunk)
                else:
                    loss = K.vocab_parallel_linear_cross_entropy(xl, wl, t, start, dist.group.WORLD)
                (2.0 * loss).backward()
                gx = xl.grad.clone()
                dist.all_reduce(gx)  # the caller's TP all-reduce of the partial x gradient
                results[(name, impl)] = (loss.detach(), gx, wl.grad)
            CE.MAX_BLOCK_V = CE.LOSS_BLOCK_V  # as priced
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results():
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        prev = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"  # inherited by the spawned ranks
        try:
            mp.spawn(_worker, args=(init_file, d), nprocs=WORLD, join=True)
        finally:
            if prev is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = prev
        yield [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("name", list(CASES))
def test_vocab_parallel_matches_single_device(tp_results, name, impl):
    x, w, t, shards = _case_inputs(name)
    dtype = CASES[name][5]
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    (2.0 * CE.linear_cross_entropy_reference(xl, wl, t)).backward()
    for rank in range(WORLD):
        loss, gx, gw_shard = tp_results[rank][(name, impl)]
        start = sum(shards[:rank])
        assert_close(loss, CE.linear_cross_entropy_reference(x, w, t), dtype, factor=0.1, what="loss")
        assert_close(gx, xl.grad, dtype, what="summed dx")
        assert gw_shard.dtype == dtype
        assert_close(gw_shard, wl.grad[start:start + shards[rank]], dtype, what="dweight shard")
