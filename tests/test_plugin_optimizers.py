"""Every optimizer through TorchRec (gloo, CPU): the fused optimizer's state keys and sharded layouts,
learning-rate schedulers and hyper-parameter updates, checkpoints, training results.

Oracles: ``fused`` (FBGEMM's CPU TBE) for the optimizers it implements on a CPU (EXACT_SGD and row-wise
Adagrad in test_plugin_sharding.py, EXACT_ADAGRAD here: A/B and checkpoint interchange both ways on
every sharding type, 1 and 2 ranks). For the others FBGEMM has no CPU kernel, so a model trained
through the plugin is compared with the pure-PyTorch reference trained on the same batches (every
table, weights and every state tensor, per sharding type), its fused optimizer state must carry
FBGEMM's keys (what ``fused`` shows on a GPU) with the weights' sharded layout, and a checkpoint of it
must reload and train on identically; tests/gpu/test_gpu_plugin.py runs the interchange with ``fused``
on the GPU for every optimizer.
"""

import copy

import pytest
import torch

import plugin_cases as pc
from plugin_cases import Case, EmbOptimType, TritonTBESharder, Variant, use_triton_tbe
from tbe_cases import checked_optimizer_spec
from torchrec_triton_tbe.reference import ReferenceTBE

ADAGRAD = EmbOptimType.EXACT_ADAGRAD
SUM_ONLY = Variant(weighted=True)  # every table SUM (the reference pools all features one way)
# optimizer -> (extra fused_params, the fused optimizer state keys per table after "momentum1")
OPTIMIZERS = {
    EmbOptimType.ADAM: (dict(beta1=0.8, beta2=0.95, weight_decay=0.01), ["exp_avg_sq"]),
    EmbOptimType.PARTIAL_ROWWISE_ADAM: (dict(weight_decay=0.01), ["exp_avg_sq"]),
    EmbOptimType.LAMB: (dict(weight_decay=0.01), ["exp_avg_sq"]),
    EmbOptimType.PARTIAL_ROWWISE_LAMB: ({}, ["exp_avg_sq"]),
    EmbOptimType.LARS_SGD: (dict(eta=0.05, momentum=0.8), []),
    EmbOptimType.EXACT_ADAGRAD: ({}, []),
}
# Column-wise shards keep their own row norms and row-wise state (with fused too): only optimizers
# without row-wise coupling equal the unsharded reference there.
ELEMENTWISE = {EmbOptimType.ADAM, EmbOptimType.EXACT_ADAGRAD}


@pytest.fixture(scope="module")
def one_rank():
    pc.single_rank_pg()


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise", "column_wise", "table_row_wise"])
def test_exact_adagrad_matches_fused(one_rank, sharding):
    pc.run_case(Case(sharding, ADAGRAD))


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise"])
def test_exact_adagrad_checkpoints_interchange_with_fused(one_rank, sharding):
    pc.checkpoint_interchange(0, 1, sharding, ADAGRAD)


def _two_ranks_adagrad(rank, world_size):
    pc.run_cases(rank, world_size, [Case("row_wise", ADAGRAD), Case("column_wise", ADAGRAD)])
    pc.checkpoint_interchange(rank, world_size, "table_wise", ADAGRAD)


def test_exact_adagrad_two_ranks():
    pc.spawn(_two_ranks_adagrad, 2)


def _train_both(optimizer, sharding, steps=3):
    """A plugin model and the reference, from the same weights, trained on the same batches."""
    extra, _ = OPTIMIZERS[optimizer]
    plan = use_triton_tbe(pc.base_plan(sharding, 1, SUM_ONLY))
    dmp = pc.make_dmp(plan, TritonTBESharder(fused_params=pc.fused_params(optimizer, **extra)), SUM_ONLY)
    init = pc.reference_state(SUM_ONLY)
    tables = [init[f"ebc.embedding_bags.{t.name}.weight"] for t in SUM_ONLY.tables]
    spec = checked_optimizer_spec(pc.kernels(dmp)[0].emb_module, **pc.fused_params(optimizer, **extra))
    hyper = {k: v for k, v in extra.items() if k != "optimizer"}
    ref = ReferenceTBE(tables, [0, 1, 1, 2], mean=False, optimizer=spec, learning_rate=pc.LR, eps=0.05, **hyper)
    for step in range(steps):
        kjt = pc.batch(SUM_ONLY.tables, step, weighted=True)
        loss = pc.loss_fn(dmp(kjt), step)
        loss.backward()
        dmp.fused_optimizer.step()
        out64 = ref.forward(kjt.values(), kjt.offsets(), kjt.weights())
        pc.loss_fn(out64.float(), step).backward()
        ref.step()
    return dmp, ref


SHARDED_CASES = [(o, s) for o in OPTIMIZERS for s in ("table_wise", "row_wise", "column_wise", "table_row_wise")
                 if s != "column_wise" or o in ELEMENTWISE]


@pytest.mark.parametrize("optimizer,sharding", SHARDED_CASES, ids=[f"{o.name}-{s}" for o, s in SHARDED_CASES])
def test_training_through_the_plugin_matches_the_reference(one_rank, optimizer, sharding):
    dmp, ref = _train_both(optimizer, sharding)
    sd = dmp.state_dict()
    state = pc.optimizer_state(dmp)
    for k, table in enumerate(SUM_ONLY.tables):
        pc.assert_close(pc.dense(sd[f"ebc.embedding_bags.{table.name}.weight"]), ref.tables[k],
                        f"{optimizer.name} {sharding} {table.name} weights")
        keys = ["momentum1"] + OPTIMIZERS[optimizer][1]
        for i, key in enumerate(keys):
            got = pc.dense(state[f"ebc.embedding_bags.{table.name}.weight/{table.name}.{key}"])
            pc.assert_close(got.float(), ref.states[k][i].float(),
                            f"{optimizer.name} {sharding} {table.name} {key}", atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS), ids=lambda o: o.name)
def test_fused_optimizer_state_keys_and_layout(one_rank, optimizer):
    """TorchRec names the first state "momentum1" and the others by FBGEMM's get_optimizer_state keys;
    element-wise state is sharded like its weight, row-wise state by rows (of each column shard)."""
    extra, more_keys = OPTIMIZERS[optimizer]
    plan = use_triton_tbe(pc.base_plan("column_wise", 1))
    dmp = pc.make_dmp(plan, TritonTBESharder(fused_params=pc.fused_params(optimizer, **extra)))
    state = dmp.fused_optimizer.state_dict()["state"]
    assert {p: sorted(s) for p, s in state.items()} == {
        f"ebc.embedding_bags.{t.name}.weight": sorted(f"{t.name}.{k}" for k in ["momentum1"] + more_keys)
        for t in pc.TABLES
    }
    module = pc.kernels(dmp)[0].emb_module
    weights = dmp.state_dict()
    for t in pc.TABLES:
        w_layout = pc.shard_layout(weights[f"ebc.embedding_bags.{t.name}.weight"])
        for key, s in zip(["momentum1"] + more_keys, module.spec.optimizer.states):
            layout = pc.shard_layout(state[f"ebc.embedding_bags.{t.name}.weight"][f"{t.name}.{key}"])
            if s.rowwise:
                # One value per row per column shard (TorchRec stacks the shards' row-wise states).
                assert layout[1] == (t.num_embeddings * len(w_layout[2]),), (key, layout, w_layout)
            else:
                assert layout[:2] == w_layout[:2], (key, layout, w_layout)


@pytest.mark.parametrize("optimizer", [EmbOptimType.ADAM, EmbOptimType.PARTIAL_ROWWISE_LAMB], ids=lambda o: o.name)
def test_schedulers_and_hyper_parameters_reach_the_kernels(one_rank, optimizer):
    """An lr scheduler over DMP's fused optimizer, update_hyper_parameters and set_optimizer_step: the
    plugin model trains on exactly as the reference told the same."""
    dmp, ref = _train_both(optimizer, "table_wise", steps=1)
    sched = torch.optim.lr_scheduler.StepLR(dmp.fused_optimizer, step_size=1, gamma=0.5)
    sched.step()
    dmp.fused_optimizer.zero_grad()  # TorchRec pushes the group's lr into the kernels here (and in step())
    dmp.fused_optimizer.update_hyper_parameters({"beta1": 0.6, "weight_decay": 0.02})
    dmp.fused_optimizer.set_optimizer_step(5)
    ref.lr, ref.beta1, ref.weight_decay, ref.step_count = pc.LR * 0.5, 0.6, 0.02, 5
    kjt = pc.batch(SUM_ONLY.tables, 9, weighted=True)
    pc.loss_fn(dmp(kjt), 9).backward()
    dmp.fused_optimizer.step()
    out64 = ref.forward(kjt.values(), kjt.offsets(), kjt.weights())
    pc.loss_fn(out64.float(), 9).backward()
    ref.step()
    sd = dmp.state_dict()
    for k, table in enumerate(SUM_ONLY.tables):
        pc.assert_close(pc.dense(sd[f"ebc.embedding_bags.{table.name}.weight"]), ref.tables[k],
                        f"{optimizer.name} {table.name} after scheduler / hyper-parameter updates")


def _checkpoint_round_trip(rank, world_size, optimizer, sharding):
    extra, _ = OPTIMIZERS[optimizer]
    sharder = TritonTBESharder(fused_params=pc.fused_params(optimizer, **extra))
    plan = use_triton_tbe(pc.base_plan(sharding, world_size))
    src = pc.make_dmp(plan, sharder)
    pc.train(src, 2, rank)
    model_sd, optim_sd = copy.deepcopy(src.state_dict()), copy.deepcopy(src.fused_optimizer.state_dict())
    dst = pc.make_dmp(plan, sharder, init=pc.reference_state(seed=1))
    result = dst.load_state_dict(model_sd)
    assert not result.missing_keys and not result.unexpected_keys, result
    dst.fused_optimizer.load_state_dict(optim_sd)
    # As with fused: TorchRec's checkpoint holds weights and the states FBGEMM's get_optimizer_state lists,
    # not the step count (FBGEMM's `iter` buffer); a user restoring Adam / LAMB sets it.
    dst.fused_optimizer.set_optimizer_step(2)
    pc.assert_same_state(dst, src, f"{optimizer.name} {sharding} after load", atol=0, rtol=0)
    assert pc.train(dst, 2, rank, first_step=2) == pc.train(src, 2, rank, first_step=2)
    pc.assert_same_state(dst, src, f"{optimizer.name} {sharding} after training on", atol=0, rtol=0)


def _two_rank_round_trips(rank, world_size):
    for optimizer, sharding in [(EmbOptimType.ADAM, "row_wise"), (EmbOptimType.PARTIAL_ROWWISE_ADAM, "column_wise"),
                                (EmbOptimType.LAMB, "table_wise"), (EmbOptimType.LARS_SGD, "table_row_wise")]:
        _checkpoint_round_trip(rank, world_size, optimizer, sharding)


def test_checkpoints_reload_and_train_on_identically_one_rank(one_rank):
    for optimizer, sharding in [(EmbOptimType.ADAM, "column_wise"), (EmbOptimType.PARTIAL_ROWWISE_LAMB, "row_wise")]:
        _checkpoint_round_trip(0, 1, optimizer, sharding)


def test_checkpoints_reload_and_train_on_identically_two_ranks():
    pc.spawn(_two_rank_round_trips, 2)
