"""Pure-PyTorch reference of the module: per-feature gather + pooling (fp64), autograd for the
gradients, and every fused optimizer written out. The test oracle wherever FBGEMM's CPU TBE lacks a
combination (bf16, and every optimizer but EXACT_SGD / EXACT_ADAGRAD / EXACT_ROWWISE_ADAGRAD), and a
readable statement of the semantics.

Semantics (FBGEMM's): bag (t, b) = ids[offsets[t*B+b] : offsets[t*B+b+1]] of table feature_table_map[t];
SUM pools sum_i psw_i * W[id_i]; MEAN divides that by the bag length; an empty bag pools to zero and
passes no gradient. NONE (sequence) does not pool: output row p is W[id_p] of its feature's table,
[N, D], and row p's gradient goes to that row alone. A variable batch per feature (VBE) pools each
feature's own bags and lays the output out rank-major (vbe_lookup). Training applies one optimizer step to every row the batch looked up, with g the
row's gradient summed over every lookup of the batch (FBGEMM's "EXACT" optimizers); rows not looked
up keep their weights and state. The update rules below follow fbgemm_gpu/codegen/genscript/
optimizers.py line by line (fp32 arithmetic; t is the step count, from 1):

* EXACT_SGD: w -= lr * g
* EXACT_ADAGRAD: m += g^2; w -= lr * g / (sqrt(m) + eps)            (element-wise m)
* EXACT_ROWWISE_ADAGRAD: m += mean((g + [L2] wd * w)^2); mult = lr / (sqrt(m) + eps);
  w = c * w - mult * g, c = 1 - mult * wd (L2), 1 - lr * wd (DECOUPLE), 1 (NONE); then, with
  max_norm > 0, rows whose stored norm exceeds max_norm are scaled to it
* ADAM: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
  w -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd * w)   (t per row with
  row-wise bias correction: that row's own update count)
* PARTIAL_ROWWISE_ADAM: as ADAM with v per row, fed by mean(g^2)
* LAMB: r = m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd * w; w -= lr * ||w|| / ||r|| * r
* PARTIAL_ROWWISE_LAMB: as LAMB with v per row (mean(g^2)) and r = m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
* LARS_SGD: lr' = lr * eta * ||w|| / (||g|| + wd * ||w||); m = momentum * m + lr' * (g + wd * w); w -= m

Where FBGEMM's LAMB / LARS formulas divide zero by zero (a zero step, or a zero row with a zero
gradient) FBGEMM writes NaN; this reference and the kernels leave such a row as it is. With
``gradient_clipping`` the output gradient is clamped to [-max_gradient, max_gradient] first.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from torchrec_triton_tbe.ops.spec import Optim, OptimizerSpec, WeightDecay


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


def vbe_lookup(
    tables: Sequence[torch.Tensor],
    feature_table_map: Sequence[int],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    batch_size_per_feature_per_rank: Sequence[Sequence[int]],
    mean: bool,
    per_sample_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Variable batch per feature (FBGEMM's VBE): feature t has sum_r B_tr bags (offsets feature-major,
    each feature's bags rank by rank); the output is 1-D, rank-major: for each rank r, for each feature
    t, its [B_tr, D_t] block."""
    sizes = [list(row) for row in batch_size_per_feature_per_rank]
    offsets = offsets.long()
    blocks = {}
    begin = 0
    for t, k in enumerate(feature_table_map):
        n = sum(sizes[t])
        bag_off = offsets[begin : begin + n + 1]
        pooled = pooled_lookup([tables[k]], [0], indices, bag_off, mean, per_sample_weights)
        start = 0
        for r, count in enumerate(sizes[t]):
            blocks[r, t] = pooled[start : start + count].reshape(-1)
            start += count
        begin += n
    ranks = len(sizes[0]) if sizes else 0
    return torch.cat([blocks[r, t] for r in range(ranks) for t in range(len(feature_table_map))])


def sequence_lookup(
    tables: Sequence[torch.Tensor],
    feature_table_map: Sequence[int],
    indices: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """PoolingMode.NONE: [N, D], row p = the row lookup p names (zero for lookups outside every bag)."""
    T = len(feature_table_map)
    B = (offsets.numel() - 1) // T
    offsets = offsets.long()
    D = tables[0].shape[1]
    like = dict(dtype=tables[0].dtype, device=tables[0].device)
    pieces = [torch.zeros(int(offsets[0]), D, **like)]
    for t, k in enumerate(feature_table_map):
        lo, hi = int(offsets[t * B]), int(offsets[(t + 1) * B])
        pieces.append(tables[k].index_select(0, indices[lo:hi].long()))
    pieces.append(torch.zeros(indices.numel() - int(offsets[-1]), D, **like))
    return torch.cat(pieces)


def _row_norm(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).sum(1).sqrt()


def _bias_correction(beta: float, t: torch.Tensor) -> torch.Tensor:
    return (1.0 - torch.tensor(beta, dtype=torch.float64) ** t.double()).float()


class ReferenceTBE:
    """Reference training state: the tables and fp32 optimizer state, updated in fp32 and stored
    back into their dtypes with round-to-nearest (compare to stochastic_rounding=False)."""

    def __init__(
        self,
        tables: Sequence[torch.Tensor],
        feature_table_map: Sequence[int],
        mean: bool,
        optimizer: Union[Optim, OptimizerSpec],
        learning_rate: float,
        eps: float,
        output_dtype: torch.dtype = torch.float32,
        beta1: float = 0.9,
        beta2: float = 0.999,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        momentum: float = 0.9,
        max_norm: float = 0.0,
        nobag: bool = False,
    ) -> None:
        self.spec = optimizer if isinstance(optimizer, OptimizerSpec) else OptimizerSpec(optim=Optim(optimizer))
        self.optimizer = self.spec.optim
        self.tables = [t.detach().clone() for t in tables]
        # The optimizer's state per table, in FBGEMM's split_optimizer_states order and dtypes.
        self.states = [
            [torch.zeros(t.shape[0] if s.rowwise else t.shape, dtype=s.dtype, device=t.device) for s in self.spec.states]
            for t in self.tables
        ]
        self.feature_table_map = list(feature_table_map)
        self.mean = mean
        self.nobag = nobag  # PoolingMode.NONE (sequence_lookup)
        self.lr = learning_rate
        self.eps = eps
        self.beta1, self.beta2, self.weight_decay = beta1, beta2, weight_decay
        self.eta, self.momentum_coef, self.max_norm = eta, momentum, max_norm
        self.output_dtype = output_dtype
        self.step_count = 0
        self._leaves: list[torch.Tensor] = []
        self._touched: list[torch.Tensor] = []

    @property
    def momentum(self) -> list[torch.Tensor]:
        """The first state tensor per table (row-wise Adagrad's sum, ...), [] per table without state."""
        return [s[0] for s in self.states] if self.spec.states else []

    def forward(self, indices, offsets, per_sample_weights=None, batch_size_per_feature_per_rank=None) -> torch.Tensor:
        self._leaves = [t.double().requires_grad_(True) for t in self.tables]
        if batch_size_per_feature_per_rank is not None:
            self._touched = self._rows_looked_up(indices, offsets, [sum(r) for r in batch_size_per_feature_per_rank])
            psw = None if per_sample_weights is None else per_sample_weights.double()
            return vbe_lookup(self._leaves, self.feature_table_map, indices, offsets,
                              batch_size_per_feature_per_rank, self.mean, psw)
        self._touched = self._rows_looked_up(indices, offsets)
        if self.nobag:
            return sequence_lookup(self._leaves, self.feature_table_map, indices, offsets)
        psw = None if per_sample_weights is None else per_sample_weights.double()
        out = pooled_lookup(self._leaves, self.feature_table_map, indices, offsets, self.mean, psw)
        return out

    def _rows_looked_up(self, indices, offsets, bags_per_feature=None) -> list[torch.Tensor]:
        T = len(self.feature_table_map)
        if bags_per_feature is None:
            bags_per_feature = [(offsets.numel() - 1) // T] * T
        touched = [torch.zeros(t.shape[0], dtype=torch.bool) for t in self.tables]
        begin = 0
        for t, k in enumerate(self.feature_table_map):
            lo, hi = int(offsets[begin]), int(offsets[begin + bags_per_feature[t]])
            touched[k][indices[lo:hi].long()] = True
            begin += bags_per_feature[t]
        return touched

    def output(self, out64: torch.Tensor) -> torch.Tensor:
        return out64.to(self.output_dtype)

    def backward(self, out64: torch.Tensor, grad_out: torch.Tensor) -> None:
        """out64.backward with FBGEMM's gradient clipping applied to grad_out first."""
        if self.spec.gradient_clipping:
            grad_out = grad_out.clamp(-self.spec.max_gradient, self.spec.max_gradient)
        out64.backward(grad_out.double())

    def step(self) -> None:
        """Apply the optimizer with the gradients of the last forward's backward."""
        self.step_count += 1
        for k, leaf in enumerate(self._leaves):
            rows = self._touched[k].nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            g = (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))[rows].float()
            w = self.tables[k][rows].float()
            state = [s[rows].float() for s in self.states[k]]
            w, state = self._update(w, g, state)
            self.tables[k][rows] = w.to(self.tables[k].dtype)
            for s, new in zip(self.states[k], state):
                s[rows] = new.to(s.dtype)
        self._leaves = []

    def _update(self, w: torch.Tensor, g: torch.Tensor, state: list[torch.Tensor]):
        """One step for rows w with gradients g (fp32, [R, D]) and their state; returns both new."""
        o, lr, eps, wd = self.optimizer, self.lr, self.eps, self.weight_decay
        D = w.shape[1]
        if o == Optim.EXACT_SGD:
            return w - lr * g, state
        if o == Optim.EXACT_ADAGRAD:
            m = state[0] + g * g
            return w - lr * g / (m.sqrt() + eps), [m]
        if o == Optim.EXACT_ROWWISE_ADAGRAD:
            mode = self.spec.weight_decay_mode
            gw = g + wd * w if mode == WeightDecay.L2 else g
            m = state[0] + (gw * gw).sum(1) / D
            multiplier = lr / (m.sqrt() + eps)
            if mode == WeightDecay.L2:
                correction = (1.0 - multiplier * wd)[:, None]
            elif mode == WeightDecay.DECOUPLE:
                correction = 1.0 - lr * wd
            else:
                correction = 1.0
            w = correction * w - multiplier[:, None] * g
            if self.spec.max_norm:
                w = w.to(self.tables[0].dtype).float()  # the stored row is what gets rescaled
                norm = _row_norm(w)
                w = torch.where((norm > self.max_norm)[:, None], w * (self.max_norm / norm)[:, None], w)
            return w, [m]
        if o == Optim.LARS_SGD:
            w_norm = _row_norm(w)
            denom = _row_norm(g) + wd * w_norm
            adjusted = torch.where(denom > 0, lr * self.eta * w_norm / denom, torch.zeros_like(denom))
            m = self.momentum_coef * state[0] + adjusted[:, None] * (g + wd * w)
            return w - m, [m]
        # Adam / LAMB family.
        b1, b2 = self.beta1, self.beta2
        new_state = []
        if self.spec.rowwise_bias_correction:
            counter = state[2] + 1.0
            t = counter[:, None]
        else:
            counter = None
            t = torch.tensor(float(self.step_count))
        bc1, bc2 = _bias_correction(b1, t), _bias_correction(b2, t)
        m = state[0] * b1 + g * (1.0 - b1)
        if o in (Optim.ADAM, Optim.LAMB):
            v = state[1] * b2 + (g * g) * (1.0 - b2)
            r = m / bc1 / ((v / bc2).sqrt() + eps)
        else:
            v = (g * g).sum(1) / D * (1.0 - b2) + state[1] * b2
            r = m / bc1 / ((v / bc2).sqrt() + eps)[:, None]
        new_state = [m, v] + ([counter] if counter is not None else [])
        r = r + wd * w
        if o in (Optim.ADAM, Optim.PARTIAL_ROWWISE_ADAM):
            return w - lr * r, new_state
        r_norm = _row_norm(r)
        ratio = torch.where(r_norm > 0, _row_norm(w) / r_norm, torch.zeros_like(r_norm))
        return w - (lr * ratio)[:, None] * r, new_state

    def psw_grad(self, indices, offsets, per_sample_weights, grad_out) -> torch.Tensor:
        """d(out . grad_out) / d psw, with the current tables."""
        if self.spec.gradient_clipping:
            grad_out = grad_out.clamp(-self.spec.max_gradient, self.spec.max_gradient)
        psw = per_sample_weights.double().detach().requires_grad_(True)
        tables = [t.double() for t in self.tables]
        out = pooled_lookup(tables, self.feature_table_map, indices, offsets, self.mean, psw)
        (g,) = torch.autograd.grad(out, psw, grad_out.double())
        return g
