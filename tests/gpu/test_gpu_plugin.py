"""TorchRec on the GPU (needs torchrec and FBGEMM's CUDA TBE: ../shared/tools/stage-fbgemm-gpu): for
every optimizer FBGEMM can run under TorchRec, the DLRM A/B of torchrec_triton_tbe.torchrec_demo trains the same plan on ``fused``
and on our kernel to the same losses, weights and fused-optimizer state, with the checkpoint
interchanged both ways (fused -> ours before the first step, ours -> fused after the last; exact), on
table-wise and a second sharding type per optimizer (all six types covered)."""

import pytest

pytest.importorskip("torchrec", reason="TorchRec is not installed on this GPU machine (stage it first)")

from torchrec_triton_tbe import torchrec_demo  # noqa: E402
from torchrec_triton_tbe.demo import OPTIMIZERS  # noqa: E402

OTHER = ("row_wise", "column_wise", "table_row_wise", "table_column_wise", "grid_shard")
# FBGEMM's LARS_SGD cannot back TorchRec's fused optimizer: its get_optimizer_state raises
# ("Getting optimizer state lars_sgd is not implmeneted", fbgemm-gpu 1.6.0 on the H200), so DMP cannot be
# built on `fused` with it. Ours can (tests/test_plugin_optimizers.py trains it against the reference).
WITH_FUSED = sorted(o for o in OPTIMIZERS if o != "lars_sgd")
CASES = [(opt, sharding) for i, opt in enumerate(WITH_FUSED) for sharding in ("table_wise", OTHER[i % len(OTHER)])]


@pytest.mark.parametrize("optimizer,sharding", CASES, ids=[f"{o}-{s}" for o, s in CASES])
def test_demo_matches_fused_with_checkpoint_interchange(optimizer, sharding):
    argv = ["--loop", "plain", "--optimizer", optimizer, "--sharding", sharding, "--steps", "4", "--batch-size", "2048",
            "--num-embeddings", "50000", "--embedding-dim", "64", "--learning-rate", "0.01"]
    assert torchrec_demo.main(argv) == 0


MODES = [("--sequence", "rowwise_adagrad", "table_wise"), ("--sequence", "adam", "row_wise"),
         ("--vbe", "rowwise_adagrad", "table_wise"), ("--vbe", "sgd", "row_wise"),
         ("--vbe", "adam", "column_wise")]
# Plain SGD diverges on this VBE model on both kernels alike (H200: step-0 loss ~5e4 on fused and ours,
# against ~0.67 for the CPU's all-SUM VBE; at lr 0.01 NaN by step 3, with the same difference when
# PyTorch's caching allocator is off, so not stale memory; at 1e-4 the loss reaches 2.5e16 by step 3,
# 1bcbf99), so past two steps the comparison measures chaos. Two steps at 1e-4 agreed to 4.7e-6
# (tolerance 1e-4, ac29bed). Why the step-0 loss is that large on the GPU is not found yet.
LEARNING_RATE = {"sgd": "0.0001"}
STEPS = {"sgd": "2"}


@pytest.mark.parametrize("mode,optimizer,sharding", MODES, ids=[f"{m[2:]}-{o}-{s}" for m, o, s in MODES])
def test_sequence_and_vbe_demo_match_fused(mode, optimizer, sharding):
    """Issue 11 on the GPU: an EmbeddingCollection of sequence tables next to the bags (--sequence), and
    variable-batch KJTs (--vbe: on the GPU both pooling modes, so TorchRec merges several kernel groups
    into one vbe_output), on ``fused`` and on ours: same losses, weights and optimizer state, with the
    checkpoint interchanged both ways."""
    argv = [mode, "--loop", "plain", "--optimizer", optimizer, "--sharding", sharding, "--steps", STEPS.get(optimizer, "4"),
            "--batch-size", "1024",
            "--num-embeddings", "20000", "--embedding-dim", "64", "--learning-rate", LEARNING_RATE.get(optimizer, "0.01")]
    assert torchrec_demo.main(argv) == 0


@pytest.mark.parametrize("loop", ["semi-sync", "base"])
def test_demo_in_other_train_pipelines_matches_fused(loop):
    """TorchRec's TrainPipelineSemiSync (from the first batch: each batch looks up weights one update
    older, with fused as with ours; CUDA only in TorchRec) and TrainPipelineBase. Not yet run."""
    argv = ["--loop", loop, "--sharding", "mixed", "--steps", "6", "--batch-size", "2048", "--num-embeddings", "50000",
            "--embedding-dim", "64", "--learning-rate", "0.01"]
    assert torchrec_demo.main(argv) == 0


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "mixed"])
def test_demo_in_the_train_pipeline_matches_fused(sharding):
    """The demo's default loop, TorchRec's TrainPipelineSparseDist (the plain loop above is what the
    other cases ran with before it became the default), on one GPU. Not yet run on the device."""
    argv = ["--sharding", sharding, "--steps", "6", "--batch-size", "2048", "--num-embeddings", "50000",
            "--embedding-dim", "64", "--learning-rate", "0.01"]
    assert torchrec_demo.main(argv) == 0


def test_reshard_on_nccl_matches_fused():
    """DistributedModelParallel.reshard (TorchRec's dynamic resharding) on one NCCL rank, whose shards move
    onto the rank itself (NCCL sends to itself; gloo cannot, so the CPU test emulates it): our tables keep
    our kernel and options, and training before and after matches fused (tests/plugin_cases.py:
    reshard_ab). tests/gpu/test_gpu_multi.py moves them between two GPUs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import plugin_cases as pc

    pc.spawn(pc.reshard_ab, 1, "cuda", backend="nccl")
