"""FBGEMM's constructor keywords: what each one means here.

``TritonTBE`` takes every keyword of ``SplitTableBatchedEmbeddingBagsCodegen`` (fbgemm_gpu 1.6 and
1.9: the same names, 1.9 adds a few). Each is in one of three groups:

* used: it changes what the module computes, and the module implements it (the optimizer and its
  hyper-parameters, precisions, pooling, bounds check, ...);
* accepted and ignored: it changes nothing in what is computed, here or in FBGEMM (caching, UVM
  placement and prefetch knobs, with every table in device memory; monitoring; hyper-parameters and
  configuration objects of optimizers or modes not selected, which FBGEMM ignores too);
* rejected: a value that would change results and is not implemented raises ``NotImplementedError``
  naming the keyword and value; a combination FBGEMM itself rejects raises ``ValueError``.

:func:`optimizer_spec` turns the optimizer keywords into the :class:`OptimizerSpec` the kernels run
and the initial values of the run-time hyper-parameters (``HYPER_FIELDS``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from torchrec_triton_tbe._fbgemm import BoundsCheckMode, EmbeddingLocation, EmbOptimType, SparseType, WeightDecayMode
from torchrec_triton_tbe.ops.spec import HYPER_FIELDS, Optim, OptimizerSpec, WeightDecay

OPTIMIZERS = {
    EmbOptimType.EXACT_SGD: Optim.EXACT_SGD,
    EmbOptimType.EXACT_ROWWISE_ADAGRAD: Optim.EXACT_ROWWISE_ADAGRAD,
    EmbOptimType.EXACT_ADAGRAD: Optim.EXACT_ADAGRAD,
    EmbOptimType.ADAM: Optim.ADAM,
    EmbOptimType.PARTIAL_ROWWISE_ADAM: Optim.PARTIAL_ROWWISE_ADAM,
    EmbOptimType.LAMB: Optim.LAMB,
    EmbOptimType.PARTIAL_ROWWISE_LAMB: Optim.PARTIAL_ROWWISE_LAMB,
    EmbOptimType.LARS_SGD: Optim.LARS_SGD,
}

# What the module computes with (the optimizer's keywords are read by optimizer_spec below).
USED = (
    "embedding_specs feature_table_map weights_precision output_dtype stochastic_rounding pooling_mode device "
    "bounds_check_mode table_names embedding_table_index_type embedding_table_offset_type cache_precision "
    "embedding_shard_info"  # for error messages only (TablePlan.shard_note)
).split()
OPTIMIZER_KEYWORDS = (
    "optimizer learning_rate eps momentum weight_decay weight_decay_mode eta beta1 beta2 gradient_clipping "
    "max_gradient max_norm counter_based_regularization cowclip_regularization global_weight_decay "
    "optimizer_state_dtypes extra_optimizer_config"
).split()

# Keyword -> FBGEMM default: any other value would change results and is not implemented.
UNSUPPORTED = {
    # Streams updated rows to a remote store: a side effect this module does not have.
    "enable_raw_embedding_streaming": False,
    # FBGEMM keeps host-placed tables' weights and optimizer state in the caller's tensors: its forward
    # reads them and its update writes them. Every table lives in this module's own device buffers, so
    # any value but None is refused (an empty dict too: nothing here could honour what it might hold).
    "preallocated_host_buffers": None,
}

# Accepted and ignored (see the module docstring): nothing they control exists here or they configure
# an optimizer / mode that is not the one selected.
IGNORED = (
    "cache_algorithm cache_load_factor cache_sets cache_reserved_memory enforce_hbm record_cache_metrics "
    "gather_uvm_cache_stats uvm_non_rowwise_momentum use_experimental_tbe prefetch_pipeline "
    "stats_reporter_config multipass_prefetch_config uvm_host_mapped tbe_input_multiplexer_config "
    "is_qr_tbe res_params ensemble_mode emainplace_mode "
    "ar_alpha ema_beta min_shrinkage"
).split()

# Optimizers that read each hyper-parameter (FBGEMM's update rules); elsewhere FBGEMM ignores them.
_READS_WEIGHT_DECAY = {Optim.EXACT_ROWWISE_ADAGRAD, Optim.ADAM, Optim.PARTIAL_ROWWISE_ADAM, Optim.LAMB,
                       Optim.PARTIAL_ROWWISE_LAMB, Optim.LARS_SGD}
_STATE_DTYPES = {SparseType.FP32: torch.float32, SparseType.BF16: torch.bfloat16}


def _name(value: Any) -> str:
    return getattr(value, "name", repr(value))


_V2_BOUNDS = {"V2_IGNORE": BoundsCheckMode.IGNORE, "V2_WARNING": BoundsCheckMode.WARNING,
              "V2_FATAL": BoundsCheckMode.FATAL}


def bounds_check_mode(mode) -> BoundsCheckMode:
    """The mode FBGEMM's TBE runs for ``bounds_check_mode``: the ``FBGEMM_TBE_BOUNDS_CHECK_MODE``
    environment variable, when set, overrides it, and the V2 modes are FBGEMM's second implementation
    of IGNORE / WARNING / FATAL, which it runs as those (this module has one implementation)."""
    mode = BoundsCheckMode(int(os.environ.get("FBGEMM_TBE_BOUNDS_CHECK_MODE", BoundsCheckMode(mode).value)))
    return _V2_BOUNDS.get(mode.name, mode)


def check_keywords(given: dict) -> None:
    """Rejects the keywords that would change results and are not implemented (non-optimizer ones)."""
    for name, default in UNSUPPORTED.items():
        if given[name] != default:
            raise NotImplementedError(
                f"TritonTBE: {name}={given[name]!r} is not supported (it changes what FBGEMM does); "
                f"supported value: {default!r}"
            )
    cache_precision = given["cache_precision"]
    if cache_precision is not None and cache_precision != given["weights_precision"]:
        cached = [k for k, s in enumerate(given["embedding_specs"])
                  if len(s) == 4 and s[2] == EmbeddingLocation.MANAGED_CACHING]
        if cached:
            # FBGEMM would compute on cached rows stored in cache_precision; every row lives in the
            # weights' precision here.
            raise NotImplementedError(
                f"TritonTBE: cache_precision={_name(cache_precision)} differs from weights_precision="
                f"{_name(given['weights_precision'])} for MANAGED_CACHING tables {cached}: not supported "
                "(every table lives in device memory in weights_precision)"
            )


def optimizer_spec(given: dict) -> tuple[OptimizerSpec, dict[str, float]]:
    """The constructor's optimizer keywords as an OptimizerSpec plus the hyper-parameters' values."""
    optimizer = given["optimizer"]
    if optimizer not in OPTIMIZERS:
        names = ", ".join(o.name for o in OPTIMIZERS)
        raise NotImplementedError(f"TritonTBE: optimizer={_name(optimizer)} is not supported; supported: {names}")
    optim = OPTIMIZERS[optimizer]
    mode = WeightDecayMode(given["weight_decay_mode"])
    # FBGEMM's own consistency checks (it raises AssertionError for these).
    for cfg, cfg_mode in (("counter_based_regularization", WeightDecayMode.COUNTER),
                          ("cowclip_regularization", WeightDecayMode.COWCLIP)):
        if (mode == cfg_mode) != (given[cfg] is not None):
            raise ValueError(f"TritonTBE: weight_decay_mode={mode.name} and {cfg}={given[cfg]!r}: FBGEMM requires "
                             f"{cfg} exactly with weight_decay_mode={cfg_mode.name}")
    if mode == WeightDecayMode.DECOUPLE_GLOBAL and (
            optim != Optim.EXACT_ROWWISE_ADAGRAD or given["global_weight_decay"] is None):
        raise ValueError("TritonTBE: weight_decay_mode=DECOUPLE_GLOBAL needs optimizer=EXACT_ROWWISE_ADAGRAD and "
                         "a global_weight_decay definition (as in FBGEMM)")
    wd_mode = WeightDecay.NONE
    if optim == Optim.EXACT_ROWWISE_ADAGRAD:
        if mode.name not in WeightDecay.__members__:
            raise NotImplementedError(
                f"TritonTBE: weight_decay_mode={mode.name} with EXACT_ROWWISE_ADAGRAD is not supported; "
                f"supported: {', '.join(WeightDecay.__members__)}"
            )
        wd_mode = WeightDecay[mode.name]

    extra = given["extra_optimizer_config"]
    bias_per_row = bool(getattr(extra, "use_rowwise_bias_correction", False))
    if bias_per_row and optim != Optim.ADAM:
        raise ValueError("TritonTBE: use_rowwise_bias_correction needs optimizer=ADAM (as in FBGEMM)")
    if getattr(extra, "use_writeback_bwd_prehook", False):
        raise NotImplementedError(
            "TritonTBE: extra_optimizer_config.use_writeback_bwd_prehook=True (gradient writeback) is not supported"
        )

    dtypes = {"momentum1": torch.float32, "momentum2": torch.float32}
    if given["optimizer_state_dtypes"] is not None and optim != Optim.PARTIAL_ROWWISE_ADAM:
        # FBGEMM asserts this for any dict, even an empty one or one of fp32 entries.
        raise ValueError(f"TritonTBE: optimizer_state_dtypes with optimizer={optim.name}: FBGEMM takes it only with "
                         "PARTIAL_ROWWISE_ADAM (or ENSEMBLE_ROWWISE_ADAGRAD, not supported here); pass None")
    for name, sparse_type in (given["optimizer_state_dtypes"] or {}).items():
        if name not in dtypes or sparse_type == SparseType.FP32:
            continue  # FBGEMM reads momentum1 / momentum2 only; fp32 is every state's default
        if optim != Optim.PARTIAL_ROWWISE_ADAM or sparse_type not in _STATE_DTYPES:
            raise NotImplementedError(
                f"TritonTBE: optimizer_state_dtypes {name}={_name(sparse_type)} with {optim.name} is not supported; "
                "FBGEMM's choices are FP32 or BF16 state of PARTIAL_ROWWISE_ADAM"
            )
        dtypes[name] = _STATE_DTYPES[sparse_type]

    max_norm = float(given["max_norm"])
    spec = OptimizerSpec(
        optim=optim,
        weight_decay_mode=wd_mode,
        # FBGEMM rescales rows by max_norm in row-wise Adagrad's update only.
        max_norm=optim == Optim.EXACT_ROWWISE_ADAGRAD and max_norm > 0.0,
        rowwise_bias_correction=bias_per_row,
        gradient_clipping=bool(given["gradient_clipping"]),
        max_gradient=float(given["max_gradient"]),
        momentum1_dtype=dtypes["momentum1"],
        momentum2_dtype=dtypes["momentum2"],
    )
    hyper = {name: float(given[name]) for name in HYPER_FIELDS}
    if optim not in _READS_WEIGHT_DECAY:
        hyper["weight_decay"] = 0.0
    return spec, hyper
