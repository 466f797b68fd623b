"""The public sharder and plan API: planner support (constraints pick our kernel exactly where asked),
plan entries and rewriting, the sharder's upgrade of plain entries, multi-rank state_dict layout and
checkpoint interchange with ``fused``, sequence embeddings refused, and the torchrec versions."""

import dataclasses
import inspect

import pytest
import torch

import plugin_cases as pc
from plugin_cases import EmbOptimType, TritonTBEOptions, TritonTBESharder, use_fused, use_triton_tbe
from torchrec_triton_tbe.plugin import (
    TritonTBEEmbeddingBag,
    TritonTBEEmbeddingCollectionSharder,
    TritonTBEParameterSharding,
)
from torchrec_triton_tbe.plugin import sharding as routing
from torchrec_triton_tbe.plugin.options import HOIST_TRANSPOSE_KEY

import torchrec
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner import enumerators, shard_estimators
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ParameterSharding, ShardedTensor, ShardingEnv2D, ShardingPlan, ShardingStrategy
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
ADAGRAD = EmbOptimType.EXACT_ROWWISE_ADAGRAD


@pytest.fixture(scope="module")
def one_rank():
    pc.single_rank_pg()


def _constraints(**per_table):
    return {t: ParameterConstraints(compute_kernels=[CUSTOMIZED], **kw) for t, kw in per_table.items()}


# ---------------------------------------------------------------------------------------------- planner
@pytest.mark.parametrize("world_size,t2_sharding", [(1, "column_wise"), (2, "column_wise"), (2, "table_column_wise")])
def test_planner_picks_our_kernel_exactly_for_constrained_tables(world_size, t2_sharding):
    constraints = _constraints(t0={}, t2={"sharding_types": [t2_sharding]})
    planner = EmbeddingShardingPlanner(Topology(world_size=world_size, compute_device="cpu"), constraints=constraints)
    plan = planner.plan(pc.Model(), [TritonTBESharder()]).plan["ebc"]
    assert {t: ps.compute_kernel for t, ps in plan.items()} == {
        "t0": CUSTOMIZED, "t1": plan["t1"].compute_kernel, "t2": CUSTOMIZED}
    assert plan["t1"].compute_kernel != CUSTOMIZED
    assert plan["t2"].sharding_type == t2_sharding
    # Unconstrained planning never picks it, though the sharder advertises it (guarded).
    free = EmbeddingShardingPlanner(Topology(world_size=world_size, compute_device="cpu"))
    free_plan = free.plan(pc.Model(), [TritonTBESharder()]).plan["ebc"]
    assert all(ps.compute_kernel != CUSTOMIZED for ps in free_plan.values())


def test_planned_model_trains_with_sharder_options(one_rank):
    """The planner emits plain ParameterSharding entries; the sharder upgrades them with its options,
    and the planned model trains exactly like the same plan on fused."""
    topology = Topology(world_size=1, compute_device="cpu")
    planner = EmbeddingShardingPlanner(topology, constraints=_constraints(t0={}, t1={}))
    plan = planner.plan(pc.Model(), [TritonTBESharder()]).plan["ebc"]
    assert type(plan["t0"]) is ParameterSharding
    options = TritonTBEOptions(hoist_transpose=True, fused_bounds_check=True, check_finite=True)
    sharder = TritonTBESharder(fused_params=pc.fused_params(ADAGRAD), options=options)
    ours = pc.make_dmp(plan, sharder)
    fused = pc.make_dmp(use_fused(plan), sharder)
    by_table = {t.name: k for k in pc.kernels(ours) for t in k.config.embedding_tables}
    assert isinstance(by_table["t0"], TritonTBEEmbeddingBag) and by_table["t0"].options == options
    assert by_table["t0"].emb_module.check_finite
    assert isinstance(by_table["t1"], TritonTBEEmbeddingBag)
    assert not isinstance(by_table.get("t2"), TritonTBEEmbeddingBag)  # unconstrained: TorchRec's choice
    assert isinstance(ours.module.ebc.module_sharding_plan["t0"], TritonTBEParameterSharding)
    pc.assert_close(torch.tensor(pc.train(ours, 2, 0)), torch.tensor(pc.train(fused, 2, 0)), "planned losses")
    pc.assert_same_state(ours, fused, "planned")


def test_planner_bandwidth_matches_fused_and_kernel_is_guarded():
    assert EmbeddingComputeKernel.CUSTOMIZED_KERNEL in enumerators.GUARDED_COMPUTE_KERNELS
    bandwidths = EmbeddingPerfEstimatorConfig.kernel_device_bandwidths
    assert {("cpu", CUSTOMIZED), ("cuda", CUSTOMIZED)} <= set(bandwidths)
    # With both kernels allowed, the estimator rates ours like fused: selected, never preferred.
    topology = Topology(world_size=1, compute_device="cpu")
    constraints = {"t0": ParameterConstraints(compute_kernels=[CUSTOMIZED, "fused"], sharding_types=["table_wise"])}
    options = EmbeddingEnumerator(topology, batch_size=512, constraints=constraints).enumerate(
        pc.Model(), [TritonTBESharder()])
    perf = {o.compute_kernel: o.total_perf for o in options if o.name == "t0"}
    assert set(perf) == {CUSTOMIZED, "fused"} and perf[CUSTOMIZED] == pytest.approx(perf["fused"])
    storage = {o.compute_kernel: o.total_storage for o in options if o.name == "t0"}
    assert storage[CUSTOMIZED] == storage["fused"]


# ---------------------------------------------------------------------------------------------- plan entries
def test_parameter_sharding_validates_itself():
    spec = dict(sharding_type="table_wise", ranks=[0])
    entry = TritonTBEParameterSharding(**spec, hoist_transpose=True)
    assert entry.compute_kernel == CUSTOMIZED and entry.get_additional_fused_params()[HOIST_TRANSPOSE_KEY] is True
    with pytest.raises(ValueError, match="compute_kernel"):
        TritonTBEParameterSharding(**spec, compute_kernel="fused")
    with pytest.raises(ValueError, match="customized_compute_kernel"):
        TritonTBEParameterSharding(**spec, customized_compute_kernel="other")
    with pytest.raises(NotImplementedError, match="data_parallel"):
        TritonTBEParameterSharding(sharding_type="data_parallel")
    with pytest.raises(TypeError, match="TritonTBEOptions"):
        TritonTBEParameterSharding(**spec, hoist_transpose="yes")


def test_plan_rewriting():
    plan = pc.base_plan("table_wise", 1)
    options = TritonTBEOptions(index_dtype=torch.int32)
    ours = use_triton_tbe(plan, tables=["t1"], options=options)
    assert isinstance(ours["t1"], TritonTBEParameterSharding) and ours["t1"].options == options
    assert ours["t0"] is plan["t0"] and ours["t1"].sharding_spec == plan["t1"].sharding_spec
    back = use_fused(ours)
    assert all(type(ps) is ParameterSharding and ps.compute_kernel == "fused" for ps in back.values())
    assert back["t1"].ranks == plan["t1"].ranks
    whole = use_triton_tbe(ShardingPlan({"ebc": plan}))
    assert all(isinstance(ps, TritonTBEParameterSharding) for ps in whole.plan["ebc"].values())
    with pytest.raises(KeyError, match="t9"):
        use_triton_tbe(plan, tables=["t9"])
    dp = dict(plan)
    dp["t0"] = dataclasses.replace(plan["t0"], sharding_type="data_parallel", compute_kernel="dense")
    dp = type(plan)(dp)
    assert use_triton_tbe(dp)["t0"] is dp["t0"]  # data-parallel tables keep TorchRec's dense kernel
    with pytest.raises(NotImplementedError, match="data_parallel"):
        use_triton_tbe(dp, tables=["t0"])


def test_two_dimensional_plan_generators():
    """plugin.plans: table-column-wise relabels column_wise's shards; grid_shard splits narrow tables into
    column blocks, each row-wise over the host, and refuses widths that do not split into multiples of 4."""
    from torchrec_triton_tbe.plugin import grid_shard, table_column_wise

    plan = pc.base_plan("table_column_wise", 2)
    assert {ps.sharding_type for ps in plan.values()} == {"table_column_wise"}
    assert [s.shard_offsets for s in plan["t1"].sharding_spec.shards] == [[0, 0], [0, 8]]
    assert plan["t1"].ranks == [0, 1]
    grid = pc.base_plan("grid_shard", 2)["t1"]  # 20 rows x 16 columns, one host of two ranks
    assert grid.sharding_type == "grid_shard" and grid.ranks == [0, 1, 0, 1]
    assert [(s.shard_sizes, s.shard_offsets) for s in grid.sharding_spec.shards] == [
        ([10, 8], [0, 0]), ([10, 8], [10, 0]), ([10, 8], [0, 8]), ([10, 8], [10, 8])]
    for blocks, match in ((3, "do not split into 3 blocks"), (4, "do not split into 4 blocks")):
        with pytest.raises(ValueError, match=match):
            construct_module_sharding_plan(pc.Model().ebc, {t.name: grid_shard(blocks=blocks) for t in pc.TABLES},
                                           sharder=TritonTBESharder(), local_size=1, world_size=1, device_type="cpu")
    with pytest.raises(ValueError, match="blocks must be >= 1"):
        grid_shard(blocks=0)
    assert callable(table_column_wise(ranks=[0]))


def test_sharder_arguments_and_upgrade():
    with pytest.raises(ValueError, match="reach FBGEMM"):
        TritonTBESharder(fused_params={HOIST_TRANSPOSE_KEY: True})
    with pytest.raises(TypeError, match="TritonTBEOptions"):
        TritonTBESharder(options={"hoist_transpose": True})
    sharder = TritonTBESharder(options=TritonTBEOptions(hoist_transpose=True))
    assert CUSTOMIZED in sharder.compute_kernels("table_wise", "cpu")
    assert CUSTOMIZED not in sharder.compute_kernels("data_parallel", "cpu")
    assert CUSTOMIZED in sharder.compute_kernels("table_column_wise", "cpu")
    assert CUSTOMIZED in sharder.compute_kernels("grid_shard", "cuda")
    plain = dataclasses.replace(pc.base_plan("row_wise", 1)["t0"], compute_kernel=CUSTOMIZED)
    assert sharder._upgrade("t0", plain).options == sharder.options
    own = TritonTBEParameterSharding.from_sharding(plain, TritonTBEOptions(fused_bounds_check=True))
    assert sharder._upgrade("t0", own) is own
    with pytest.raises(NotImplementedError, match="'t0'.*data_parallel"):
        sharder._upgrade("t0", dataclasses.replace(plain, sharding_type="data_parallel"))


def test_fully_sharded_two_dimensional_parallel_is_refused():
    # FULLY_SHARDED replaces FBGEMM kernels by TorchRec's reduce-scatter class; refused before anything is
    # built. DEFAULT / PER_MODULE 2D parallel runs (tests/test_plugin_2d.py).
    env = ShardingEnv2D.__new__(ShardingEnv2D)
    env.sharding_strategy = ShardingStrategy.FULLY_SHARDED
    with pytest.raises(NotImplementedError, match=r"tables \['t0', 't1', 't2'\].*FULLY_SHARDED"):
        TritonTBESharder().shard(pc.Model().ebc, use_triton_tbe(pc.base_plan("table_wise", 1)), env)


# ---------------------------------------------------------------------------------------------- state and checkpoints
def test_state_dict_layout_needs_the_relabel_fix(one_rank):
    """TorchRec's own sharded collection skips CUSTOMIZED tables when it builds ShardedTensors; ours
    relabels them so state_dict() holds ShardedTensors as with fused. TorchRec's collection is therefore
    refused for our tables (sharding._ours); past that guard it shows what the guard prevents."""

    class StockSharder(TritonTBESharder):
        def shard(self, module, params, env, device=None, module_fqn=None):
            params = {t: self._upgrade(t, ps) for t, ps in params.items()}
            return EmbeddingBagCollectionSharder.shard(self, module, params, env, device, module_fqn)

    plan = use_triton_tbe(pc.base_plan("table_wise", 1))
    with pytest.raises(ValueError, match="not this plugin's"):
        pc.make_dmp(plan, StockSharder())
    with routing.building_our_lookups():
        stock = pc.make_dmp(plan, StockSharder())
    assert type(stock.module.ebc) is ShardedEmbeddingBagCollection
    assert not isinstance(stock.state_dict()["ebc.embedding_bags.t0.weight"], ShardedTensor)
    ours = pc.make_dmp(plan, TritonTBESharder())
    assert isinstance(ours.state_dict()["ebc.embedding_bags.t0.weight"], ShardedTensor)
    assert all(isinstance(ps, TritonTBEParameterSharding) for ps in ours.module.ebc.module_sharding_plan.values())


def _two_rank_checkpoints(rank, world_size):
    for sharding in routing.SUPPORTED_SHARDING_TYPES:
        pc.checkpoint_interchange(rank, world_size, sharding)


def test_two_rank_checkpoints_interchange_with_fused():
    """Per rank: same state_dict keys and ShardedTensor layout (offsets, sizes, placements) as fused;
    a checkpoint of either loads into the other (weights and row-wise state) and training continues
    identically."""
    pc.spawn(_two_rank_checkpoints, 2)


# ---------------------------------------------------------------------------------------------- sequence embeddings
def _model_with_sequence():
    model = pc.Model()
    model.ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="s0", embedding_dim=8, num_embeddings=20, feature_names=["g0"])],
        device=torch.device("meta"),
    )
    return model


def test_planner_picks_our_kernel_for_constrained_sequence_tables():
    """With the sequence sharder in the list, the planner plans a constrained EmbeddingCollection table on
    customized_kernel (and the pooled sharder refuses a sequence module, pointing to it)."""
    with pytest.raises(TypeError, match="TritonTBEEmbeddingCollectionSharder"):
        TritonTBESharder().shardable_parameters(_model_with_sequence().ec)
    planner = EmbeddingShardingPlanner(Topology(world_size=1, compute_device="cpu"), constraints=_constraints(s0={}))
    plan = planner.plan(_model_with_sequence(), [TritonTBESharder(), TritonTBEEmbeddingCollectionSharder()])
    assert plan.plan["ec"]["s0"].compute_kernel == CUSTOMIZED
    # Without our sequence sharder nothing offers customized_kernel for the table: planning fails on it.
    with pytest.raises(RuntimeError, match="s0"):
        planner.plan(_model_with_sequence(), [TritonTBESharder(), EmbeddingCollectionSharder()])


# ---------------------------------------------------------------------------------------------- versions
# torchrec 1.6.1 (GPU image) and 1.9.2 (CPU CI) differ, where this plugin is concerned, in how the
# planner estimates storage: 1.6.1 asks the sharder (sharder.storage_usage), 1.9.2 calls
# compute_storage_usage on a SharderData snapshot. Both must count our tables like fused ones.
STORAGE_PATH = {"1.6.1": "sharder.storage_usage", "1.9.2": "compute_storage_usage"}


def test_storage_estimate_branch_for_installed_torchrec():
    params = inspect.signature(shard_estimators.calculate_shard_storages).parameters
    taken = "sharder.storage_usage" if "sharder" in params else "compute_storage_usage"
    assert torchrec.__version__ in STORAGE_PATH, f"unpinned torchrec {torchrec.__version__}: check the planner path"
    assert taken == STORAGE_PATH[torchrec.__version__]
    table = pc.TABLES[0]
    tensor = torch.empty(table.num_embeddings, table.embedding_dim)
    expected = {"ddr": tensor.numel() * 4}
    if taken == "sharder.storage_usage":
        assert TritonTBESharder().storage_usage(tensor, "cpu", CUSTOMIZED) == expected
    else:
        from torchrec.distributed.types import StorageUsageType, compute_storage_usage

        assert compute_storage_usage(tensor, "cpu", CUSTOMIZED, StorageUsageType.BASE) == expected
