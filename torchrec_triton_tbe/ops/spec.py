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
    """The fused optimizers (FBGEMM's EmbOptimType members of the same names; kernels/optim.py's OPTIM)."""

    EXACT_SGD = 0
    EXACT_ROWWISE_ADAGRAD = 1
    EXACT_ADAGRAD = 2
    ADAM = 3
    PARTIAL_ROWWISE_ADAM = 4
    LAMB = 5
    PARTIAL_ROWWISE_LAMB = 6
    LARS_SGD = 7


class WeightDecay(enum.IntEnum):
    """Row-wise Adagrad's weight decay modes, numbered as FBGEMM's WeightDecayMode (kernels/optim.py's
    WD_MODE). Other optimizers apply ``weight_decay`` their own single way, as FBGEMM does."""

    NONE = 0
    L2 = 1
    DECOUPLE = 2


# Hyper-parameters the update reads from a device tensor at run time (so update_hyper_parameters and
# CUDA graph replays see new values): index i holds HYPER_FIELDS[i] (kernels/optim.py's H_* indices).
# The learning rate has its own tensor (the module's learning_rate_tensor).
HYPER_FIELDS = ("eps", "beta1", "beta2", "weight_decay", "eta", "momentum", "max_norm")


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One optimizer state tensor: FBGEMM's buffer name, whether it holds a value per row (else one
    per weight element, laid out like the weights) and its dtype."""

    name: str  # momentum1 / momentum2 / row_counter
    rowwise: bool
    dtype: torch.dtype = torch.float32


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """What the fused update does (constexprs of the backward kernels) and which state it keeps.

    ``max_norm``: row-wise Adagrad rescales each updated row to norm <= max_norm (FBGEMM applies it to
    that optimizer only). ``rowwise_bias_correction``: Adam corrects its bias with a per-row step
    counter instead of the global step (FBGEMM's ``use_rowwise_bias_correction``).
    ``gradient_clipping``: the output gradient is clamped to [-max_gradient, max_gradient] first."""

    optim: Optim = Optim.EXACT_SGD
    weight_decay_mode: WeightDecay = WeightDecay.NONE
    max_norm: bool = False
    rowwise_bias_correction: bool = False
    gradient_clipping: bool = False
    max_gradient: float = 1.0
    momentum1_dtype: torch.dtype = torch.float32
    momentum2_dtype: torch.dtype = torch.float32

    @functools.cached_property
    def states(self) -> tuple[StateSpec, ...]:
        """The state tensors, in FBGEMM's ``split_optimizer_states`` order."""
        o = self.optim
        if o == Optim.EXACT_SGD:
            return ()
        if o == Optim.EXACT_ROWWISE_ADAGRAD:
            return (StateSpec("momentum1", True),)
        if o in (Optim.EXACT_ADAGRAD, Optim.LARS_SGD):
            return (StateSpec("momentum1", False),)
        rowwise2 = o in (Optim.PARTIAL_ROWWISE_ADAM, Optim.PARTIAL_ROWWISE_LAMB)
        states = (StateSpec("momentum1", False, self.momentum1_dtype),
                  StateSpec("momentum2", rowwise2, self.momentum2_dtype))
        if self.rowwise_bias_correction:
            states += (StateSpec("row_counter", True),)
        return states

    @functools.cached_property
    def state_keys(self) -> tuple[str, ...]:
        """FBGEMM's ``get_optimizer_state`` keys of each table's states (same order as ``states``)."""
        o = self.optim
        if o in (Optim.EXACT_ROWWISE_ADAGRAD, Optim.EXACT_ADAGRAD):
            return ("sum",)
        if o == Optim.LARS_SGD:
            # FBGEMM raises NotImplementedError here; the name torch.optim.SGD gives its momentum.
            return ("momentum_buffer",)
        return ("exp_avg", "exp_avg_sq", "row_counter")[: len(self.states)]

    @property
    def elementwise_state_bytes(self) -> int:
        """Bytes of element-wise state per weight element (read and written with each updated row)."""
        return sum(s.dtype.itemsize for s in self.states if not s.rowwise)

    @property
    def uses_step(self) -> bool:
        """Whether the update reads the step counter (bias correction)."""
        return self.optim in (Optim.ADAM, Optim.PARTIAL_ROWWISE_ADAM, Optim.LAMB, Optim.PARTIAL_ROWWISE_LAMB)

    def constexprs(self) -> dict:
        return dict(
            OPTIM=int(self.optim),
            WD_MODE=int(self.weight_decay_mode),
            MAX_NORM=self.max_norm,
            ROW_BIAS=self.rowwise_bias_correction,
        )


@dataclasses.dataclass(frozen=True)
class TBESpec:
    plan: TablePlan
    tensors: PlanTensors
    pooling_mean: bool
    weights_dtype: torch.dtype
    output_dtype: torch.dtype
    optimizer: OptimizerSpec
    stochastic_rounding: bool
    bounds: Bounds
    config: KernelConfig
    fused_bounds_check: bool = False  # repair ids inside the forward kernel (WARNING / IGNORE)
    hoist_transpose: bool = False  # sort + run-length encode in forward, carried to backward
    nobag: bool = False  # PoolingMode.NONE: one output row per lookup ([N, D], every table of one D)

    @functools.cached_property
    def bucket_align(self) -> tuple[int, ...]:
        """Per bucket: a power of two (<= 16 elements) dividing every row start and output row start
        its kernels touch, so loads and stores can be vectorised although D is a run-time value."""
        plan = self.plan
        out = []
        for bucket in plan.buckets:
            g = plan.total_D
            for k in bucket.tables:
                g = math.gcd(g, plan.dims[k], plan.lookup_weight_offsets[k])
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

    @functools.cached_property
    def reads_step_count(self) -> bool:
        """Whether the backward's update reads the step count: Adam / LAMB bias correction, or the seed
        of stochastic rounding. Otherwise the kernels take a count pointer and never read through it.
        Cached: the forward asks on every call."""
        return self.optimizer.uses_step or self.sr_drop_bits > 0

    @functools.cached_property
    def advances_step_count(self) -> bool:
        """Whether a forward advances the step count (the module's ``iter``): where FBGEMM's forward does
        (every optimizer but SGD, Adagrad and LARS, whose FBGEMM forwards return before the count moves),
        and where an update here reads it (stochastic rounding's seed). Elsewhere nothing reads it, and
        leaving it is one device launch less per forward."""
        uncounted = (Optim.EXACT_SGD, Optim.EXACT_ADAGRAD, Optim.LARS_SGD)
        return self.optimizer.optim not in uncounted or self.reads_step_count

    @property
    def sr_drop_bits(self) -> int:
        if not self.stochastic_rounding:
            return 0
        return {torch.float16: 13, torch.bfloat16: 16}.get(self.weights_dtype, 0)

    @property
    def device(self) -> torch.device:
        return self.tensors.feature_dim.device
