"""How training keeps its model state: the precisions of parameters, gradients and the optimizer's master copy,
and the size of the data-parallel gradient buckets.

Both halves read these from the plan file (its ``state`` section): the cost model prices exactly these bytes
and buckets, and the runtime allocates exactly these buffers. The defaults follow the plan's compute
precision (Megatron-LM's mixed precision):

=========  ==========  =========  =========  ===============  ====================================
precision  parameters  gradients  reduced    master weights   bytes per parameter (+ Adam m, v: 8)
=========  ==========  =========  =========  ===============  ====================================
bf16       bf16        fp32       in fp32    fp32             2 + 4 + 4 + 8 = 18
fp16       fp16        fp32       in fp16    fp32             2 + 4 + 4 + 8 = 18
fp32       fp32        fp32       in fp32    (the weights)    4 + 4 + 8 = 16
=========  ==========  =========  =========  ===============  ====================================
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

Dtype = Literal["fp32", "bf16", "fp16"]
# The GEMMs a tensor-parallel overlap runs beside a collective, by pass (Transformer Engine's userbuffer names):
# the forward (fprop) and input-gradient (dgrad) GEMMs of the QKV, attention-output and two MLP projections.
OverlapGemm = Literal["qkv_fprop", "proj_fprop", "fc1_fprop", "fc2_fprop", "qkv_dgrad", "proj_dgrad", "fc1_dgrad",
                      "fc2_dgrad"]
ForwardGemm = Literal["qkv_fprop", "proj_fprop", "fc1_fprop", "fc2_fprop"]
PRECISIONS = {"fp32": (4, "float32"), "bf16": (2, "bfloat16"), "fp16": (2, "float16")}  # bytes, torch's dtype name
DTYPE_BYTES = {k: nbytes for k, (nbytes, _) in PRECISIONS.items()}
TORCH_NAMES = {k: name for k, (_, name) in PRECISIONS.items()}  # torch.float32 ..., less "torch."
BUCKET_PARAMS = 40_000_000  # gradient bucket of the data-parallel reduce, in parameters (Megatron's default)


def bucket_count(params: Any, bucket_params: int) -> Any:
    """How many data-parallel gradient buckets a reduce group of ``params`` parameters is cut into (an int, or an
    array of groups): ceil(params / bucket_params), equal buckets of at most ``bucket_params`` each. The cost model
    prices that many reduces and the runtime allocates that many buckets."""
    return -(-params // bucket_params)
LOGITS_CHUNK_ELEMENTS = 1 << 26  # the fused loss's logits chunk (tokens x vocab shard): 128 MiB in bf16
LOSS_BLOCK_V = 32768  # the widest vocab row the fused loss holds in registers at once: a wider row is read twice


def fused_loss_rows(tokens: Any, vocab_shard: Any, elements: int = LOGITS_CHUNK_ELEMENTS) -> Any:
    """Rows of logits autopar's fused loss holds at once for ``tokens`` tokens over a ``vocab_shard``-wide vocabulary
    (numpy-broadcast): balanced chunks of at most ``elements`` / vocab_shard rows, rounded up to 64 (cuBLAS-friendly).
    The kernel (runtime/kernels/cross_entropy_op.py) chunks by it and the cost model prices it."""
    tokens = np.asarray(tokens, dtype=float)
    budget = np.maximum(1.0, np.floor(elements / np.maximum(1.0, vocab_shard)))
    chunks = np.ceil(tokens / budget)
    rows = np.ceil(np.ceil(tokens / np.maximum(1.0, chunks)) / 64) * 64
    return np.maximum(1.0, np.minimum(tokens, rows))


class StateSpec(BaseModel):
    """The model state's precisions and the data-parallel gradient bucket size (a plan file's ``state``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    params: Dtype  # the weights the forward and backward use
    grads: Dtype  # the gradient buffer, accumulated over micro-batches
    grad_reduce: Dtype  # the precision of the data-parallel gradient reduce
    master_weights: StrictBool  # an fp32 copy the optimizer updates (needed when params are 16-bit)
    bucket_params: StrictInt = Field(BUCKET_PARAMS, ge=1)
    # the weight-gradient GEMMs add into the gradient buffer themselves (Megatron-LM's
    # --gradient-accumulation-fusion); autopar's runtime adds each micro-batch's gradients in a pass of its own
    fused_accumulation: StrictBool = False
    # the loss materialises the whole [tokens, vocab] logits and an fp32 copy (Megatron-LM); autopar's fused linear
    # cross-entropy computes them LOGITS_CHUNK_ELEMENTS at a time, its gradients in the forward
    full_logits: StrictBool = False
    # with full_logits: Megatron-Core's cross_entropy_loss_fusion, the loss's elementwise steps compiled into three
    # kernels forward and one backward instead of a kernel per torch op (cost_models/layer.py ``loss_traffic``)
    loss_fusion: StrictBool = False
    # how many pieces a stack's tp overlap runs each of those GEMMs in (e.g. Transformer Engine: a pipelined
    # reduce-scatter in num_splits pieces, a bulk overlap beside one whole GEMM); a GEMM not named runs in tp
    # pieces, as autopar's collective matmul runs every one (runtime/parallel/collective_matmul.py)
    overlap_pieces: tuple[tuple[OverlapGemm, Annotated[StrictInt, Field(ge=1)]], ...] = ()
    # how many SMs a stack's tp overlap takes from the forward GEMM it hides a collective behind, which then runs on
    # the rest, at least one (Transformer Engine's num_sm with set_sm_margin, its pipelined reduce-scatter's
    # setting); autopar's collective matmul reserves none
    sm_margin: tuple[tuple[ForwardGemm, Annotated[StrictInt, Field(ge=1)]], ...] = ()
    # ZeRO-1/2 all-gather the updated parameters right after the optimizer step, exposed even with dp_overlap
    # (nanotron's ZeroDistributedOptimizer; Megatron-LM without --overlap-param-gather); autopar's runtime hides
    # that gather behind the next step's first forwards
    param_gather_after_step: StrictBool = False

    @field_validator("overlap_pieces", "sm_margin")
    @classmethod
    def _once_each(cls, v: tuple[tuple[str, int], ...], info: ValidationInfo) -> tuple[tuple[str, int], ...]:
        names = [g for g, _ in v]
        if len(set(names)) != len(names):
            raise ValueError(f"{info.field_name} names a GEMM twice: {names}; give each at most once")
        return v

    @model_validator(mode="after")
    def _fusion_needs_logits(self) -> StateSpec:
        if self.loss_fusion and not self.full_logits:
            raise ValueError("loss_fusion=true describes a loss over the whole logits; set full_logits=true with it, "
                             "or leave loss_fusion out (autopar's fused loss is chunked)")
        return self

    @classmethod
    def default(cls, precision: str) -> StateSpec:
        """Megatron-LM's choice for a compute precision (the table above)."""
        if precision == "fp32":
            return cls(params="fp32", grads="fp32", grad_reduce="fp32", master_weights=False)
        return cls(params=precision, grads="fp32", grad_reduce="fp32" if precision == "bf16" else "fp16",
                   master_weights=True)

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.params]

    @property
    def grad_bytes(self) -> int:
        return DTYPE_BYTES[self.grads]

    @property
    def grad_reduce_bytes(self) -> int:
        return DTYPE_BYTES[self.grad_reduce]

    @property
    def optimizer_bytes(self) -> int:
        """Optimizer state per parameter: Adam's fp32 moments, plus the fp32 master copy when kept."""
        return 8 + (4 if self.master_weights else 0)

    @property
    def adamw_bytes(self) -> int:
        """Bytes per parameter the fused AdamW kernel moves: it reads the gradient, the fp32 weights (master or
        parameters) and both moments, and writes those three back (28 with fp32 gradients)."""
        return self.grad_bytes + 2 * (4 + 8)

    @property
    def master_copy_bytes(self) -> int:
        """Bytes per parameter of the step's write-back from an fp32 master copy (read it, write the parameters);
        none without one."""
        return 4 + self.param_bytes if self.master_weights else 0

    @property
    def accumulate_bytes(self) -> int:
        """Bytes per parameter one micro-batch's gradient accumulation moves beyond a plain weight-gradient GEMM: the
        backward's gradient (parameter precision) is read and added into the buffer (read and written) in a pass of
        its own; or, when the GEMMs accumulate themselves (``fused_accumulation``: C += A^T B), their epilogue reads
        the buffer and writes it back in its precision in place of a parameter-precision output."""
        if self.fused_accumulation:
            return 2 * self.grad_bytes - self.param_bytes
        return self.param_bytes + 2 * self.grad_bytes
