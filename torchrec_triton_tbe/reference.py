"""Pure-PyTorch reference of the module: per-feature gather + pooling (fp64), autograd for the
gradients, and the fused optimizers written out. The test oracle wherever FBGEMM's CPU TBE lacks a
combination (bf16 weights or outputs), and a readable statement of the semantics.

Semantics (FBGEMM's): bag (t, b) = ids[offsets[t*B+b] : offsets[t*B+b+1]] of table feature_table_map[t];
SUM pools sum_i psw_i * W[id_i]; MEAN divides that by the bag length; an empty bag pools to zero and
passes no gradient. EXACT_SGD: w -= lr * g; EXACT_ROWWISE_ADAGRAD: m += mean(g^2), w -= lr * g /
(sqrt(m) + eps); g is the row's gradient summed over every lookup of the batch (one step per row).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from torchrec_triton_tbe.ops.spec import Optim


def pooled_lookup(
    tables: Sequence[torch.Tensor],
    feature_table_map: Sequence[int],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    mean: bool,
    per_sample_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Differentiable pooled lookup in the tables' dtype ([B, sum D_t])."""
    T = len(feature_table_map)
    B = (offsets.numel() - 1) // T
    offsets = offsets.long()
    outs = []
    for t, k in enumerate(feature_table_map):
        w = tables[k]
        bag_off = offsets[t * B : (t + 1) * B + 1]
        lengths = bag_off[1:] - bag_off[:-1]
        lo, hi = int(bag_off[0]), int(bag_off[-1])
        ids = indices[lo:hi].long()
        rows = w.index_select(0, ids)
        if per_sample_weights is not None:
            rows = rows * per_sample_weights[lo:hi].to(w.dtype)[:, None]
        bag_of = torch.repeat_interleave(torch.arange(B, device=w.device), lengths)
        out = torch.zeros(B, w.shape[1], dtype=w.dtype, device=w.device).index_add(0, bag_of, rows)
        if mean:
            out = out / lengths.clamp(min=1).to(w.dtype)[:, None]
        outs.append(out)
    return torch.cat(outs, dim=1)


class ReferenceTBE:
    """Reference training state: fp64 master copies of the tables for the math, stored back into the
    tables' dtype after every step with round-to-nearest (compare to stochastic_rounding=False)."""

    def __init__(
        self,
        tables: Sequence[torch.Tensor],
        feature_table_map: Sequence[int],
        mean: bool,
        optimizer: Optim,
        learning_rate: float,
        eps: float,
        output_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.tables = [t.detach().clone() for t in tables]
        self.momentum = [torch.zeros(t.shape[0], dtype=torch.float32, device=t.device) for t in tables]
        self.feature_table_map = list(feature_table_map)
        self.mean = mean
        self.optimizer = Optim(optimizer)
        self.lr = learning_rate
        self.eps = eps
        self.output_dtype = output_dtype
        self._leaves: list[torch.Tensor] = []

    def forward(self, indices, offsets, per_sample_weights=None) -> torch.Tensor:
        self._leaves = [t.double().requires_grad_(True) for t in self.tables]
        psw = None if per_sample_weights is None else per_sample_weights.double()
        out = pooled_lookup(self._leaves, self.feature_table_map, indices, offsets, self.mean, psw)
        return out

    def output(self, out64: torch.Tensor) -> torch.Tensor:
        return out64.to(self.output_dtype)

    def step(self) -> None:
        """Apply the optimizer with the gradients of the last forward's backward."""
        for k, leaf in enumerate(self._leaves):
            if leaf.grad is None:
                continue
            g = leaf.grad.float()
            w = self.tables[k].float()
            if self.optimizer == Optim.EXACT_ROWWISE_ADAGRAD:
                # Untouched rows have g == 0: m and w stay as they are, as with a sparse update.
                m = self.momentum[k] + (g * g).mean(1)
                self.momentum[k] = m
                w = w - (self.lr / (m.sqrt() + self.eps))[:, None] * g
            else:
                w = w - self.lr * g
            self.tables[k] = w.to(self.tables[k].dtype)
        self._leaves = []

    def psw_grad(self, indices, offsets, per_sample_weights, grad_out) -> torch.Tensor:
        """d(out . grad_out) / d psw, with the current tables."""
        psw = per_sample_weights.double().detach().requires_grad_(True)
        tables = [t.double() for t in self.tables]
        out = pooled_lookup(tables, self.feature_table_map, indices, offsets, self.mean, psw)
        (g,) = torch.autograd.grad(out, psw, grad_out.double())
        return g
