"""TritonTBE: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` interface on Triton kernels.

Same constructor arguments (names, order, defaults of fbgemm_gpu 1.6-1.9), same ``forward`` signature
and positional order, same state getters, FBGEMM's own enums. What each constructor keyword does here
(used, accepted and ignored, or rejected by name) is in ``compat.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import uuid
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from torchrec_triton_tbe import _env  # noqa: F401  (sets TRITON_INTERPRET before kernels load)
from torchrec_triton_tbe._fbgemm import (
    BoundsCheckMode,
    CacheAlgorithm,
    ComputeDevice,
    EmbeddingLocation,
    EmbOptimType,
    PoolingMode,
    SparseType,
    WeightDecayMode,
)
from torchrec_triton_tbe import checkpoint, compat
from torchrec_triton_tbe.autograd import HyperVersion, LastStream, LookupCall, StepVersion, TBEFunction
from torchrec_triton_tbe.errors import InputError
from torchrec_triton_tbe.config import KernelConfig, load_config
from torchrec_triton_tbe.ops import bounds as bounds_ops
from torchrec_triton_tbe.ops import launch as launch_ops
from torchrec_triton_tbe.ops import vbe as vbe_ops
from torchrec_triton_tbe.ops.backward import OptimizerTensors
from torchrec_triton_tbe.ops.graphs import BackwardGraphs
from torchrec_triton_tbe.ops.spec import HYPER_FIELDS, Bounds, TBESpec
from torchrec_triton_tbe.ops.transpose import RunPlan
from torchrec_triton_tbe.plan import PlanTensors, TablePlan

logger = logging.getLogger(__name__)

_DTYPES = {SparseType.FP32: torch.float32, SparseType.FP16: torch.float16, SparseType.BF16: torch.bfloat16}
_POOLING = (PoolingMode.SUM, PoolingMode.MEAN, PoolingMode.NONE)
# The buffers a backward updates or reads, in OptimizerTensors' field order.
_OPTIMIZER_BUFFERS = ("momentum1", "momentum2", "row_counter")  # FBGEMM's names; empty where unused
_STATE_BUFFERS = ("weights", *_OPTIMIZER_BUFFERS, "learning_rate_tensor", "optimizer_hyper", "iter")
# update_hyper_parameters keys FBGEMM takes; "lower_bound" configures global weight decay, which is
# never enabled here (as in FBGEMM without it, setting it changes nothing).
_UPDATABLE = ("eps", "beta1", "beta2", "weight_decay")


def _with_small_tables(plan: TablePlan, config: KernelConfig, nobag: bool) -> TablePlan:
    """``plan`` with the small-table path's reach of ``config`` (none for sequence tables); their own
    buckets only where the forward takes the path."""
    st = config.small_table
    rows, dim = (0, 0) if nobag else (st.max_rows, st.max_dim)
    split = bool(st.forward)
    if (plan.small_max_rows, plan.small_max_dim, plan.small_split) == (rows, dim, split):
        return plan
    return dataclasses.replace(plan, small_max_rows=rows, small_max_dim=dim, small_split=split)


def _resolve_device(device, specs) -> torch.device:
    if device is not None:
        return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if specs and all(len(s) == 4 and s[3] == ComputeDevice.CPU for s in specs):
        return torch.device("cpu")
    if torch.cuda.is_available() and not _env.interpreting():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_to_empty(fn) -> bool:
    """Whether ``fn``, handed to ``Module._apply``, is ``Module.to_empty``'s (every buffer uninitialised),
    whichever module's ``to_empty`` was called: a parent's reaches this module's ``_apply`` only. By its
    qualified name (one lambda in torch's to_empty since 2.1); were it renamed, a cross-device ``to_empty``
    would keep the WARNING count as a move does (tests/test_module.py checks the name on the installed torch)."""
    return getattr(fn, "__qualname__", None) == "Module.to_empty.<locals>.<lambda>"


def _discard_runs(runs: RunPlan) -> None:
    """Where a recorded call's statistics go: nowhere, as its kernels did not run (TritonTBE._lookup_call)."""


class TritonTBE(nn.Module):
    """Drop-in for ``fbgemm_gpu``'s ``SplitTableBatchedEmbeddingBagsCodegen`` (pooled, training).

    Extra keywords (after FBGEMM's): ``kernel_config`` (a ``KernelConfig``, a config name such as
    ``"sm90"`` or a YAML path), ``fused_bounds_check`` (repair ids inside the forward kernel) and
    ``hoist_transpose`` (sort + run-length encode in forward). None of them changes results.
    """

    def __init__(  # noqa: C901
        self,
        embedding_specs: Sequence[tuple],
        feature_table_map: Optional[list[int]] = None,
        cache_algorithm: CacheAlgorithm = CacheAlgorithm.LRU,
        cache_load_factor: float = 0.2,
        cache_sets: int = 0,
        cache_reserved_memory: float = 0.0,
        cache_precision: Optional[SparseType] = None,
        weights_precision: SparseType = SparseType.FP32,
        output_dtype: SparseType = SparseType.FP32,
        enforce_hbm: bool = False,
        optimizer: EmbOptimType = EmbOptimType.EXACT_SGD,
        record_cache_metrics: Any = None,
        gather_uvm_cache_stats: Optional[bool] = False,
        stochastic_rounding: bool = True,
        gradient_clipping: bool = False,
        max_gradient: float = 1.0,
        max_norm: float = 0.0,
        learning_rate: float = 0.01,
        eps: float = 1.0e-8,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        weight_decay_mode: WeightDecayMode = WeightDecayMode.NONE,
        ar_alpha: float = 0.0,
        ema_beta: float = 0.99,
        min_shrinkage: float = 0.1,
        eta: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        ensemble_mode: Any = None,
        emainplace_mode: Any = None,
        counter_based_regularization: Any = None,
        cowclip_regularization: Any = None,
        pooling_mode: PoolingMode = PoolingMode.SUM,
        device: Union[str, int, torch.device, None] = None,
        bounds_check_mode: BoundsCheckMode = BoundsCheckMode.WARNING,
        uvm_non_rowwise_momentum: bool = False,
        use_experimental_tbe: bool = False,
        prefetch_pipeline: bool = False,
        stats_reporter_config: Any = None,
        table_names: Optional[list[str]] = None,
        optimizer_state_dtypes: Any = None,
        multipass_prefetch_config: Any = None,
        global_weight_decay: Any = None,
        uvm_host_mapped: bool = False,
        extra_optimizer_config: Any = None,
        tbe_input_multiplexer_config: Any = None,
        embedding_table_index_type: torch.dtype = torch.int64,
        embedding_table_offset_type: torch.dtype = torch.int64,
        embedding_shard_info: Optional[list[tuple[int, int, int, int]]] = None,
        enable_raw_embedding_streaming: bool = False,
        res_params: Any = None,
        is_qr_tbe: bool = False,
        preallocated_host_buffers: Any = None,
        *,
        kernel_config: Union[KernelConfig, str, None] = None,
        fused_bounds_check: bool = False,
        hoist_transpose: bool = False,
    ) -> None:
        super().__init__()
        given = dict(locals())
        compat.check_keywords(given)
        optim_spec, hyper = compat.optimizer_spec(given)
        pooling_mode = PoolingMode(pooling_mode)
        if pooling_mode not in _POOLING:
            raise NotImplementedError(
                f"TritonTBE: pooling_mode={pooling_mode.name} is not supported; use SUM, MEAN or NONE"
            )
        for name, sparse_type in (("weights_precision", weights_precision), ("output_dtype", output_dtype)):
            if sparse_type not in _DTYPES:
                raise NotImplementedError(f"TritonTBE: {name}={sparse_type} is not supported; use FP32, FP16 or BF16")
        for name, dt in (
            ("embedding_table_index_type", embedding_table_index_type),
            ("embedding_table_offset_type", embedding_table_offset_type),
        ):
            if dt not in (torch.int32, torch.int64):
                raise ValueError(f"TritonTBE: {name} must be torch.int32 or torch.int64, got {dt}")

        specs = [tuple(s) for s in embedding_specs]
        for k, s in enumerate(specs):
            if len(s) not in (2, 4):
                raise ValueError(f"embedding_specs[{k}] = {s}: expected (rows, dim) or (rows, dim, location, device)")
            for what, v in (("rows", s[0]), ("dim", s[1])):
                try:
                    operator.index(v)  # ints and integer scalars; a float would be truncated silently by int()
                except TypeError:
                    raise TypeError(f"embedding_specs[{k}] = {s}: {what} must be an integer, got {v!r}") from None
        self.current_device = _resolve_device(device, specs)
        _env.check_device(self.current_device)
        self.embedding_specs = [
            (int(s[0]), int(s[1]), s[2] if len(s) == 4 else EmbeddingLocation.DEVICE,
             s[3] if len(s) == 4 else ComputeDevice.CUDA)
            for s in specs
        ]
        plan = TablePlan.build([s[:2] for s in specs], feature_table_map, table_names, shards=embedding_shard_info)
        if pooling_mode == PoolingMode.NONE and len(set(plan.dims)) > 1:
            # FBGEMM asserts the same ("Mixed dimension tables only supported for pooling tables"): a
            # sequence output has one row width.
            raise ValueError(f"TritonTBE: pooling_mode=NONE needs one embedding dim for every table, got {plan.dims}")
        self.feature_table_map = list(plan.feature_table_map)
        # FBGEMM's descriptive attributes, which its tests and code written against it read.
        self.dims: list = [int(s[1]) for s in specs]  # per table
        self.mixed_D: bool = len(set(self.dims)) > 1
        self.is_nobag: bool = pooling_mode == PoolingMode.NONE
        self.total_hash_size: int = sum(int(s[0]) for s in specs)
        self.table_names = table_names
        self.optimizer = optimizer
        self.pooling_mode = pooling_mode
        self.weights_precision = weights_precision
        self.output_dtype: int = output_dtype.as_int()  # FBGEMM's form: SparseType.from_int reads it
        self.stochastic_rounding = stochastic_rounding
        # FBGEMM's reading: its environment override, and the V2 modes run as the first three.
        self.bounds_check_mode_int = int(compat.bounds_check_mode(bounds_check_mode).value)
        self.embedding_table_index_type = embedding_table_index_type
        self.embedding_table_offset_type = embedding_table_offset_type
        self.embedding_shard_info = embedding_shard_info
        # FBGEMM's per-module id: TorchRec's raw-id tracker (model_tracker) registers modules by it.
        self.uuid = str(uuid.uuid4())
        self.total_D = plan.total_D
        self.max_D = plan.max_D
        self.T = plan.num_features
        logger.debug("TritonTBE: ignored FBGEMM keywords %s", {k: given[k] for k in compat.IGNORED})

        dev = self.current_device
        wdtype = _DTYPES[weights_precision]
        # Every table, then (where a table has 0 rows) the zero row its repaired lookups read (TablePlan).
        self.register_buffer("weights", torch.zeros(plan.weight_storage_elements, dtype=wdtype, device=dev))
        # FBGEMM's optimizer state buffers (momentum1, momentum2, row_counter), empty where unused.
        held = {state.name: state for state in optim_spec.states}
        for name in _OPTIMIZER_BUFFERS:
            state = held.get(name)
            size = 0 if state is None else (plan.total_rows if state.rowwise else plan.total_weight_elements)
            dtype = torch.float32 if state is None else state.dtype
            self.register_buffer(name, torch.zeros(size, dtype=dtype, device=dev))
        # What learning_rate_tensor and optimizer_hyper hold (the latter by HYPER_FIELDS; FBGEMM's
        # update_hyper_parameters keys change some): the host's view, so an update that changes nothing
        # costs no device work, and a buffer left uninitialised (to_empty) is written again (_apply).
        self._hyper_host = {"lr": float(learning_rate), **{n: float(hyper[n]) for n in HYPER_FIELDS}}
        # Device-resident so kernels (and captured CUDA graphs) see every set_learning_rate and
        # update_hyper_parameters. Not saved, as FBGEMM's plain attribute is not: a checkpoint restores
        # weights, state and step, and the constructor's (or the optimizer's) rate applies.
        self.register_buffer("learning_rate_tensor", torch.full((1,), float(learning_rate), dtype=torch.float32,
                                                                device=dev), persistent=False)
        self.register_buffer(
            "optimizer_hyper", torch.tensor([hyper[n] for n in HYPER_FIELDS], dtype=torch.float32, device=dev),
            persistent=False,
        )
        self._hyper_version = HyperVersion()
        # Advanced by each forward where FBGEMM's is, and where it seeds stochastic rounding
        # (TBESpec.advances_step_count; autograd.StepVersion).
        self.register_buffer("iter", torch.zeros(1, dtype=torch.int64, device=dev))
        self._last_stream = LastStream()
        self.register_buffer("bounds_check_warning", torch.zeros(1, dtype=torch.int64, device=dev), persistent=False)
        # The offsets check's count of bad bags and its programs' tickets, zero between calls (ops/bounds.py).
        self.register_buffer("_bounds_scratch", torch.zeros(2, dtype=torch.int32, device=dev), persistent=False)
        self.register_buffer("D_offsets", torch.tensor(plan.D_offsets, dtype=torch.int32, device=dev), persistent=False)
        # Makes autograd run backward (the fused optimizer) even when no input needs a gradient. A
        # zero-size Parameter, as FBGEMM's: the module's parameters() list it (and it alone, as FBGEMM's
        # on the GPU, whose weights are buffers), so ``next(module.parameters()).device`` works, and
        # ``module.to`` moves it.
        self.placeholder_autograd_tensor = nn.Parameter(torch.zeros(0, dtype=torch.float32, device=dev))

        # The caller's choice (None: the device's default), loaded again when the module moves to a device
        # of another kind (_retarget).
        self._kernel_config_choice = kernel_config
        self._device_error: Optional[str] = None  # set where _apply moved the tables to a device kernels cannot use
        config = load_config(dev, kernel_config)
        plan = _with_small_tables(plan, config, pooling_mode == PoolingMode.NONE)
        self._spec = TBESpec(
            plan=plan,
            tensors=PlanTensors.build(plan, dev, config.forward.grouped_block_d),
            pooling_mean=pooling_mode == PoolingMode.MEAN,
            nobag=pooling_mode == PoolingMode.NONE,
            weights_dtype=wdtype,
            output_dtype=_DTYPES[output_dtype],
            optimizer=optim_spec,
            stochastic_rounding=bool(stochastic_rounding),
            bounds=Bounds(self.bounds_check_mode_int),
            config=config,
            fused_bounds_check=fused_bounds_check,
            hoist_transpose=hoist_transpose,
        )
        self.collect_backward_stats = False
        # precompile() on the first training forward's batch before running it (the plugin's precompile
        # option); eval forwards under no_grad neither trigger nor use it up.
        self.precompile_first_step = False
        self._precompiled = False
        self.precompile_report = None  # the last precompile()'s PrecompileReport
        # Opt-in guard (docs/reliability.md): non-finite per-sample weights (forward) or output
        # gradients (backward) raise before any kernel runs, leaving weights and state untouched.
        # One host sync per checked tensor when on; nothing at all when off.
        self.check_finite = False
        self._last_runs: Optional[RunPlan] = None
        # Captured backwards of launch-bound batches (ops/graphs.py; config backward.graph_max_lookups).
        self._backward_graphs = BackwardGraphs()
        self._cached_call: Optional[tuple] = None

    # ------------------------------------------------------------------ configuration
    @property
    def spec(self) -> TBESpec:
        return self._spec

    @property
    def kernel_config(self) -> KernelConfig:
        return self._spec.config

    def set_kernel_config(self, config: Union[KernelConfig, str]) -> None:
        """Swap tuning knobs (results change by fp32 summation order at most: the short/long threshold,
        the long chunk and the small-table path reorder sums)."""
        self._configure(self._spec.device, config)
        self._backward_graphs.clear()

    def _configure(self, device: torch.device, choice: Union[KernelConfig, str, None]) -> None:
        """The spec with the kernel config ``choice`` loads for ``device``, its tables on ``device``;
        ``choice`` is kept for later moves only once it has loaded."""
        config = load_config(device, choice)
        self._kernel_config_choice = choice
        plan = _with_small_tables(self._spec.plan, config, self._spec.nobag)
        changes = dict(config=config)
        # The small tables' buckets moved, the one-launch forward's slices changed width, or the module
        # moved: new tensors.
        if (plan != self._spec.plan or config.forward.grouped_block_d != self._spec.tensors.chunk_width
                or device != self._spec.device):
            changes.update(plan=plan, tensors=PlanTensors.build(plan, device, config.forward.grouped_block_d))
        self._spec = dataclasses.replace(self._spec, **changes)
        self._cached_call = None

    def _apply(self, fn, *args, **kwargs):
        # Moving or casting buffers invalidates graphs captured on the old ones (their keys would
        # never match again; dropping them frees their static inputs now).
        self._backward_graphs.clear()
        # A copy or cast of the buffers, and the writes below, come after the last forward's work on its
        # stream (a pipeline's lookup stream may still be running its offsets check on the scratch).
        self._follow_last_stream()
        b = self._buffers
        before = dict(b)
        out = super()._apply(fn, *args, **kwargs)
        if b["weights"].device != self._spec.device:
            self._retarget(b["weights"].device)
        # Buffers whose values are the module's own, not state a checkpoint restores, written again
        # where _apply replaced them (to_empty leaves them uninitialised; a cast or a move to the device
        # they are on returns them as they are, and writing those could race a forward still running on
        # another stream): the offsets check's scratch, zero at every launch (kernels/bounds.py); the row
        # that empty tables' lookups read, zero (TablePlan.empty_row_offset); the learning rate and
        # hyper-parameters, whose host view decides whether a later update writes them at all
        # (update_hyper_parameters); the WARNING count, where it has no value to keep (to_empty onto any
        # device, also through a parent module's, or materialised from meta; a move or a copy keeps it).
        def replaced(name):
            t = b.get(name)
            return t is not None and t is not before.get(name) and not t.is_meta

        with torch.no_grad():
            if replaced("_bounds_scratch"):
                b["_bounds_scratch"].zero_()
            empty = self._spec.plan.empty_row_offset
            if empty is not None and replaced("weights"):
                b["weights"][empty:].zero_()
            if replaced("learning_rate_tensor"):
                b["learning_rate_tensor"].fill_(self._hyper_host["lr"])
            if replaced("optimizer_hyper"):
                b["optimizer_hyper"].copy_(torch.tensor([self._hyper_host[n] for n in HYPER_FIELDS]))
            old = before.get("bounds_check_warning")
            if replaced("bounds_check_warning") and (_is_to_empty(fn) or old.is_meta):
                b["bounds_check_warning"].zero_()
        return out

    def _retarget(self, device: torch.device) -> None:
        """The plan's tables and the kernel config for ``device``, where ``module.to`` or ``to_empty``
        moved the buffers: the forward checks its inputs against the tables'
        device, and the kernels read the tables with the weights."""
        # Not raised here: ``model.cpu()`` before saving a checkpoint must work on a GPU host; a forward
        # on a device the kernels cannot run on raises (the check's message).
        try:
            _env.check_device(device)
            self._device_error = None
        except RuntimeError as e:
            self._device_error = str(e)
        self._configure(device, self._kernel_config_choice)
        self._last_stream = LastStream()  # a stream of the old device: nothing to wait for here
        # Its capture stream belongs to the old device (and entering it would make that device current).
        self._backward_graphs = BackwardGraphs()

    def __prepare_scriptable__(self):
        # torch.jit.script calls this first: without it TorchScript fails deep in its compiler, unclearly.
        raise NotImplementedError(
            "TritonTBE cannot be TorchScripted: it launches Triton kernels from Python. Run it eagerly, or in a "
            "model under torch.compile (its forward runs eagerly between the compiled graphs)"
        )

    # ------------------------------------------------------------------ forward
    # torch.compile: dynamo cannot trace the launches (our launch cache calls Triton's launcher directly;
    # under the interpreter the kernels are not JITFunctions at all), so a compiled model runs this
    # forward eagerly between graphs and its backward through autograd, as FBGEMM's opaque custom ops do.
    @torch.compiler.disable
    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor] = None,
        feature_requires_grad: Optional[torch.Tensor] = None,
        batch_size_per_feature_per_rank: Optional[list[list[int]]] = None,
        total_unique_indices: Optional[int] = None,
        hash_zch_identities: Optional[torch.Tensor] = None,
        hash_zch_runtime_meta: Optional[torch.Tensor] = None,
        vbe_output: Optional[torch.Tensor] = None,
        vbe_output_offsets: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        # total_unique_indices is a sizing hint (needed by FBGEMM's OptimType.NONE); hash_zch_* feed
        # FBGEMM's raw-embedding streaming. Neither changes the pooled output.
        if self._device_error is not None:
            raise RuntimeError(f"{self._device_error} (the module was moved to {self._spec.device})")
        dev = self._spec.device
        if dev.type == "cuda" and dev.index != torch.cuda.current_device():
            # Triton launches on the current device's stream, and the torch ops around the launches on
            # the tables' device's: a module on cuda:1 called with cuda:0 current would race its own
            # kernels. FBGEMM's operators guard on their tensors' device; so does this forward (the
            # backward runs on autograd's thread for the gradient's device).
            with torch.cuda.device(dev):
                return self.forward(indices, offsets, per_sample_weights, feature_requires_grad,
                                    batch_size_per_feature_per_rank, total_unique_indices, hash_zch_identities,
                                    hash_zch_runtime_meta, vbe_output, vbe_output_offsets)
        if self.precompile_first_step and not self._precompiled and torch.is_grad_enabled():
            self._precompiled = True  # first: the dry run calls forward too
            self.precompile(indices, offsets, per_sample_weights, batch_size_per_feature_per_rank)
        spec = self._spec
        sizes = None
        if batch_size_per_feature_per_rank is not None:
            if spec.nobag:
                # FBGEMM: "Variable batch size TBE support is not enabled for PoolingMode.NONE" (TorchRec
                # pads sequence batches before the lookup).
                raise InputError("batch_size_per_feature_per_rank is not supported with pooling_mode=NONE")
            sizes = vbe_ops.check_batch_sizes(spec, batch_size_per_feature_per_rank)
            if vbe_output is not None or vbe_output_offsets is not None:
                # Before the offsets repair below writes the caller's offsets: a refused call changes nothing.
                vbe_ops.check_output(spec, vbe_output, vbe_output_offsets, len(sizes[0]))
        elif vbe_output is not None or vbe_output_offsets is not None:
            raise InputError("vbe_output / vbe_output_offsets need batch_size_per_feature_per_rank")
        B = bounds_ops.validate_shapes(spec, indices, offsets, per_sample_weights, feature_requires_grad,
                                       None if sizes is None else sum(map(sum, sizes)))
        # FBGEMM: ids to int32 when the index type says so; offsets always follow the ids' dtype.
        if self.embedding_table_index_type == torch.int32 and indices.dtype != torch.int32:
            indices = indices.to(torch.int32)
        if offsets.dtype != indices.dtype:
            offsets = offsets.to(indices.dtype)
        indices, offsets = indices.contiguous(), offsets.contiguous()
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.contiguous()
        if feature_requires_grad is not None:
            feature_requires_grad = feature_requires_grad.to(device=spec.device, dtype=torch.int32)
        if self.check_finite and per_sample_weights is not None:
            bounds_ops.check_finite("per_sample_weights", per_sample_weights)
        bufs = self._buffers
        # Before this forward writes the module's device state (the bounds check's count and scratch,
        # the step count): after the last forward's stream, where that was another one. Host only.
        self._follow_last_stream()
        # WARNING / IGNORE repair the caller's offsets in place, as FBGEMM, and before VBE's layout pads
        # them: a repaired last offset must close the last real bag, not a padding one.
        bounds_ops.repair_offsets(spec, offsets, indices.numel(), bufs["bounds_check_warning"],
                                  bufs["_bounds_scratch"])
        vbe = None
        if sizes is not None:
            # Every feature padded to the largest batch, every bag's output row in a table (ops/vbe.py).
            vbe = vbe_ops.vbe_layout(spec, offsets, sizes, vbe_output, vbe_output_offsets)
            offsets, B = vbe.offsets, vbe.B
        bounds_ops.check_and_repair(
            spec, indices, offsets, B, bufs["bounds_check_warning"],
            ids=not spec.fused_bounds_check or spec.nobag,  # the sequence forward does not repair ids
            bag_begin=() if vbe is None else vbe.bag_begin,
        )
        call = self._lookup_call(spec, B, bufs)
        # FBGEMM's forward advances the step count (eval forwards too) and its backward applies that
        # count; FBGEMM's SGD, Adagrad and LARS forwards leave it, and so do these unless stochastic
        # rounding seeds from it (TBESpec.advances_step_count). The first pooled / sequence launch
        # advances it (ops/forward.StepAdvance), after this call's checks: as in FBGEMM, whose forward
        # advances it before its lookup, a forward that fails past them may have counted. A forward
        # autograd records gets its own copy of the new count for its backward (autograd.StepVersion)
        # where the update reads it; where it does not (SGD, Adagrad, LARS without stochastic rounding)
        # the backward gets the buffer itself, whose value it does not use.
        step = StepVersion()
        step.saved = self.iter
        if spec.reads_step_count and torch.is_grad_enabled():
            step.saved = torch.empty_like(self.iter)
        return TBEFunction.apply(
            self.placeholder_autograd_tensor, indices, offsets, per_sample_weights, feature_requires_grad,
            None if vbe is None else vbe.output, call, vbe, self._hyper_version, step,
        )

    @property
    def _count_device(self) -> torch.device:
        # Where the count lives now (``module.to`` moves it; current_device stays the constructor's).
        return self.iter.device

    def _follow_last_stream(self) -> None:
        """Before the module's device state is written (the step count ``iter``, the bounds check's
        count and scratch): on CUDA, where the last forward ran on another stream (a pipeline's lookup
        stream, then an eval loop's), the current stream waits for it, so the two forwards' writes of
        that shared state do not race (two offsets checks interleaving their tickets would leave the
        scratch non-zero, kernels/bounds.py). Not inside a CUDA-graph capture: the
        capture's stream may not wait for work outside it (a user's capture of the whole step warms up
        on a side stream first, and PyTorch's recipe orders that stream before capturing); within a
        capture that forks streams, ordering forwards across them is the capture's own (its fork and
        join), as for any tensor two of its streams write."""
        device = self._count_device
        if device.type != "cuda":
            return
        now = torch.cuda.current_stream(device)
        last, self._last_stream.stream = self._last_stream.stream, now
        if last is not None and last != now and not torch.cuda.is_current_stream_capturing():
            now.wait_stream(last)

    def precompile(self, indices: torch.Tensor, offsets: torch.Tensor,
                   per_sample_weights: Optional[torch.Tensor] = None,
                   batch_size_per_feature_per_rank: Optional[list[list[int]]] = None,
                   workers: Optional[int] = None, pool: str = "process"):
        """Compiles every kernel specialization a training step on this batch launches, on ``workers``
        processes at once (``pool="thread"``: threads; default: this process's CPUs over the job's
        processes on this host, at most configs' ``precompile.max_workers``), before the step: the
        step then launches kernels already compiled instead of compiling them one after another
        (ops/precompile.py). Weights, optimizer state and the step counter are unchanged; returns a
        ``PrecompileReport``. Another batch shape may need a few more specializations (other bag
        lengths, batch sizes); those compile on first use as without this call. Nothing to compile
        under Triton's interpreter."""
        from torchrec_triton_tbe.ops import precompile as precompile_ops

        # Workers started at construction (start_precompile_workers) serve the default count only.
        procs = precompile_ops.release_workers(self)
        report = precompile_ops.precompile(self, indices, offsets, per_sample_weights, batch_size_per_feature_per_rank,
                                           workers, pool=pool, procs=procs if workers is None else None)
        self.precompile_report = report
        return report

    def start_precompile_workers(self, workers: Optional[int] = None) -> bool:
        """Starts the compile workers of this module's first ``precompile`` now, so that their start-up
        (~1 s on the H200 host) runs beside what the program does before its first step rather than in
        it; modules of one process share them (ops/precompile.start_workers). The plugin's precompile
        option calls this when it builds the module. Returns whether any were started (none on a CPU
        or under Triton's interpreter); they end after that precompile, or with the module."""
        from torchrec_triton_tbe.ops import precompile as precompile_ops

        return precompile_ops.hold_workers(self, workers)

    def _lookup_call(self, spec: TBESpec, B: int, bufs: dict) -> LookupCall:
        """This call's LookupCall, reused while nothing in it changed (building one per call was a
        fifth of the forward's host time on small batches). Keyed by the identity of every tensor it
        holds: a replaced buffer (``module.to``, ``load_state_dict(assign=True)``) gives a new call, and
        the old one keeps its tensors alive, so their ids cannot be reused while it is cached."""
        # precompile's dry run (this thread's launches recorded, not run) gets a call of its own, uncached,
        # with a graph cache of its own (a graph this module captured for the batch's shape would be
        # replayed, real kernels, not recorded) and statistics kept nowhere, so other threads' calls
        # meanwhile find the module's cache, graphs and statistics as they were. Same launches: a call with
        # statistics still has an ``on_runs``, which keeps its backward off the graph path, as the real step's.
        recorded = launch_ops.recording_into() is not None
        if not recorded:
            names = (*_STATE_BUFFERS, "bounds_check_warning")
            key = (id(spec), B, self.collect_backward_stats, self.check_finite, *(id(bufs[n]) for n in names))
            cached = self._cached_call
            if cached is not None and cached[0] == key:
                return cached[1]
        on_runs = (_discard_runs if recorded else self._record_runs) if self.collect_backward_stats else None
        call = LookupCall(
            spec=spec,
            state=self.optimizer_tensors(),
            B=B,
            warning=bufs["bounds_check_warning"],
            on_runs=on_runs,
            graphs=BackwardGraphs() if recorded else self._backward_graphs,
            check_finite=self.check_finite,
        )
        if not recorded:
            self._cached_call = (key, call)
        return call

    def optimizer_tensors(self) -> OptimizerTensors:
        """The tensors a backward updates in place (the module's current buffers)."""
        return OptimizerTensors(*(self._buffers[n] for n in _STATE_BUFFERS))

    def _record_runs(self, runs: RunPlan) -> None:
        self._last_runs = runs

    def backward_stats(self) -> dict:
        """Run statistics of the last backward (set ``collect_backward_stats = True`` first). Syncs."""
        if self._last_runs is None:
            raise RuntimeError("no backward recorded; set module.collect_backward_stats = True before training")
        return self._last_runs.stats()

    # ------------------------------------------------------------------ FBGEMM state API
    def split_embedding_weights(self) -> list[torch.Tensor]:
        plan = self._spec.plan
        return [
            self.weights.detach()[off : off + r * d].view(r, d)
            for off, r, d in zip(plan.weights_offsets, plan.rows, plan.dims)
        ]

    def split_optimizer_states(self) -> list[list[torch.Tensor]]:
        """Per table, views of its optimizer state tensors in FBGEMM's order (momentum1, momentum2,
        row_counter as the optimizer has them): ``(rows,)`` if row-wise, else ``(rows, dim)``. ``[]``
        for EXACT_SGD."""
        plan = self._spec.plan
        states = self._spec.optimizer.states
        if not states:
            return []
        out = []
        for k, (r, d) in enumerate(zip(plan.rows, plan.dims)):
            per_table = []
            for state in states:
                flat = getattr(self, state.name).detach()
                if state.rowwise:
                    per_table.append(flat[plan.row_offsets[k] : plan.row_offsets[k] + r])
                else:
                    off = plan.weights_offsets[k]
                    per_table.append(flat[off : off + r * d].view(r, d))
            out.append(per_table)
        return out

    def get_optimizer_state(self) -> list[dict[str, torch.Tensor]]:
        """FBGEMM's per-table state dicts: ``{"sum"}`` (Adagrads), ``{"exp_avg", "exp_avg_sq"}`` (Adam /
        LAMB families, ``+ "row_counter"`` with row-wise bias correction), ``{"momentum_buffer"}``
        (LARS_SGD, for which FBGEMM raises); ``[]`` for EXACT_SGD."""
        keys = self._spec.optimizer.state_keys
        return [dict(zip(keys, states)) for states in self.split_optimizer_states()]

    @torch.no_grad()
    def reset_embedding_weight_momentum(
        self,
        pruned_indices: torch.Tensor,
        pruned_indices_offsets: torch.Tensor,
        logical_table_ids: torch.Tensor,
        buffer_ids: torch.Tensor,
    ) -> None:
        """FBGEMM's reset of pruned (evicted) rows, called by TorchRec's managed-collision eviction, which
        then re-initialises the rows' weights with the table's init_fn. Entry ``i`` names table
        ``logical_table_ids[i]`` and the rows ``pruned_indices[pruned_indices_offsets[b]:
        pruned_indices_offsets[b + 1]]``, ``b = buffer_ids[i]`` (row ids local to that table). As in FBGEMM
        1.6.0 / 1.9.0: with EXACT_ROWWISE_ADAGRAD those rows' weights and row-wise state are set to zero;
        with any other optimizer nothing changes (FBGEMM's reset runs for row-wise Adagrad only, so other
        optimizers' evicted rows keep their state there too). Out-of-range tables or rows raise before
        anything is written. Reads the (small) id and offset tensors on the host: eviction is not on the
        training step's sync-free path."""
        if self.optimizer != EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            return
        plan = self._spec.plan
        tables = logical_table_ids.tolist()
        buffers = buffer_ids.tolist()
        offsets = pruned_indices_offsets.tolist()
        if len(tables) != len(buffers):
            raise ValueError(f"reset_embedding_weight_momentum: {len(tables)} logical_table_ids but "
                             f"{len(buffers)} buffer_ids")
        resets = []
        for table, buffer in zip(tables, buffers):
            if not 0 <= table < len(plan.rows):
                raise IndexError(f"reset_embedding_weight_momentum: logical table {table} of {len(plan.rows)}")
            if not 0 <= buffer < len(offsets) - 1:
                raise IndexError(f"reset_embedding_weight_momentum: buffer {buffer} with "
                                 f"{len(offsets)} pruned_indices_offsets")
            rows = pruned_indices[offsets[buffer] : offsets[buffer + 1]].to(self._spec.device, torch.int64)
            if rows.numel() and not bool(((rows >= 0) & (rows < plan.rows[table])).all()):
                raise IndexError(f"reset_embedding_weight_momentum: table {table}{self._named(table)} "
                                 f"has {plan.rows[table]} rows; pruned rows {rows.tolist()[:8]} ...")
            resets.append((table, rows))
        weights = self.split_embedding_weights()
        for table, rows in resets:
            weights[table][rows] = 0
            self.momentum1[plan.row_offsets[table] + rows] = 0

    def _named(self, table: int) -> str:
        return f" ({self.table_names[table]})" if self.table_names else ""

    def get_optimizer_buffer(self, state: str) -> torch.Tensor:
        # FBGEMM's buffers are named <state>_dev (momentum1_dev); ours <state>.
        name = state[: -len("_dev")] if state.endswith("_dev") else state
        for buffer_name, buffer in self.named_buffers():
            if buffer_name == name:
                return buffer
        raise ValueError(f"Optimizer buffer {state} not found")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if checkpoint.is_fbgemm(state_dict, prefix):  # a bare FBGEMM module's checkpoint (checkpoint.py)
            rowwise = {state.name: state.rowwise for state in self._spec.optimizer.states}
            checkpoint.from_fbgemm(
                state_dict, prefix, self._spec.plan,
                {name: (getattr(self, name), rowwise.get(name, False))
                 for name in ("weights", *_OPTIMIZER_BUFFERS)},
                self.iter,
            )
        # Weights of the tables alone (this module's checkpoints from before a table of 0 rows got its zero
        # row, TablePlan.empty_row_offset; FBGEMM's, above): the zero row appended.
        weights = state_dict.get(prefix + "weights")
        plan = self._spec.plan
        if (isinstance(weights, torch.Tensor) and plan.empty_row_offset is not None
                and weights.numel() == plan.total_weight_elements):
            state_dict[prefix + "weights"] = torch.cat(
                [weights, weights.new_zeros(plan.weight_storage_elements - weights.numel())])
        # Checkpoints written before the learning rate stopped being saved hold it: ignored, as FBGEMM
        # (which never saves it) would not have it to restore.
        state_dict.pop(prefix + "learning_rate_tensor", None)
        # Saved since it became a Parameter (as FBGEMM saves it); zero-size, so older checkpoints lack
        # nothing by lacking it.
        state_dict.setdefault(prefix + "placeholder_autograd_tensor", self.placeholder_autograd_tensor.detach())
        self._follow_last_stream()  # a loaded step count is for later forwards
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def get_learning_rate(self) -> float:
        # FBGEMM returns its fp32 learning_rate_tensor's item(): the value rounded to fp32 (0.05 reads back
        # 0.05000000074505806), and TorchRec's fused optimizer shows it in its param_groups.
        return float(torch.tensor(self._hyper_host["lr"], dtype=torch.float32))

    def set_learning_rate(self, lr: float) -> None:
        self.update_hyper_parameters({"lr": lr})

    def update_hyper_parameters(self, params_dict: dict[str, float]) -> None:
        """FBGEMM's keys: ``lr``, ``eps``, ``beta1``, ``beta2``, ``weight_decay``, ``lower_bound``. As in
        FBGEMM, they apply to the backwards of later forwards: a forward already run keeps its values for
        its backward (autograd.HyperVersion). An unknown key raises before anything changes."""
        changed = {}
        for name, value in params_dict.items():
            if name not in ("lr", "lower_bound", *_UPDATABLE):
                raise NotImplementedError(f"Setting hyper-parameter {name} is not supported")
            current = self._hyper_host.get(name)  # lower_bound: nothing to set
            if current is not None and float(value) != current:
                changed[name] = float(value)
        if not changed:
            return
        # The forwards run so far keep the old values for their backwards: two small device copies.
        self._hyper_version.saved = (self.learning_rate_tensor.clone(), self.optimizer_hyper.clone())
        self._hyper_version = HyperVersion()
        for name, value in changed.items():
            # Device fills, no host sync; eager and replayed backwards read the buffers.
            self._hyper_host[name] = value
            target = self.learning_rate_tensor if name == "lr" else self.optimizer_hyper[HYPER_FIELDS.index(name)]
            target.fill_(value)

    def set_optimizer_step(self, step: int) -> None:
        """The step count: the next forward's update is step + 1 (Adam / LAMB bias correction); a
        forward already run keeps its own count for its backward. FBGEMM behaves so on a module that
        has not run a forward yet (TorchRec's restore); once it has, its updates keep counting from its
        host copy of the count and only the saved ``iter`` changes (fbgemm_gpu 1.9)."""
        self._follow_last_stream()
        self.iter.fill_(step)

    def init_embedding_weights_uniform(self, min_val: float, max_val: float) -> None:
        for w in self.split_embedding_weights():
            w.uniform_(min_val, max_val)

    def flush(self) -> None:
        """No cache to write back: every table lives in device memory."""

    def reset_cache_states(self) -> None:
        """No cache: nothing to reset."""

    def prefetch(self, indices, offsets, forward_stream=None, batch_size_per_feature_per_rank=None) -> None:
        """No cache to prefetch into: every table lives in device memory."""

