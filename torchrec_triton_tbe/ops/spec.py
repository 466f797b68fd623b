"""Everything static about one module's kernel launches, bundled once (no long argument lists)."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import torch

from torchrec_triton_tbe.config import KernelConfig
from torchrec_triton_tbe.plan import PlanTensors, TablePlan


class Bounds(enum.IntEnum):
    """Bounds-check modes, numbered as FBGEMM's BoundsCheckMode (kept FBGEMM-free below module.py)."""

    FATAL = 0
    WARNING = 1
    IGNORE = 2
    NONE = 3


class Optim(enum.IntEnum):
    EXACT_SGD = 0
    EXACT_ROWWISE_ADAGRAD = 1


@dataclasses.dataclass(frozen=True)
class TBESpec:
    plan: TablePlan
    tensors: PlanTensors
    pooling_mean: bool
    weights_dtype: torch.dtype
    output_dtype: torch.dtype
    optimizer: Optim
    stochastic_rounding: bool
    bounds: Bounds
    config: KernelConfig
    fused_bounds_check: bool = False  # repair ids inside the forward kernel (WARNING / IGNORE)
    hoist_transpose: bool = False  # sort + run-length encode in forward, carried to backward

    @functools.cached_property
    def bucket_align(self) -> tuple[int, ...]:
        """Per bucket: a power of two (<= 16 elements) dividing every row start and output row start
        its kernels touch, so loads and stores can be vectorised although D is a run-time value."""
        plan = self.plan
        out = []
        for bucket in plan.buckets:
            g = plan.total_D
            for k in bucket.tables:
                g = math.gcd(g, plan.dims[k], plan.weights_offsets[k])
            for t in bucket.features:
                g = math.gcd(g, plan.D_offsets[t])
            align = 1
            while align < 16 and g % (align * 2) == 0:
                align *= 2
            out.append(align)
        return tuple(out)

    @functools.cached_property
    def bucket_even_d(self) -> tuple[bool, ...]:
        return tuple(all(self.plan.dims[k] == b.block_d for k in b.tables) for b in self.plan.buckets)

    @functools.cached_property
    def launch_plans(self) -> dict:
        """Per-call launch parameters derived from this spec and a few host ints (grids, constexprs,
        warps), memoised by the ops modules: small batches are launch-bound, and re-deriving them from
        the config on every call cost the host more than the launch itself."""
        return {}

    @property
    def sr_drop_bits(self) -> int:
        if not self.stochastic_rounding:
            return 0
        return {torch.float16: 13, torch.bfloat16: 16}.get(self.weights_dtype, 0)

    @property
    def device(self) -> torch.device:
        return self.tensors.feature_dim.device
