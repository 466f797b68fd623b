"""Other Triton TBEs to benchmark against, loaded from a checkout the user gives (never copied here).

``torchrec_triton``: TorchRec's ``TritonTableBatchedEmbeddingBags`` (TorchRec main,
``torchrec/distributed/triton_tbe/``; not in the TorchRec wheels). :func:`load_torchrec_triton` imports
its three files from ``<checkout>/torchrec/distributed/triton_tbe/`` under their real module names,
since they import each other as ``torchrec.distributed.triton_tbe.*``:

    triton_table_batched_embeddings.py      the module (and its autograd function, forward kernels)
    triton_tbe_backward_utils.py            backward helpers, OPTIM_TYPE_TO_INT
    triton_tbe_backward_long_run_fused.py   the Blackwell (tlx/CLC) fused long-run backward

What the peer supports (TorchRec main 376cac6a; line numbers in ``triton_table_batched_embeddings.py``
unless noted), and so what :func:`peer_skip_reason` skips:

* pooling: SUM only ("triton table batched embedding bag with sum reduction mode", l. 10; no pooling
  argument, l. 2537-2551; VBE metadata built with ``PoolingMode.SUM``, l. 1569 and 2777).
* optimizers: EXACT_SGD and EXACT_ROWWISE_ADAGRAD (``OPTIM_TYPE_TO_INT``, backward_utils l. 15-18, which
  the backward indexes, l. 2257; only row-wise Adagrad gets a state, l. 2690-2698). Its backward sorts
  with FBGEMM's ``transpose_embedding_input`` (l. 2126), which has no CPU kernel: on CPU only its
  forward runs.
* precisions: torch dtypes, not SparseType (``weights_precision: torch.dtype``, ``output_dtype``, l.
  2541-2542); fp32, fp16 and bf16 (fp64 accumulation for fp32 weights, else fp32, l. 202-204 and
  424-428). Stochastic rounding always rounds to fp16 (``_stochastic_rounding_store``, backward_utils
  l. 28-70, in every backward store), so it is right for fp16 weights only.
* per-sample weights, VBE (``batch_size_per_feature_per_rank``, l. 2817), ``feature_table_map``.
* weights: one flat ``self.weight = torch.empty(...)`` (uninitialised, l. 2619-2624);
  ``split_embedding_weights()`` returns per-table views (l. 2948-2960), which the bench fills.
* bounds check: no constructor argument; ``self.bounds_check_mode = BoundsCheckMode.V2_WARNING`` after
  construction (l. 2707), read per call (l. 2849-2880): the bench sets it to the case's mode (NONE in
  the suites).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any, Optional, Union

TORCHREC_TRITON_PACKAGE = "torchrec.distributed.triton_tbe"
TORCHREC_TRITON_FILES = (
    "triton_table_batched_embeddings.py",
    "triton_tbe_backward_utils.py",
    "triton_tbe_backward_long_run_fused.py",
)
TORCHREC_TRITON_CLASS = "TritonTableBatchedEmbeddingBags"
TORCHREC_TRITON_OPTIMIZERS = ("exact_sgd", "exact_rowwise_adagrad")
CHECKOUT_ENV = "TORCHREC_CHECKOUT"

# The AMD-only module both files import at module level, unguarded (triton_table_batched_embeddings.py
# l. 61-73, triton_tbe_backward_utils.py l. 19-21), and the names they take from it. Every use is
# behind ``is_amd()`` (torch.version.hip), so on NVIDIA (and CPU) none of them is ever touched.
_AMD_MODULE = "ads_mkl.ops.triton.amd.triton_table_batched_embeddings"
_AMD_NAMES = (
    "_expand_long_runs",
    "_FIXED_GRID",
    "_nbit_TBE_forward_kernel_16bits",
    "_nbit_TBE_forward_kernel_32bits",
    "triton_tbe_backward_long_run_apply_unweighted",
    "triton_tbe_backward_long_run_grad_accum_unweighted",
    "triton_tbe_backward_long_run_grad_accum_weighted",
    "triton_tbe_backward_short_run_unweighted",
    "triton_tbe_backward_short_run_weighted",
    "triton_tbe_forward_unweighted_kernel",
    "triton_tbe_forward_weighted_kernel",
)

_loaded: dict[str, Any] = {}  # resolved package dir -> class


class _AmdOnly:
    """Stand-in for one name of the AMD module: any use (call, ``kernel[grid]``, arithmetic) raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self, *_: Any, **__: Any):
        raise RuntimeError(
            f"{_AMD_MODULE}.{self._name} is a stand-in (torchrec_triton_tbe.bench.peers): the AMD kernels of "
            "TorchRec's Triton TBE are Meta-internal and not available here"
        )

    __call__ = __getitem__ = __index__ = __int__ = __lt__ = __gt__ = __le__ = __ge__ = _fail

    def __repr__(self) -> str:
        return f"<AMD-only stand-in {_AMD_MODULE}.{self._name}>"


class _DisableOffsetsAdjustmentOff:
    """``FeatureGateName.DISABLE_OFFSETS_ADJUSTMENT`` for fbgemm-gpu without that member (1.6.0 has the
    enum, not the member). The gate is off unless FBGEMM_DISABLE_OFFSETS_ADJUSTMENT is set, and with
    it off the peer keeps its default: repair bad offsets after its fused bounds check instead of
    asserting (l. 2894-2903; read once in __init__, l. 2708-2710). That path only runs with
    ``fused_bounds_check=True`` and BoundsCheckMode.WARNING; 1.6.0's own bounds check always adjusts."""

    name = "DISABLE_OFFSETS_ADJUSTMENT"

    @staticmethod
    def is_enabled() -> bool:
        return False


class _FeatureGateNameShim:
    """The real FeatureGateName enum plus the one member this fbgemm-gpu lacks."""

    DISABLE_OFFSETS_ADJUSTMENT = _DisableOffsetsAdjustmentOff()

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def torchrec_triton_dir(checkout: Union[str, Path]) -> Path:
    """``<checkout>/torchrec/distributed/triton_tbe``, checked to hold the three files."""
    root = Path(checkout).expanduser()
    pkg = root / "torchrec" / "distributed" / "triton_tbe"
    missing = [f for f in TORCHREC_TRITON_FILES if not (pkg / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"TorchRec checkout {str(root)!r}: no {', '.join(missing)} in {pkg} (give a directory holding "
            "torchrec/distributed/triton_tbe/*.py, e.g. tools/stage_torchrec_triton.sh's .stage/torchrec)"
        )
    return pkg.resolve()


def _purge(prefix: str) -> None:
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


def _install_amd_stand_in() -> list[str]:
    """Stand-in modules for ``ads_mkl...amd...`` when it is not importable; returns the names added."""
    try:
        if importlib.util.find_spec("ads_mkl") is not None:
            return []  # the real one (Meta-internal builds): use it
    except (ImportError, ValueError):
        pass
    parts = _AMD_MODULE.split(".")
    added = []
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in sys.modules:
            continue
        mod = types.ModuleType(name, "stand-in installed by torchrec_triton_tbe.bench.peers (AMD-only)")
        if i < len(parts):
            mod.__path__ = []  # a package, so the next level imports
        else:
            for attr in _AMD_NAMES:
                setattr(mod, attr, _AmdOnly(attr))
        sys.modules[name] = mod
        added.append(name)
    return added


def load_torchrec_triton(checkout: Union[str, Path]):
    """TorchRec's ``TritonTableBatchedEmbeddingBags`` class, imported from ``checkout`` (a directory
    that contains ``torchrec/distributed/triton_tbe/*.py``, e.g. an extracted TorchRec tree).

    The installed torchrec has no ``triton_tbe`` subpackage, so a package module of that name whose
    ``__path__`` is the checkout's directory is registered first; the files then import each other
    under their real names. Loading another checkout replaces the previous one."""
    pkg_dir = torchrec_triton_dir(checkout)
    key = str(pkg_dir)
    if key in _loaded and sys.modules.get(TORCHREC_TRITON_PACKAGE) is not None:
        return _loaded[key]
    import torchrec.distributed as parent  # the installed TorchRec (any version)

    _purge(TORCHREC_TRITON_PACKAGE)
    _loaded.clear()
    spec = importlib.machinery.ModuleSpec(TORCHREC_TRITON_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [key]
    pkg = importlib.util.module_from_spec(spec)
    pkg.__path__ = [key]
    pkg.__file__ = None
    sys.modules[TORCHREC_TRITON_PACKAGE] = pkg
    setattr(parent, "triton_tbe", pkg)
    # ads_mkl: the files import AMD kernel variants from Meta's internal ads_mkl at module level,
    # without a guard, and use them only when torch.version.hip is set. Our environments have no
    # ads_mkl, so while the files import (and only then) sys.modules holds a stand-in whose names raise
    # if ever used; it is removed again once the import is done.
    added = _install_amd_stand_in()
    try:
        mod = importlib.import_module(f"{TORCHREC_TRITON_PACKAGE}.{Path(TORCHREC_TRITON_FILES[0]).stem}")
    except BaseException:
        _purge(TORCHREC_TRITON_PACKAGE)
        if getattr(parent, "triton_tbe", None) is pkg:
            delattr(parent, "triton_tbe")
        raise
    finally:
        for name in reversed(added):
            sys.modules.pop(name, None)
    # fbgemm_gpu.config.FeatureGateName.DISABLE_OFFSETS_ADJUSTMENT: read in the constructor; fbgemm-gpu
    # 1.6.0 (the GPU machine) lacks the member. Give the module a FeatureGateName that has it, off.
    gate = getattr(mod, "FeatureGateName", None)
    if gate is not None and not hasattr(gate, "DISABLE_OFFSETS_ADJUSTMENT"):
        mod.FeatureGateName = _FeatureGateNameShim(gate)
    cls = getattr(mod, TORCHREC_TRITON_CLASS)
    _loaded[key] = cls
    return cls


def describe_torchrec_triton(checkout: Union[str, Path]) -> dict[str, Any]:
    """For the JSON: the checkout, its SOURCE note (tools/stage_torchrec_triton.sh writes one: where
    from, which commit) and each file's sha256."""
    import hashlib

    pkg = torchrec_triton_dir(checkout)
    note = Path(checkout).expanduser() / "SOURCE"
    return {
        "checkout": str(Path(checkout).expanduser().resolve()),
        "source": note.read_text().strip() if note.is_file() else None,
        "sha256": {f: hashlib.sha256((pkg / f).read_bytes()).hexdigest() for f in TORCHREC_TRITON_FILES},
    }


def checkout_from(arg: Optional[str]) -> Optional[str]:
    """--torchrec-checkout, else $TORCHREC_CHECKOUT, else None."""
    return arg or os.environ.get(CHECKOUT_ENV) or None


# -------------------------------------------------------------------------------------------------- bench glue
_TORCH_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _has_kernel(op: str, dispatch_key: str) -> bool:
    import torch

    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key))
    except RuntimeError:  # no such operator
        return False


def peer_skip_reason(kernel: str, case: Any, optimizer: Optional[str], device: Any) -> Optional[str]:
    """Why ``kernel`` cannot run this case's forward (``optimizer`` None) or its backward with
    ``optimizer``, on ``device``; None when it can. ``case`` is a bench BenchCase."""
    if kernel != "torchrec_triton":
        raise ValueError(f"unknown peer kernel {kernel!r}")
    if case.pooling != "sum":
        return f"pooling {case.pooling}: TorchRec's Triton TBE implements SUM only"
    if optimizer is not None and optimizer not in TORCHREC_TRITON_OPTIMIZERS:
        return f"optimizer {optimizer}: TorchRec's Triton TBE implements {', '.join(TORCHREC_TRITON_OPTIMIZERS)} only"
    if optimizer is not None and case.stoc and case.weights_precision == "bf16":
        return "stochastic rounding with bf16 weights: TorchRec's Triton TBE's backward rounds to fp16 only"
    if optimizer is not None:
        import torch

        # Its backward sorts the lookups with FBGEMM's transpose_embedding_input (l. 2126), which
        # fbgemm-gpu(-cpu) registers without a CPU kernel: off CUDA, its backward cannot run.
        if torch.device(device).type != "cuda" and not _has_kernel("fbgemm::transpose_embedding_input", "CPU"):
            return "its backward needs fbgemm::transpose_embedding_input, which has no CPU kernel"
    return None


def build_torchrec_triton(checkout: Union[str, Path], rows_dims: list[tuple[int, int]], case: Any,
                          optimizer: str, device, fused_bounds_check: bool = False,
                          hoist_transpose: bool = False):
    """The peer with the bench's constructor arguments (as FBGEMM's: lr 0.1, eps 0.1, identity
    feature_table_map) and the case's bounds-check mode; weights are left for the caller to copy in."""
    import torch

    from torchrec_triton_tbe._fbgemm import BoundsCheckMode, EmbOptimType

    cls = load_torchrec_triton(checkout)
    cuda = torch.device(device).type == "cuda"
    module = cls(
        list(rows_dims),
        feature_table_map=list(range(case.num_tables)),
        weights_precision=getattr(torch, _TORCH_DTYPE_NAMES[case.weights_precision]),
        output_dtype=getattr(torch, _TORCH_DTYPE_NAMES[case.output_dtype]),
        # FBGEMM rounds stochastically only below fp32; the peer's rounding targets fp16 (see above).
        stochastic_rounding=case.stoc and case.weights_precision != "fp32",
        learning_rate=0.1,
        eps=0.1,
        optimizer=EmbOptimType[optimizer.upper()],
        device=device,
        # Hoisted, its forward calls the CUDA-only transpose_embedding_input (l. 1745): not on CPU.
        hoist_transpose_to_forward=hoist_transpose and cuda,
        fused_bounds_check=fused_bounds_check,
    )
    module.bounds_check_mode = BoundsCheckMode(case.bounds_check_mode)
    if not cuda:
        # Its forward records a CUDA event for NCCL ordering (l. 3014-3030): nothing to order on CPU.
        module.record_forward_event = lambda: None
    return module
