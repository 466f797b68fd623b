"""The one autograd.Function: forward pools, backward folds the gradient into the weights.

The weights are not autograd inputs: like FBGEMM, the optimizer is fused into backward, which
updates weights and optimizer state in place and returns no weight gradient. A zero-size
``placeholder`` that requires grad makes autograd call backward even when nothing else needs a
gradient; the per-sample-weight gradient is returned when they require one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator, Optional

import torch

from torchrec_triton_tbe.ops import backward as bwd_ops
from torchrec_triton_tbe.ops import bounds as bounds_ops
from torchrec_triton_tbe.ops import forward as fwd_ops
from torchrec_triton_tbe.ops import graphs as graph_ops
from torchrec_triton_tbe.ops import launch as launch_ops
from torchrec_triton_tbe.ops import transpose as transpose_ops
from torchrec_triton_tbe.ops.spec import TBESpec
from torchrec_triton_tbe.ops.vbe import VBELayout


@dataclasses.dataclass(frozen=True)
class LookupCall:
    """One call's static inputs: the module's launch spec, its mutable tensors, the batch size,
    where to report backward run statistics (``None``: don't collect them), the module's captured
    backwards (``None``: always eager) and whether a non-finite output gradient raises."""

    spec: TBESpec
    state: bwd_ops.OptimizerTensors
    B: int
    warning: torch.Tensor
    on_runs: Optional[Callable[[transpose_ops.RunPlan], None]] = None
    graphs: Optional[graph_ops.BackwardGraphs] = None
    check_finite: bool = False


class _Saved:
    """A holder of one ``saved`` value (HyperVersion, StepVersion), picklable at every protocol."""

    __slots__ = ("saved",)

    # __slots__ without these pickles only from protocol 2 on (a module pickled at 0 or 1 holds one).
    def __getstate__(self) -> dict:
        return {"saved": self.saved}

    def __setstate__(self, state: dict) -> None:
        self.saved = state["saved"]


class HyperVersion(_Saved):
    """The learning rate and hyper-parameters a module's forwards ran under, until they change.

    FBGEMM's forward clones its learning-rate tensor and takes eps, betas and weight decay as arguments,
    so a backward applies the values in effect at its forward even when they change in between (as
    TorchRec's fused optimizer does in ``zero_grad()``, which many loops call after the forward). The
    module keeps no copy per forward: a change supersedes its current version and leaves it copies of
    the values its forwards saw (``saved``), which their backwards apply (``TBEFunction.backward``)."""

    __slots__ = ()

    def __init__(self) -> None:
        self.saved: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (lr, hyper) once superseded


class StepVersion(_Saved):
    """The step count one training forward ran under (FBGEMM's ``iter``).

    FBGEMM's forward advances its count and passes the new value to its backward as an argument, so a
    backward's bias correction is its own forward's count whatever ran in between (an eval forward,
    TorchRec's semi-synchronous pipeline, which runs the next batch's lookup before this one's backward,
    ``set_optimizer_step``, a checkpoint load). The module's forward advances its ``iter`` buffer and,
    when autograd records the forward (a backward may come, also again: a retry after an error,
    ``retain_graph``), writes the new count into ``saved``, a tensor of its own: both in the forward's
    first pooled / sequence launch (ops/forward.StepAdvance), on the forward's stream, which is where
    autograd runs its backward. The backward applies that copy and never reads ``iter``, so nothing it
    does races with later forwards on other streams. An update that does not use the count
    (``TBESpec.reads_step_count``: SGD, Adagrad, LARS without stochastic rounding) gets ``iter`` itself,
    no copy: its kernels take the pointer and use no value."""

    __slots__ = ()

    def __init__(self) -> None:
        self.saved: Optional[torch.Tensor] = None


class LastStream:
    """The CUDA stream of a module's last forward (None: none yet, or not on CUDA): the next forward on
    another stream waits for it before it advances the shared ``iter`` buffer. Not copied with the
    module (a copy has run no forward; a stream cannot be pickled or deep-copied)."""

    __slots__ = ("stream",)

    def __init__(self) -> None:
        self.stream = None

    def __deepcopy__(self, memo) -> "LastStream":
        return LastStream()

    def __reduce__(self):  # every pickle protocol: a new, empty holder
        return (LastStream, ())


@contextlib.contextmanager
def swapped_in(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """A captured backward reads the module's lr and hyper-parameter buffers where it was captured: for
    each (buffer, forward's value) pair the forward's value goes into the buffer for the replay and the
    current one comes back after, in stream order on the backward's stream, with no sync. (The step
    count is a static input of the graph instead: ops/graphs.py.)"""
    current = [buffer.clone() for buffer, _ in pairs]
    for buffer, saved in pairs:
        buffer.copy_(saved)
    try:
        yield
    finally:
        for (buffer, _), value in zip(pairs, current):
            buffer.copy_(value)


class TBEFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        placeholder: torch.Tensor,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor],
        feature_requires_grad: Optional[torch.Tensor],
        vbe_output: Optional[torch.Tensor],
        call: LookupCall,
        vbe: Optional[VBELayout],
        hyper: HyperVersion,
        step: StepVersion,
    ) -> torch.Tensor:
        """``vbe`` (variable batch): ``offsets`` are its padded ones and call.B its padded batch; with
        ``vbe_output`` (TorchRec's merged output of several kernels) the result is written into it in
        place and it is returned. ``hyper`` / ``step``: the module's current HyperVersion and this
        forward's StepVersion, whose values the backward applies."""
        spec = call.spec
        # The first pooled / sequence launch advances the count and writes the backward's copy, step.saved
        # (TritonTBE.forward).
        advance = fwd_ops.StepAdvance(call.state.step, step.saved) if spec.advances_step_count else None
        if spec.nobag:
            out = fwd_ops.sequence_forward(spec, call.state.weights, indices, offsets, call.B, advance)
        else:
            out = fwd_ops.pooled_forward(
                spec, call.state.weights, indices, offsets, per_sample_weights, call.B, call.warning, vbe, advance
            )
        if vbe_output is not None:
            ctx.mark_dirty(vbe_output)
        # Hoisted transpose: sort + run-length encode now (forward is often off the critical path
        # of the backward's communication), carried to backward on ctx.
        ctx.runs = transpose_ops.build_runs(spec, indices, offsets, call.B, vbe) if spec.hoist_transpose else None
        ctx.call = call
        ctx.hyper = hyper
        ctx.step = step
        ctx.vbe = vbe
        ctx.merged = vbe_output is not None
        # precompile's dry run records this thread's launches; its backward runs on autograd's thread.
        ctx.recording = launch_ops.recording_into()
        ctx.save_for_backward(indices, offsets, per_sample_weights, feature_requires_grad)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        into = ctx.recording
        if into is None or launch_ops.recording_into() is into:
            return TBEFunction._backward(ctx, grad_out)
        with launch_ops.recording(into):
            return TBEFunction._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out: torch.Tensor):
        indices, offsets, per_sample_weights, feature_requires_grad = ctx.saved_tensors
        call: LookupCall = ctx.call
        spec, state = call.spec, call.state
        # The forward's step count (StepVersion: always its own copy), and its learning rate and
        # hyper-parameters where they have moved since (HyperVersion): eager launches take them as
        # arguments; a replayed graph loads the count into its static slot and swaps lr / hyper in.
        step = ctx.step.saved
        assert step is not None, "a forward autograd recorded keeps its step count (TritonTBE.forward)"
        saved = {}
        if ctx.hyper.saved is not None:
            saved.update(learning_rate=ctx.hyper.saved[0], hyper=ctx.hyper.saved[1])
        if call.check_finite:
            bounds_ops.check_finite("grad_output", grad_out)
        passthrough = grad_out  # merged VBE: the other kernels' gradient, unclipped
        grad_out = grad_out.contiguous()
        if spec.optimizer.gradient_clipping:
            # FBGEMM clamps the output gradient first; the weights' and the per-sample weights'
            # gradients both follow from the clamped one.
            bound = spec.optimizer.max_gradient
            grad_out = grad_out.clamp(-bound, bound)
        grad_psw = None
        vbe = ctx.vbe
        if ctx.needs_input_grad[3]:
            grad_psw = bwd_ops.psw_grad(
                spec, state.weights, indices, offsets, grad_out, call.B, feature_requires_grad, vbe
            ).to(per_sample_weights.dtype)
        runs, ctx.runs = ctx.runs, None
        B = call.B
        if (
            runs is None
            and vbe is None  # its per-bag table is a per-call tensor: not a static input of a graph
            and call.on_runs is None
            and call.graphs is not None
            and graph_ops.BackwardGraphs.applies(spec, indices.numel(), grad_out.device)
        ):
            # Same device work as below, replayed from a CUDA graph (ops/graphs.py: launch-bound batches).
            def body(st, i, o, g, w):
                bwd_ops.backward_step(spec, st, None, i, o, g, w, B)

            # Not in precompile's dry run: its launches do not run, so they need no values swapped in, and
            # it writes no buffer of the module (ops/precompile.record_step).
            swaps = [] if launch_ops.recording_into() is not None else [
                (getattr(call.state, name), value) for name, value in saved.items()]
            with swapped_in(swaps) if swaps else contextlib.nullcontext():
                call.graphs.run(spec, call.state, indices, offsets, grad_out, per_sample_weights, step, B, body)
        else:
            state = dataclasses.replace(state, step=step, **saved)
            runs = bwd_ops.backward_step(spec, state, runs, indices, offsets, grad_out, per_sample_weights, B, vbe)
            if call.on_runs is not None:
                call.on_runs(runs)
        # Merged VBE: the gradient of the caller's buffer passes through to whatever wrote it before
        # (TorchRec's other kernels read only their own positions of it).
        return None, None, None, grad_psw, None, passthrough if ctx.merged else None, None, None, None, None


table_batched_embedding_bag = TBEFunction.apply
