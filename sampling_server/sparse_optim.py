"""Sparse optimizers of trainable node tensors, applied on the server to exactly the rows
a step touched, as ``torch.optim.Adagrad`` and ``torch.optim.SparseAdam`` update an
``nn.Embedding(sparse=True)``: the same operations in the same order on the same rows,
so that training through the servers equals training a dense embedding in one process
to float rounding. The optimizer state (Adagrad's sum of squares, Adam's two moments)
is kept per row beside the rows; the step count is the tensor's.
"""

from __future__ import annotations

import math

import torch

from protos import sampling_pb2 as pb

#: The per-row state each optimizer keeps, by name.
STATE_NAMES: dict[int, tuple[str, ...]] = {
    pb.SparseOptimizer.OPTIMIZER_NONE: (),
    pb.SparseOptimizer.ADAGRAD: ("sum",),
    pb.SparseOptimizer.ADAM: ("exp_avg", "exp_avg_sq"),
}
#: Defaults filled in for fields left 0 (torch's): eps per optimizer, Adam's betas.
DEFAULT_EPS = {pb.SparseOptimizer.ADAGRAD: 1e-10, pb.SparseOptimizer.ADAM: 1e-8}
DEFAULT_BETAS = (0.9, 0.999)


def with_defaults(opt: pb.SparseOptimizer) -> pb.SparseOptimizer:
    """``opt`` with torch's defaults where a field is 0 (eps; Adam's betas)."""
    out = pb.SparseOptimizer()
    out.CopyFrom(opt)
    if out.kind in DEFAULT_EPS and out.eps == 0:
        out.eps = DEFAULT_EPS[out.kind]
    if out.kind == pb.SparseOptimizer.ADAM:
        out.beta1 = out.beta1 or DEFAULT_BETAS[0]
        out.beta2 = out.beta2 or DEFAULT_BETAS[1]
    return out


def check_optimizer(opt: pb.SparseOptimizer, field: str) -> None:
    """Raise ``ValueError`` naming the field of ``opt`` that is out of range."""
    if opt.kind not in STATE_NAMES:
        raise ValueError(f"{field}.kind: expected OPTIMIZER_NONE, ADAGRAD or ADAM, got {opt.kind}")
    if opt.kind == pb.SparseOptimizer.OPTIMIZER_NONE:
        return
    checks = [("lr", opt.lr, opt.lr > 0), ("eps", opt.eps, opt.eps > 0),
              ("lr_decay", opt.lr_decay, opt.lr_decay >= 0),
              ("initial_accumulator_value", opt.initial_accumulator_value,
               opt.initial_accumulator_value >= 0)]
    if opt.kind == pb.SparseOptimizer.ADAM:
        checks += [("beta1", opt.beta1, 0 <= opt.beta1 < 1), ("beta2", opt.beta2, 0 <= opt.beta2 < 1)]
    for name, value, ok in checks:
        if not (ok and math.isfinite(value)):
            raise ValueError(f"{field}.{name}: expected a finite value in range, got {value}")


def new_state(opt: pb.SparseOptimizer, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The optimizer state of a table of ``shape`` (float32)."""
    fill = opt.initial_accumulator_value if opt.kind == pb.SparseOptimizer.ADAGRAD else 0.0
    return {name: torch.full(shape, fill, dtype=torch.float32) for name in STATE_NAMES[opt.kind]}


def apply(opt: pb.SparseOptimizer, rows: torch.Tensor, state: dict[str, torch.Tensor], step: int,
          index: torch.Tensor, grad: torch.Tensor) -> None:
    """Optimizer step ``step`` (1, 2, ...) of the rows ``index`` (int64, distinct) of
    ``rows`` with gradient ``grad`` (``[len(index), *dims]``), in place."""
    if opt.kind == pb.SparseOptimizer.ADAGRAD:
        _adagrad(opt, rows, state["sum"], step, index, grad)
    elif opt.kind == pb.SparseOptimizer.ADAM:
        _adam(opt, rows, state["exp_avg"], state["exp_avg_sq"], step, index, grad)


def _adagrad(opt: pb.SparseOptimizer, rows: torch.Tensor, state_sum: torch.Tensor, step: int,
             index: torch.Tensor, grad: torch.Tensor) -> None:
    clr = opt.lr / (1 + (step - 1) * opt.lr_decay)
    if index.numel() == 0:
        return
    state_sum.index_add_(0, index, grad.pow(2))
    std_values = state_sum.index_select(0, index).sqrt_().add_(opt.eps)
    rows.index_add_(0, index, grad / std_values, alpha=-clr)


def _adam(opt: pb.SparseOptimizer, rows: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
          step: int, index: torch.Tensor, grad: torch.Tensor) -> None:
    if index.numel() == 0:
        return
    beta1, beta2 = opt.beta1, opt.beta2
    old_exp_avg_values = exp_avg.index_select(0, index)
    exp_avg_update_values = grad.sub(old_exp_avg_values).mul_(1 - beta1)
    exp_avg.index_add_(0, index, exp_avg_update_values)
    old_exp_avg_sq_values = exp_avg_sq.index_select(0, index)
    exp_avg_sq_update_values = grad.pow(2).sub_(old_exp_avg_sq_values).mul_(1 - beta2)
    exp_avg_sq.index_add_(0, index, exp_avg_sq_update_values)
    numer = exp_avg_update_values.add_(old_exp_avg_values)
    exp_avg_sq_update_values.add_(old_exp_avg_sq_values)
    denom = exp_avg_sq_update_values.sqrt_().add_(opt.eps)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = opt.lr * math.sqrt(bias_correction2) / bias_correction1
    rows.index_add_(0, index, -step_size * numer.div_(denom))
