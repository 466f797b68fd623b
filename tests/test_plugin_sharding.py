"""Routing and A/B equivalence: every supported sharding type, on 1 and 2 gloo ranks, trains the same
model and batches to the same losses, weights and optimizer state with our kernel as with ``fused``
(FBGEMM's CPU TBE), for SGD and row-wise Adagrad, int32 and int64 plans, every bounds-check mode, and
each plan option on and off (options spread over the cases)."""

import dataclasses

import pytest
import torch

import plugin_cases as pc
from plugin_cases import BoundsCheckMode, Case, EmbOptimType, TritonTBEOptions as Options, Variant
from torchrec_triton_tbe._fbgemm import SparseType
from torchrec_triton_tbe.plugin import TritonTBESharder, sharding as routing, use_fused, use_triton_tbe

from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

ADAGRAD, SGD = EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD
I32, I64 = torch.int32, torch.int64
WEIGHTED, FP16 = Variant(weighted=True), Variant(data_type=DataType.FP16)
SUPPORTED_MODES = [BoundsCheckMode.FATAL, BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE, BoundsCheckMode.NONE]

ONE_RANK = [
    Case("table_wise", ADAGRAD),
    Case("table_wise", SGD, Options(index_dtype=I32), kjt_dtype=I32),
    Case("row_wise", ADAGRAD, Options(hoist_transpose=True)),
    Case("row_wise", SGD, Options(index_dtype=I64, fused_bounds_check=True)),
    Case("column_wise", ADAGRAD, Options(index_dtype=I32, hoist_transpose=True, fused_bounds_check=True)),
    Case("column_wise", SGD),
    Case("table_row_wise", ADAGRAD, Options(kernel_config="sm90")),
    Case("table_row_wise", SGD, Options(hoist_transpose=True, precompile=False), kjt_dtype=I32),
    Case("table_wise", ADAGRAD, Options(fused_bounds_check=True, hoist_transpose=True), variant=WEIGHTED),
    Case("row_wise", SGD, Options(index_dtype=I32), variant=WEIGHTED),
    Case("column_wise", ADAGRAD, Options(hoist_transpose=True), variant=FP16),
    Case("table_column_wise", ADAGRAD, Options(index_dtype=I32, fused_bounds_check=True), kjt_dtype=I32),
    Case("table_column_wise", SGD, Options(hoist_transpose=True), variant=WEIGHTED),
    Case("grid_shard", ADAGRAD, Options(hoist_transpose=True, fused_bounds_check=True)),
    Case("grid_shard", SGD, Options(index_dtype=I32), variant=FP16),
]
TWO_RANKS = [
    Case("table_wise", ADAGRAD, Options(index_dtype=I32, fused_bounds_check=True), kjt_dtype=I32),
    Case("row_wise", SGD, Options(hoist_transpose=True)),
    Case("column_wise", ADAGRAD, Options(precompile=False)),
    Case("table_row_wise", ADAGRAD, Options(index_dtype=I32, hoist_transpose=True, fused_bounds_check=True)),
    Case("table_wise", SGD, Options(fused_bounds_check=True), bounds_check_mode=BoundsCheckMode.IGNORE, bad_ids=True),
    Case("column_wise", SGD, Options(hoist_transpose=True), variant=WEIGHTED),
    Case("table_column_wise", SGD, Options(index_dtype=I32), kjt_dtype=I32),
    Case("grid_shard", ADAGRAD, Options(hoist_transpose=True), variant=WEIGHTED),
]


def _id(case: Case) -> str:
    o = case.options
    flags = [str(o.index_dtype)[6:] if o.index_dtype else "", "hoist" if o.hoist_transpose else "",
             "fusedbc" if o.fused_bounds_check else "", o.kernel_config or "",
             case.bounds_check_mode.name if case.bounds_check_mode is not None else "",
             "bad-ids" if case.bad_ids else "", "weighted" if case.variant.weighted else "",
             "" if case.variant.data_type == DataType.FP32 else case.variant.data_type.name.lower(),
             f"kjt-{str(case.kjt_dtype)[6:]}"]
    return "-".join([case.sharding, case.optimizer.name.lower()] + [f for f in flags if f])


@pytest.fixture(scope="module")
def one_rank():
    pc.single_rank_pg()


@pytest.mark.parametrize("case", ONE_RANK, ids=_id)
def test_one_rank_matches_fused(one_rank, case):
    pc.run_case(case)


@pytest.mark.parametrize("fused_bounds_check", [False, True], ids=["separate-check", "fused-check"])
@pytest.mark.parametrize("mode", SUPPORTED_MODES, ids=lambda m: m.name)
def test_bounds_check_modes_match_fused(one_rank, mode, fused_bounds_check):
    """TorchRec's ParameterSharding.bounds_check_mode reaches both kernels. WARNING and IGNORE repair
    an out-of-range and a negative id (FBGEMM: id -> 0) identically; FATAL and NONE get valid ids."""
    repairing = mode in (BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE)
    case = Case(bounds_check_mode=mode, bad_ids=repairing, options=Options(fused_bounds_check=fused_bounds_check))
    ours, _ = pc.run_case(case)
    kernels = pc.kernels(ours)
    assert {k.emb_module.bounds_check_mode_int for k in kernels} == {mode.value}
    assert {k.emb_module.spec.fused_bounds_check for k in kernels} == {fused_bounds_check}
    warned = sum(int(k.emb_module.bounds_check_warning.item()) for k in kernels)
    assert (warned > 0) == (mode == BoundsCheckMode.WARNING), warned


def test_fatal_mode_refuses_bad_ids(one_rank):
    fused_plan, our_plan = Case(bounds_check_mode=BoundsCheckMode.FATAL).plans(1)
    sharder = pc.TritonTBESharder(fused_params=pc.fused_params(ADAGRAD))
    for plan, error in ((our_plan, ValueError), (fused_plan, RuntimeError)):
        dmp = pc.make_dmp(plan, sharder)
        with pytest.raises(error):
            dmp(pc.batch(pc.TABLES, 0, bad_ids=True))


def test_fbgemms_v2_bounds_check_modes_run_as_the_first_three(one_rank):
    """FBGEMM's V2_* modes are its second implementation of IGNORE / WARNING / FATAL, which its TBE runs
    as those; so does ours (and V2_FATAL still refuses bad ids, V2_WARNING counts them)."""
    others = [m for m in BoundsCheckMode if m not in SUPPORTED_MODES]
    assert sorted(m.name for m in others) == ["V2_FATAL", "V2_IGNORE", "V2_WARNING"]
    for mode in others:
        _, our_plan = Case(bounds_check_mode=mode).plans(1)
        dmp = pc.make_dmp(our_plan, pc.TritonTBESharder(fused_params=pc.fused_params(ADAGRAD)))
        as_run = BoundsCheckMode[mode.name[len("V2_"):]]
        assert {k.emb_module.bounds_check_mode_int for k in pc.kernels(dmp)} == {as_run.value}
        bad = pc.batch(pc.TABLES, 0, bad_ids=True)
        if as_run == BoundsCheckMode.FATAL:
            with pytest.raises(ValueError, match="bounds check"):
                dmp(bad)
        else:
            dmp(bad)
            warned = sum(int(k.emb_module.bounds_check_warning.item()) for k in pc.kernels(dmp))
            assert (warned > 0) == (as_run == BoundsCheckMode.WARNING), warned


def test_two_ranks_match_fused():
    pc.spawn(pc.run_cases, 2, TWO_RANKS)


def test_every_option_value_is_covered():
    cases = ONE_RANK + TWO_RANKS
    for field, values in (("index_dtype", {None, I32, I64}), ("hoist_transpose", {False, True}),
                          ("fused_bounds_check", {False, True}), ("precompile", {False, True})):
        assert {getattr(c.options, field) for c in cases} == values, field
    assert {c.sharding for c in ONE_RANK} == {c.sharding for c in TWO_RANKS} == set(routing.SUPPORTED_SHARDING_TYPES)
    assert {c.optimizer for c in ONE_RANK} == {c.optimizer for c in TWO_RANKS} == {SGD, ADAGRAD}
    assert {c.kjt_dtype for c in ONE_RANK} == {I32, I64}
    assert {c.variant.weighted for c in ONE_RANK} == {c.variant.weighted for c in TWO_RANKS} == {False, True}


# ---------------------------------------------------------------------------------------------- resharding
def test_reshard_moves_our_tables_like_fused(one_rank):
    """DistributedModelParallel.reshard (TorchRec's dynamic resharding) with a delta of plain entries, as
    TorchRec makes them: our tables stay on our kernel with their plan options, and training before and
    after matches fused (plugin_cases.reshard_ab; on one gloo rank, its sends to itself emulated). Before
    the sharder upgraded the delta, TorchRec installed the plain entries and failed in the state it rebuilds."""
    pc.reshard_ab(0, 1)


REFUSED_DELTAS = {
    "ours-to-fused": (r"resharding table 't0' from compute kernel .*reshard moves shards", NotImplementedError),
    "fused-to-ours": (r"resharding table 't0' from compute kernel .*reshard moves shards", NotImplementedError),
    "other-options": (r"resharding table 't0' with options .*keeps the kernel TorchRec built", NotImplementedError),
    "unknown-table": (r"names tables \['t9'\] that this module does not have", KeyError),
}


@pytest.mark.parametrize("delta_kind", list(REFUSED_DELTAS))
def test_reshard_refuses_what_it_cannot_do_before_moving_anything(one_rank, delta_kind):
    """A delta moving a table onto or off our kernel, giving one of ours other options (TorchRec keeps the
    kernel it built with the first ones), or naming a table the module lacks: refused, the module as before."""
    variant = Variant(dense=True)
    fused_plan, our_plan = Case(variant=variant).plans(1)
    start = fused_plan if delta_kind == "fused-to-ours" else our_plan
    dmp = pc.make_dmp(start, TritonTBESharder(fused_params=pc.fused_params(ADAGRAD)), variant)
    before = {k: pc.local(v).clone() for k, v in dmp.state_dict().items()}
    kernel = "fused" if delta_kind == "ours-to-fused" else "customized_kernel"
    delta = construct_module_sharding_plan(pc.Model(variant).ebc, {t.name: table_wise(rank=0, compute_kernel=kernel)
                                                                    for t in pc.TABLES},
                                           sharder=TritonTBESharder(), local_size=1, world_size=1, device_type="cpu")
    if delta_kind == "other-options":
        delta = use_triton_tbe(delta, options=Options(check_finite=True))
    if delta_kind == "unknown-table":
        delta["t9"] = delta.pop("t2")
    match, error = REFUSED_DELTAS[delta_kind]
    with pytest.raises(error, match=match):
        dmp.reshard({"ebc": (0.0, delta)}, "ebc")
    assert dmp.module.ebc.module_sharding_plan == start
    pc.assert_routed(dmp, expect_ours=delta_kind != "fused-to-ours")
    after = dmp.state_dict()
    assert sorted(after) == sorted(before) and all(torch.equal(pc.local(after[k]), v) for k, v in before.items())
    pc.train(dmp, 1, 0)


# ---------------------------------------------------------------------------------------------- routing
def test_routing_installed_once():
    for cls in (GroupedPooledEmbeddingsLookup, GroupedEmbeddingsLookup):
        wrapped = cls.__dict__["_create_embedding_kernel"]
        routing.install()
        assert cls.__dict__["_create_embedding_kernel"] is wrapped
        assert not hasattr(getattr(wrapped, routing._PATCHED), routing._PATCHED)  # wraps the original
    assert routing.installed()


@dataclasses.dataclass
class _OtherPluginSharding(ParameterSharding):
    def get_additional_fused_params(self):
        return {"customized_compute_kernel": "other_plugin"}


def test_other_customized_kernels_reach_torchrec_untouched(one_rank):
    plan = pc.base_plan("table_wise", 1)
    plan["t0"] = _OtherPluginSharding(**{f.name: getattr(plan["t0"], f.name)
                                        for f in dataclasses.fields(ParameterSharding)})
    plan["t0"].compute_kernel = "customized_kernel"
    with pytest.raises(ValueError, match="Compute kernel not supported"):
        pc.make_dmp(plan, pc.TritonTBESharder())


def test_torchrecs_own_sequence_sharder_is_refused_for_our_tables(one_rank):
    """The routing wraps TorchRec's sequence lookup too, but a plan entry with our marker under TorchRec's
    stock EmbeddingCollectionSharder is refused: TorchRec's collection would build our kernel but none of
    TorchRec's state for its tables (plain tensors in state_dict, no weight on a rank without a shard)."""
    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="s0", embedding_dim=8, num_embeddings=20, feature_names=["g0"])],
        device=torch.device("meta"),
    )
    plan = construct_module_sharding_plan(ec, {"s0": table_wise(rank=0)}, sharder=EmbeddingCollectionSharder(),
                                          local_size=1, world_size=1, device_type="cpu")
    with pytest.raises(ValueError, match=r"tables \['s0'\] are planned on the Triton TBE kernel.*"
                                         r"TritonTBEEmbeddingCollectionSharder"):
        DistributedModelParallel(
            torch.nn.Sequential(ec), env=ShardingEnv.from_process_group(torch.distributed.group.WORLD),
            device=torch.device("cpu"), plan=ShardingPlan({"0": use_triton_tbe(plan)}),
            sharders=[EmbeddingCollectionSharder()],
        )


def test_torchrecs_own_sharder_is_refused_for_our_tables(one_rank):
    """The same for an EmbeddingBagCollection: our sharder given but TorchRec's default sharders listed
    after it (a later sharder for a module type replaces an earlier one), or TorchRec's alone."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    plan = use_triton_tbe(pc.base_plan("table_wise", 1))
    params = pc.fused_params(ADAGRAD)
    for sharders in ([EmbeddingBagCollectionSharder(fused_params=params)],
                     [TritonTBESharder(fused_params=params), EmbeddingBagCollectionSharder(fused_params=params)]):
        with pytest.raises(ValueError, match=r"are planned on the Triton TBE kernel.*TritonTBESharder"):
            DistributedModelParallel(
                pc.Model(Variant()), env=ShardingEnv.from_process_group(torch.distributed.group.WORLD),
                device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=sharders,
            )
    pc.make_dmp(plan, TritonTBESharder(fused_params=params))  # ours alone builds


def _output_dtype_and_eval(rank: int, world_size: int) -> None:
    """fused_params output_dtype=FP16 (TorchRec's half-precision pooled outputs) trains like fused, and an
    eval-mode forward under no_grad (no backward, no update) returns fused's outputs."""
    from torchrec_triton_tbe._fbgemm import SparseType

    plan = pc.base_plan("row_wise", world_size)
    sharder = TritonTBESharder(fused_params=pc.fused_params(EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                            output_dtype=SparseType.FP16))
    results = []
    for kernel_plan in (use_fused(plan), use_triton_tbe(plan)):
        dmp = pc.make_dmp(kernel_plan, sharder)
        losses = pc.train(dmp, 2, rank)
        before = {k: pc.local(v).clone() for k, v in dmp.state_dict().items()}
        dmp.eval()
        with torch.no_grad():
            evaluated = dmp(pc.batch(pc.TABLES, 9, rank))
        after = {k: pc.local(v) for k, v in dmp.state_dict().items()}
        assert all(torch.equal(before[k], after[k]) for k in before), "an eval forward changed the weights"
        results.append((losses, evaluated.float(), dmp))
    (fl, fe, fused), (ol, oe, ours) = results
    pc.assert_routed(ours, expect_ours=True)
    for k in pc.kernels(ours):
        assert SparseType.from_int(k.emb_module.output_dtype) == SparseType.FP16  # FBGEMM's int form
    pc.assert_close(torch.tensor(ol), torch.tensor(fl), "fp16-output losses", *pc.TOLERANCE[pc.DataType.FP16])
    pc.assert_close(oe, fe, "eval outputs", *pc.TOLERANCE[pc.DataType.FP16])
    pc.assert_same_state(ours, fused, "fp16 output", *pc.TOLERANCE[pc.DataType.FP16])


def test_fp16_outputs_and_eval_forward_match_fused(one_rank):
    _output_dtype_and_eval(0, 1)


def test_fp16_outputs_and_eval_forward_two_ranks():
    pc.spawn(_output_dtype_and_eval, 2)
