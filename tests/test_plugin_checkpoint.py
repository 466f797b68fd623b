"""Distributed checkpoints (torch.distributed.checkpoint) of models on our kernel: saved on two gloo
ranks, loaded into another plan (table-wise -> row-wise, row-wise -> table-row-wise), into another
kernel (fused -> ours, ours -> fused), and into one rank; training continued after a load equals
training without the interruption (same ranks) and matches fused loaded from the same checkpoint
(one rank)."""

import os

import pytest
import torch

import plugin_cases as pc

RESHARDS = [
    (("table_wise", "triton"), ("row_wise", "triton")),
    (("row_wise", "triton"), ("table_row_wise", "triton")),
    (("table_wise", "fused"), ("row_wise", "triton")),
    (("row_wise", "triton"), ("table_wise", "fused")),
]


@pytest.mark.parametrize("src,dst", RESHARDS, ids=[f"{s[0]}-{s[1]}-to-{d[0]}-{d[1]}" for s, d in RESHARDS])
def test_two_rank_checkpoint_loads_into_another_plan_and_kernel(tmp_path, src, dst):
    pc.spawn(pc.dcp_reshard, 2, str(tmp_path), src, dst)
    assert (tmp_path / "full_state.pt").is_file() and (tmp_path / ".metadata").is_file()


def test_two_rank_checkpoint_loads_on_one_rank(tmp_path):
    """2 ranks -> 1 rank: written by ours (row-wise over both ranks), read on one rank by ours
    (table-wise) and by fused; both then train alike."""
    pc.spawn(pc.dcp_reshard, 2, str(tmp_path), ("row_wise", "triton"), ("table_wise", "triton"))
    pg = pc.single_rank_pg()
    assert pg is not None
    saved = torch.load(os.path.join(tmp_path, "full_state.pt"))
    ours = pc.dcp_load(str(tmp_path), "table_wise", "triton", 1, saved)
    fused = pc.dcp_load(str(tmp_path), "table_wise", "fused", 1, saved)
    pc.assert_close(torch.tensor(pc.train(ours, 2, 0, first_step=2)), torch.tensor(pc.train(fused, 2, 0, first_step=2)),
                    "losses on one rank after the load")
    pc.assert_same_state(ours, fused, "one rank after the load and two steps")
