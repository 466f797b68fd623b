"""Plan options of the Triton TBE kernel, and how they travel from a sharding plan to the kernel.

TorchRec gives a compute kernel its configuration only through ``GroupedEmbeddingConfig.fused_params``.
Options ride on ``TritonTBEParameterSharding.get_additional_fused_params()``, which TorchRec merges into
the fused_params of CUSTOMIZED_KERNEL tables only; the sharder's own fused_params also reach FBGEMM
tables, whose constructor rejects unknown keywords. TorchRec groups tables into one kernel instance by
``tuple(sorted(fused_params.items()))``, so every value here is hashable, and tables with different
options never share a kernel.

None of the options changes results of valid batches; each but ``check_finite`` trades speed only
(``precompile``: time to the first step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from torchrec_triton_tbe.config import KernelConfig

# TorchRec's CUSTOMIZED_KERNEL is one shared enum value; this marker says "ours" so that other
# plugins' customized kernels keep reaching their own code.
MARKER_KEY = "customized_compute_kernel"
MARKER = "triton_tbe"

# Plugin-only fused_params keys, prefixed so they cannot collide with an FBGEMM keyword.
FUSED_BOUNDS_CHECK_KEY = "triton_tbe_fused_bounds_check"
HOIST_TRANSPOSE_KEY = "triton_tbe_hoist_transpose"
KERNEL_CONFIG_KEY = "triton_tbe_kernel_config"
CHECK_FINITE_KEY = "triton_tbe_check_finite"
PRECOMPILE_KEY = "triton_tbe_precompile"
PLUGIN_KEYS = (MARKER_KEY, FUSED_BOUNDS_CHECK_KEY, HOIST_TRANSPOSE_KEY, KERNEL_CONFIG_KEY, CHECK_FINITE_KEY,
               PRECOMPILE_KEY)

# TorchRec's own keys (torchrec.distributed.fused_params). They are read by TorchRec's kernel base
# class, which casts the KJT's ids and offsets to these dtypes, and by TritonTBE; they stay in
# fused_params.
INDEX_TYPE_KEY = "embedding_table_index_type"
OFFSET_TYPE_KEY = "embedding_table_offset_type"
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class TritonTBEOptions:
    """Per table group options. Defaults reproduce TorchRec's and FBGEMM's behaviour.

    * ``index_dtype``: ``torch.int32`` or ``torch.int64`` ids and offsets for the kernel (TorchRec's
      ``embedding_table_index_type`` and ``embedding_table_offset_type``). ``None`` leaves both keys
      alone: int64 unless the sharder's fused_params set them. int32 halves id traffic; a KJT that
      already holds int32 reaches the kernel without a copy.
    * ``fused_bounds_check``: repair out-of-range ids inside the forward kernel instead of a separate
      pass (WARNING / IGNORE modes; FATAL and NONE are unaffected). The mode itself is TorchRec's
      ``ParameterSharding.bounds_check_mode`` (default: FBGEMM's WARNING).
    * ``hoist_transpose``: sort and run-length encode the ids in forward and carry them to backward,
      taking that work off the backward's critical path.
    * ``kernel_config``: tuning knobs, a config name (``"sm90"``), a YAML path or a ``KernelConfig``;
      ``None`` picks the device's default.
    * ``check_finite``: raise before any update when a per-sample weight (forward) or an output
      gradient (backward) is NaN or infinite, leaving weights and optimizer state untouched
      (docs/reliability.md). One host sync per checked tensor; off by default, as in FBGEMM.
    * ``precompile`` (on by default): on its first forward, each kernel module first compiles every
      kernel a training step on that batch launches, in worker processes (``TritonTBE.precompile``),
      instead of compiling them one after another as the step reaches them. Changes when compiling
      happens, nothing else: a cold first step of a production-shaped model takes ~3 s instead of ~21
      s (docs/performance.md). ``False``: no worker processes, kernels compile as the step reaches them.
    """

    index_dtype: Optional[torch.dtype] = None
    fused_bounds_check: bool = False
    hoist_transpose: bool = False
    kernel_config: Union[str, KernelConfig, None] = None
    check_finite: bool = False
    precompile: bool = True

    def __post_init__(self) -> None:
        if self.index_dtype is not None and self.index_dtype not in INDEX_DTYPES:
            raise ValueError(f"TritonTBEOptions.index_dtype must be torch.int32, torch.int64 or None, "
                             f"got {self.index_dtype!r}")
        for name in ("fused_bounds_check", "hoist_transpose", "check_finite", "precompile"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"TritonTBEOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if self.kernel_config is not None and not isinstance(self.kernel_config, (str, KernelConfig)):
            raise TypeError(
                "TritonTBEOptions.kernel_config must be a config name, a YAML path or a KernelConfig "
                f"(hashable, as TorchRec groups tables by their fused_params), got {type(self.kernel_config).__name__}"
            )

    def to_fused_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {
            MARKER_KEY: MARKER,
            FUSED_BOUNDS_CHECK_KEY: self.fused_bounds_check,
            HOIST_TRANSPOSE_KEY: self.hoist_transpose,
            KERNEL_CONFIG_KEY: self.kernel_config,
            CHECK_FINITE_KEY: self.check_finite,
            PRECOMPILE_KEY: self.precompile,
        }
        if self.index_dtype is not None:
            params[INDEX_TYPE_KEY] = self.index_dtype
            params[OFFSET_TYPE_KEY] = self.index_dtype
        return params

    @classmethod
    def pop_from(cls, fused_params: dict[str, Any]) -> "TritonTBEOptions":
        """Removes the plugin-only keys from ``fused_params`` (in place) and returns the options.

        TorchRec's index/offset keys are read, not removed: the kernel's module takes them too."""
        marker = fused_params.pop(MARKER_KEY, None)
        if marker != MARKER:
            raise ValueError(f"fused_params carry {MARKER_KEY}={marker!r}, not {MARKER!r}: not a Triton TBE group")
        index_dtype = fused_params.get(INDEX_TYPE_KEY)
        # An absent key takes the field's default (written once, on the dataclass).
        return cls(
            index_dtype=index_dtype if fused_params.get(OFFSET_TYPE_KEY) == index_dtype else None,
            fused_bounds_check=fused_params.pop(FUSED_BOUNDS_CHECK_KEY, cls.fused_bounds_check),
            hoist_transpose=fused_params.pop(HOIST_TRANSPOSE_KEY, cls.hoist_transpose),
            kernel_config=fused_params.pop(KERNEL_CONFIG_KEY, cls.kernel_config),
            check_finite=fused_params.pop(CHECK_FINITE_KEY, cls.check_finite),
            precompile=fused_params.pop(PRECOMPILE_KEY, cls.precompile),
        )


def is_triton_tbe(fused_params: Optional[dict[str, Any]]) -> bool:
    return bool(fused_params) and fused_params.get(MARKER_KEY) == MARKER


def reject_plugin_keys(fused_params: Optional[dict[str, Any]], where: str) -> None:
    """Sharder-level fused_params reach FBGEMM tables too, where a plugin key is a TypeError deep in
    FBGEMM's constructor; refuse them up front with the place they belong."""
    bad = sorted(set(fused_params or {}) & set(PLUGIN_KEYS))
    if bad:
        raise ValueError(
            f"{where}: fused_params {bad} are Triton TBE plan options; they also reach FBGEMM ('fused') tables, "
            "whose constructor rejects them. Pass them as TritonTBEOptions (sharder options=..., use_triton_tbe(...)) "
            "or as TritonTBEParameterSharding fields instead."
        )
