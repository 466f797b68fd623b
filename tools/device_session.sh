#!/usr/bin/env bash
# One device session, in steps that each fit one 10-minute device call (run after the two staging
# transfers of ../shared/tools/stage-fbgemm-gpu; see docs/performance.md):
#   checks      tests/gpu, the TorchRec A/B demo on the GPU, a stage profile (tools/device_checks.sh)
#   sweep-bwd   backward knobs (tile/warps/grid on uniform+zipf, then routing on hot+zipf), tests/gpu
#   sweep-fwd   forward knobs on the narrow shapes, then a stage profile
#   sweep-fwd128  forward lanes and gather at BLOCK_D=128 on uniform, Zipf and hot shapes
#   tests       tests/gpu only
#   host        host issue time vs GPU time of ours and FBGEMM's TBE on FBGEMM's default shape
#               (tools/host_profile.py), both optimizers
#   demo        the TorchRec demo's step time, fused vs ours, with a kernel / host-op profile (tools/demo_profile.py)
#   demo-prod   the same on production-shaped tables with fp16 weights (DEMO_RUNS of shape:batch, default
#               prod_t40_b16k at 8192 and 2048, prod_t100_b2k at 2048; the concatenating model; DEMO_ARGS: more
#               demo_profile.py options, e.g. --cprofile 10)
#   small-table the small-table path off and at 64 rows (config small_table) in SMALL_VARIANTS of its knobs,
#               fwd + bwd, --check, on SMALL_SHAPES (default prod_small_b16k, prod_t40_b16k, prod_t100_b2k)
#   first-step  cold and warm first step of a production-shaped model (FIRST_STEP_SHAPE), fused vs ours, and
#               tools/first_step.py: the step's specializations and their compile time on 1, 4, 16 processes,
#               replayed on 16 workers in both job orders, and a worker's first job cold and warmed up
#   first-step-ab  the demo's cold first step with --precompile on the tree of another commit (.ab/<commit>,
#               AB_COMMIT, as for ab) and on this tree, FIRST_STEP_PROCS (default 2) fresh processes and
#               caches each, interleaved; then this tree's step 0 on a warm cache with and without --precompile
#   first-step-default  the demo's cold first step with the plugin's defaults (precompile on) in FIRST_STEP_PROCS
#               fresh processes and caches, warm on the first's cache, and with --no-precompile warm and cold
#   first-step-variants  the demo's first step with --precompile under configs/sm90.yaml (cold) and under each of
#               VARIANTS (tools/config_variants.py), warm on the first run's cache, then cold on fresh ones
#   sweep-fp32  backward tile/warps with fp32 weights (reported, not written: the tables are per BLOCK_D)
#   suite       the A/B suite against FBGEMM's CUDA TBE with --check, and the markdown table
#   unseen      the same on configs/suites/unseen.yaml (shapes the knobs were never tuned on)
#   tests-core  tests/gpu without the TorchRec one (test_gpu_plugin.py)
#   plugin      tests/gpu/test_gpu_plugin.py: the TorchRec A/B with checkpoint interchange, every optimizer
#   suite-opt   the backward of every optimizer against FBGEMM's with the same optimizer, --check, on the
#               suite's shapes that fit two modules with Adam-sized state (OPT_SHAPES)
#   streams     the pooled forward with its D-bucket launches spread over STREAMS_LIST streams (variant
#               configs of configs/sm90.yaml), on the multi-bucket STREAM_SHAPES, then the GPU stream test
#   host-loop   tools/host_forward_loop.py (back-to-back training forwards, FBGEMM's default shape) on the .ab
#               tree (as for ab) and on this tree, HOST_LOOP_PROCS (default 3) alternating fresh processes
#               each, for HOST_LOOP_OPTIMIZERS (default sgd rwa)
#   host-suite  tools/host_profile.py --suite-shape on HOST_SHAPES (shape or shape:batch; default
#               prod_t40_b16k:8192 prod_t100_b2k): host issue vs event time, ours and FBGEMM's, cProfile
#   streams-procs  the pooled forward with STREAMS_LIST bucket streams (default 1 4; N@C: with
#               CUDA_DEVICE_MAX_CONNECTIONS=C), PROCS fresh processes per setting (default 5), interleaved, on
#               STREAM_PROC_SHAPES (bench options STREAM_PROC_ARGS); tools/perf_spread.py prints each
#               setting's min / median / max (the streams' time differs per process: docs/performance.md)
#   tile-opt    element-wise-state optimizers with the fp16 tile table instead of the fp32 one (the
#               default for rows carrying 4+ bytes per element), on two shapes
#   sanitizer   tests/gpu/test_gpu_sanitizer.py: tools/sanitize_cases.py under compute-sanitizer's memcheck,
#               racecheck, synccheck and initcheck (logs and summary.txt in $OUT/sanitizer)
#   initcheck-probe  initcheck on a PyTorch-only CUDA graph that sorts 2,816 and 8,192 keys (is the open
#               initcheck finding of docs/reliability.md the tool's view of graph copy nodes?)
#   initcheck-backtrace  initcheck with host backtraces on the graphs-replayed case after the case it followed
#               in the sanitizer run (INITCHECK_CASES: other --only lists), for the open finding of docs/reliability.md
#   reliability tests/gpu/test_gpu_reliability.py: determinism across runs and schedules, extremes
#   grouped     the pooled forward in one launch for every D bucket vs one launch per bucket, per slice
#               width (tools/forward_grouped.py), FBGEMM beside it; writes /tmp/sm90_grouped.yaml with the
#               best width and the batch up to which it won, for TORCHREC_TRITON_TBE_CONFIG in later steps
#   variants    configs/sm90.yaml and VARIANTS of it ("name=section.key:value,section.key:value ...",
#               tools/config_variants.py), each
#               on VARIANT_SHAPES of VARIANT_SUITE (default h200; VARIANT_PASSES, VARIANT_OPTIMIZERS) with --check against FBGEMM, after
#               VARIANT_TESTS (tests/gpu files) under the first variant's config; VARIANT_EXTRA: more bench
#               options (e.g. --weights-precision fp32)
#   peers       a third contender, TorchRec's Triton TBE (bench/peers.py), with FBGEMM's, --check, on FBGEMM's
#               default and the production-shaped suite shapes (PEER_SHAPES), SGD and row-wise Adagrad (all
#               it implements); needs .stage/torchrec from tools/stage_torchrec_triton.sh, carried along
#   multi       (two GPUs) tests/gpu/test_gpu_multi.py (MULTI_K: its pytest -k), each demo's log in $OUT/multi;
#               then the step-time lines of every log
#   multi-prod  (two GPUs) the demo under torchrun on two NCCL ranks on a production-shaped model
#               (MULTI_SHAPE, default prod_t40_b16k, fp16, TorchRec's pipeline) for each of MULTI_SHARDINGS
#               (default planner table_wise row_wise), MULTI_STEPS steps (default 12)
#   ncu         Nsight Compute (--set full, --clock-control none) on the backward of NCU_SHAPE (default
#               dlrm_t26_l1; NCU_OPTIMIZER, default exact_rowwise_adagrad), the first NCU_COUNT (40) launches
#               matching NCU_KERNELS: the request generator's sort, then ours (session 36: 40 ended inside our
#               second backward; FBGEMM's come later, so raise it for them), report in $OUT/ncu_<shape>.ncu-rep; prints per kernel
#               its duration, DRAM throughput, achieved occupancy, registers and grid (tools/ncu_table.py)
#   ab          the bench (AB_ARGS: its options after --suite h200 --compare fbgemm) on the tree of another
#               commit, .ab/<commit> (git-ignored; make it with `git archive <commit> torchrec_triton_tbe
#               configs tools pyproject.toml | tar -x -C .ab/<commit>` and carry it along), and on this tree, in
#               AB_PROCS (default 2) interleaved fresh processes each; tools/perf_spread.py prints both
# Sweeps write configs/sm90.yaml on the device and keep a copy in /tmp/sm90_swept.yaml (and $OUT);
# every later call copies it back over the working tree's configs/sm90.yaml while the machine stays
# warm, so the suite runs with the swept knobs (commit that file afterwards). The device copy has no
# .git: pass TORCHREC_TRITON_TBE_GIT_COMMIT=<sha> for the suite's JSON.
set -o pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OPT_SHAPES=${OPT_SHAPES:-fbgemm_default,b64k_uniform,b64k_zipf115,d64_zipf115,mixed_d32_256_zipf115,weighted_zipf115,fp32_zipf115}
OPTIMIZERS=${OPTIMIZERS:-exact_adagrad,partial_rowwise_adam,lamb,partial_rowwise_lamb,lars_sgd,exact_rowwise_adagrad}
# SUM-pooled, fixed-batch shapes TorchRec's Triton TBE runs (it has no MEAN / sequence pooling).
PEER_SHAPES=${PEER_SHAPES:-fbgemm_default,prod_t40_b16k,prod_t40_b64k,prod_t100_b2k,dlrm_t26_l1}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f /tmp/sm90_swept.yaml ] && cp /tmp/sm90_swept.yaml configs/sm90.yaml
keep() { cp configs/sm90.yaml /tmp/sm90_swept.yaml; cp configs/sm90.yaml "$OUT/sm90.yaml"; }
quiet() { grep -v "_fbgemm_torch_compat_table\|cannot determine compat\|^ *$\|\[0m\|\[33m\|^WARNING:root:$"; }
# The TorchRec demo's step 0 (the first-step* steps): tag, tree (python -m imports from the working
# directory first), Triton cache dir, extra demo flags; the log goes to $OUT/first_step_<tag>.log (full);
# a run without MATCH shows its last lines. STEP0_TIMEOUT: seconds per run (default 200).
step0() {
  local log="$OUT/first_step_$1.log"; echo "$1:"
  (cd "$2" && PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=$3 timeout "${STEP0_TIMEOUT:-200}" \
    python -m torchrec_triton_tbe.torchrec_demo --shape "${FIRST_STEP_SHAPE:-prod_t40_b16k}" --weights fp16 --steps 2 \
    --loop plain "${@:4}" > "$log" 2>&1)
  grep -qE "^(MATCH|MISMATCH)" "$log" && grep -E "^ +0 |^precompile:|MATCH" "$log" | cut -c1-300 || quiet < "$log" | tail -6
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for step in "$@"; do
  echo "== $step"
  case $step in
    checks) bash tools/device_checks.sh ;;
    tests) timeout 300 python -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/tests_gpu.txt" | tail -4 ;;
    host)
      for o in rowwise sgd; do
        (cd tools && timeout 150 python host_profile.py --shape default --optimizer $o --json "$OUT/host_default_$o.json" \
          2>&1 | quiet | grep -v "UserWarning\|_warn_once\|run_backward" | head -7)
      done ;;
    host-loop)
      base=$(ls -d .ab/*/ 2> /dev/null | head -1); base=${base%/}
      [ -n "$base" ] || { echo "host-loop: no .ab/<commit> tree: make one (see ab) and carry .ab"; continue; }
      for i in $(seq "${HOST_LOOP_PROCS:-3}"); do
        for tree in "$PWD/$base" "$PWD"; do
          for o in ${HOST_LOOP_OPTIMIZERS:-sgd rwa}; do
            PYTHONPATH=/tmp/site:$tree timeout 60 python tools/host_forward_loop.py "$o" 2>&1 | tail -1
          done
        done
      done ;;
    host-suite)
      # HOST_SHAPES entries: a suite shape, or shape:batch
      for sb in ${HOST_SHAPES:-prod_t40_b16k:8192 prod_t100_b2k}; do
        s=${sb%:*}; b=""; [ "$sb" != "$s" ] && b=${sb#*:}
        (cd tools && timeout 200 python host_profile.py --suite-shape "$s" ${b:+--batch-size $b} --optimizer rowwise \
          --json "$OUT/host_$s${b:+_$b}.json" 2>&1 | quiet | grep -v "UserWarning\|_warn_once\|run_backward" | head -12)
      done ;;
    demo) timeout 300 python tools/demo_profile.py --steps 20 --json "$OUT/demo_profile.json" 2>&1 | quiet | tail -8 ;;
    demo-prod)
      # Issue 14's end-to-end target: the production-shaped model, fp16 tables, per-rank batches 8 k and 2 k.
      for run in ${DEMO_RUNS:-prod_t40_b16k:8192 prod_t40_b16k:2048 prod_t100_b2k:2048}; do
        shape=${run%:*}; b=${run#*:}; tag=${shape}_b$b; echo "-- $tag fp16"
        timeout 280 python tools/demo_profile.py --shape "$shape" --batch-size "$b" --weights fp16 --steps 20 ${DEMO_ARGS:-} \
          --json "$OUT/demo_profile_$tag.json" > "$OUT/demo_profile_$tag.log" 2>&1
        quiet < "$OUT/demo_profile_$tag.log" | grep -v "^  kernels\|^  host" | tail -4
      done ;;
    first-step)
      # Cold (empty Triton cache) and warm first steps of a production-shaped TorchRec model, fused vs ours
      # (the demo's step-0 row), then where the cold compile time goes on this host's CPUs.
      cache=$(mktemp -d)
      STEP0_TIMEOUT=280 step0 demo_cold "$PWD" "$cache" --no-precompile
      STEP0_TIMEOUT=280 step0 demo_warm "$PWD" "$cache" --no-precompile
      STEP0_TIMEOUT=280 step0 demo_cold_precompile "$PWD" "$(mktemp -d)" --precompile
      TRITON_INTERPRET=0 timeout 280 python tools/first_step.py --shape "${FIRST_STEP_SHAPE:-prod_t40_b16k}" \
        --workers 1,4,16 --replay 16 --json "$OUT/first_step.json" 2>&1 | grep -v "^WARNING" | grep -v "^    _"
      # A compile worker's first job, cold and warmed up (Workers warm_up), on this host.
      TRITON_INTERPRET=0 timeout 120 python tools/first_step.py --shape "${FIRST_STEP_SHAPE:-prod_t40_b16k}" \
        --rows-scale 0.01 --first-job-probe 3 --json "$OUT/first_job_probe.json" 2>&1 | grep -v "^WARNING" \
        | python -c "import json,sys; print('first job (s):', json.loads(sys.stdin.read().splitlines()[-1])['first_job_seconds'])"
      # TritonTBE.precompile: a cold first step plain and precompiled, fresh processes and caches.
      PRECOMPILE_LOG_DIR="$OUT/precompile" timeout 400 python -m pytest -q -s -p no:cacheprovider \
        tests/gpu/test_gpu_precompile.py 2>&1 | grep -E "passed|failed|Error|plain" | cut -c1-600 | tail -6 ;;
    first-step-ab)
      base=.ab/${AB_COMMIT:-}
      [ -n "${AB_COMMIT:-}" ] && [ -d "$base/torchrec_triton_tbe" ] || {
        echo "first-step-ab: no $base/torchrec_triton_tbe (set AB_COMMIT, make the tree as for ab, carry .ab)"; continue; }
      warm=$(mktemp -d)
      for i in $(seq "${FIRST_STEP_PROCS:-2}"); do
        step0 "base_$i" "$PWD/$base" "$(mktemp -d)" --precompile
        c=$(mktemp -d); [ "$i" = 1 ] && c=$warm
        step0 "this_$i" "$PWD" "$c" --precompile
      done
      step0 warm_precompile "$PWD" "$warm" --precompile; step0 warm_plain "$PWD" "$warm" --no-precompile ;;
    first-step-default)
      # The plugin's defaults (precompile on): the demo's cold step 0 in FIRST_STEP_PROCS fresh processes and
      # caches, warm on the first one's cache, then without precompile warm there and cold on a fresh cache.
      warm=$(mktemp -d)
      for i in $(seq "${FIRST_STEP_PROCS:-2}"); do
        c=$(mktemp -d); [ "$i" = 1 ] && c=$warm
        step0 "default_cold_$i" "$PWD" "$c"
      done
      step0 default_warm "$PWD" "$warm"; step0 no_precompile_warm "$PWD" "$warm" --no-precompile
      step0 no_precompile_cold "$PWD" "$(mktemp -d)" --no-precompile ;;
    first-step-variants)
      # configs/sm90.yaml first, cold (its cache is then the warm one), then each of VARIANTS warm on it,
      # then each cold on a fresh cache; every run --precompile.
      [ -n "$VARIANTS" ] || { echo "first-step-variants: set VARIANTS (name=section.key:value,...)"; continue; }
      files=$(python tools/config_variants.py --prefix /tmp/fsv_ $VARIANTS) || continue
      warm=$(mktemp -d)
      step0 sm90_cold "$PWD" "$warm" --precompile; step0 sm90_warm "$PWD" "$warm" --precompile
      for cfg in $files; do
        TORCHREC_TRITON_TBE_CONFIG=$cfg step0 "$(basename "$cfg" .yaml)_warm" "$PWD" "$warm" --precompile
      done
      for cfg in $files; do
        TORCHREC_TRITON_TBE_CONFIG=$cfg step0 "$(basename "$cfg" .yaml)_cold" "$PWD" "$(mktemp -d)" --precompile
      done ;;
    sweep-fp32)
      python tools/sweep.py --part bwd --shapes fp32 --weights fp32 --grid tile=4,8,16 num_warps=1,2,4 \
        programs_per_sm=32 waves=1 --json "$OUT/sweep_bwd_fp32.json" 2>&1 | quiet | grep -v "^bwd" ;;
    sweep-bwd)
      python tools/sweep.py --part bwd --shapes uniform,zipf --write --json "$OUT/sweep_bwd.json" 2>&1 | quiet | grep -v "^bwd" ; keep
      python tools/sweep.py --part route --shapes hot,zipf --write --json "$OUT/sweep_route.json" 2>&1 | quiet | grep -v "^route"; keep
      timeout 200 python -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/tests_gpu.txt" | tail -4 ;;
    sweep-fwd)
      python tools/sweep.py --part fwd --shapes d32 --write --json "$OUT/sweep_fwd_d32.json" 2>&1 | quiet | grep -v "^fwd"; keep
      python tools/sweep.py --part fwd --shapes d64 --write --json "$OUT/sweep_fwd_d64.json" 2>&1 | quiet | grep -v "^fwd"; keep
      python tools/sweep.py --part fwd --shapes uniform --write --json "$OUT/sweep_fwd_d128.json" 2>&1 | quiet | grep -v "^fwd"; keep
      python tools/profile_stages.py --shape uniform --json "$OUT/prof_uniform.json" 2>&1 | quiet | tail -14 ;;
    sweep-fwd128)
      python tools/sweep.py --part fwd --shapes uniform,zipf,hot --grid bag_lanes=1,2,4,8 bags_per_program=2 \
        gather=4,8 num_warps=1 --write --json "$OUT/sweep_fwd_d128.json" 2>&1 | quiet | grep -v "^fwd"; keep ;;
    tests-core) timeout 420 python -m pytest -q -p no:cacheprovider tests/gpu --ignore tests/gpu/test_gpu_plugin.py 2>&1 \
      | tee "$OUT/tests_gpu.txt" | tail -6 ;;
    plugin) timeout 400 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_plugin.py 2>&1 \
      | tee "$OUT/tests_gpu_plugin.txt" | tail -6 ;;
    suite-opt)
      # ADAM: FBGEMM 1.6.0's fp16 ADAM fails on long runs (tests/gpu/test_gpu_optimizers.py): run it apart,
      # with TAG=_adam SUITE_EXTRA="--weights-precision fp32" OPTIMIZERS=adam.
      log="$OUT/suite_opt${TAG:-}.log"; js="$OUT/h200_opt${TAG:-}.json"
      timeout 540 python -m torchrec_triton_tbe.bench.cli --suite h200 --compare fbgemm --check --iters "${ITERS:-10}" \
        --passes bwd --only "$OPT_SHAPES" --optimizer "$OPTIMIZERS" $SUITE_EXTRA --json "$js" > "$log" 2>&1; echo "rc=$?"
      grep -i "check\|error\|fail" "$log" | grep -v "_fbgemm_torch_compat\|: ok" | tail -5
      python tools/perf_table.py "$js" | tail -30 ;;
    streams-procs)
      # STREAMS_LIST entries: N (bucket streams), or N@C to run that setting with
      # CUDA_DEVICE_MAX_CONNECTIONS=C (the hardware queues CUDA maps streams onto; 8 by default).
      for sc in ${STREAMS_LIST:-1 4}; do
        python tools/config_variants.py --prefix /tmp/sp_ "st${sc%@*}=forward.bucket_streams:${sc%@*}" > /dev/null || continue 2
      done
      for i in $(seq "${PROCS:-5}"); do
        for sc in ${STREAMS_LIST:-1 4}; do
          n=${sc%@*}; tag=st$n; conn=""
          [ "$sc" != "$n" ] && conn=${sc#*@} && tag=st${n}c$conn
          env ${conn:+CUDA_DEVICE_MAX_CONNECTIONS=$conn} timeout 150 python -m torchrec_triton_tbe.bench.cli --suite h200 \
            --compare fbgemm --iters "${ITERS:-20}" --passes fwd --optimizer exact_sgd \
            --only "${STREAM_PROC_SHAPES:-prod_t40_b16k,prod_t40_b16k_fp32,mixed_d32_256_b8k,prod_t40_b64k}" \
            ${STREAM_PROC_ARGS:-} --kernel-config /tmp/sp_st$n.yaml --json "$OUT/streams_procs_${tag}_$i.json" \
            > "$OUT/streams_procs_${tag}_$i.log" 2>&1 || echo "$tag run $i: rc=$?"
        done
      done
      python tools/perf_spread.py "$OUT"/streams_procs_st*_*.json ;;
    tile-opt)
      python - <<'PY'
import yaml
cfg = yaml.safe_load(open("configs/sm90.yaml"))
cfg["backward"]["tile_fp32"] = cfg["backward"]["tile"]
yaml.safe_dump(cfg, open("/tmp/sm90_tile16.yaml", "w"))
PY
      for cfg in sm90 /tmp/sm90_tile16.yaml; do
        TORCHREC_TRITON_TBE_CONFIG=$cfg timeout 200 python -m torchrec_triton_tbe.bench.cli --suite h200 --iters 20 \
          --passes bwd --only b64k_zipf115,d64_zipf115 --optimizer adam,partial_rowwise_lamb \
          --json "$OUT/tile_$(basename $cfg .yaml).json" 2>&1 | grep "Backward" | quiet
      done ;;
    streams)
      for n in ${STREAMS_LIST:-1 4 8}; do
        python tools/config_variants.py --prefix /tmp/sm90_ \
          "streams$n=forward.bucket_streams:$n,forward.bucket_streams_min_lookups:0" > /dev/null || continue
        echo "-- bucket_streams=$n"
        timeout 150 python -m torchrec_triton_tbe.bench.cli --suite h200 --compare fbgemm --iters "${ITERS:-20}" \
          --passes fwd --only "${STREAM_SHAPES:-prod_t100_b2k,prod_t40_b16k,mixed_d32_256_zipf115,vbe_t16_b1k_64k}" \
          --optimizer exact_sgd --kernel-config /tmp/sm90_streams$n.yaml --json "$OUT/streams_$n.json" 2>&1 \
          | grep "Forward\|rror" | quiet
      done
      timeout 120 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_training.py -k bucket_streams 2>&1 | tail -3 ;;
    sanitizer) SANITIZER_LOG_DIR="$OUT/sanitizer" timeout ${SANITIZER_TIMEOUT:-540} python -m pytest -q \
      -p no:cacheprovider tests/gpu/test_gpu_sanitizer.py 2>&1 | tee "$OUT/tests_sanitizer.txt" | tail -6
      cat "$OUT/sanitizer/summary.txt" ;;
    initcheck-probe)
      # PyTorch alone (tools/sanitize_cases.py probe_graph_sort): 2,816 keys take torch.sort's small-sort
      # path, whose first step copies them (the open finding's 22,528-byte copy); 8,192 keys do not.
      for n in 2816 8192; do
        timeout 120 "${SANITIZER:-compute-sanitizer}" --tool initcheck --print-limit 0 --show-backtrace no \
          python tools/sanitize_cases.py --probe-graph-sort $n > "$OUT/initcheck_probe_$n.txt" 2>&1
        echo "n=$n rc=$? $(grep -c 'Uninitialized' "$OUT/initcheck_probe_$n.txt") reports:" \
          "$(grep -m1 'ERROR SUMMARY' "$OUT/initcheck_probe_$n.txt")"
      done ;;
    initcheck-backtrace)
      # The open initcheck finding (docs/reliability.md): its case after the case it followed, with host
      # backtraces to name the copy's caller; the full log gzipped, the first report printed.
      for only in ${INITCHECK_CASES:-long-fused-fp32-lamb,graphs-replayed}; do
        log="$OUT/initcheck_bt_${only//,/_}.txt"
        timeout 200 "${SANITIZER:-compute-sanitizer}" --tool initcheck --print-limit 0 --show-backtrace host \
          python tools/sanitize_cases.py --only "$only" > "$log" 2>&1
        echo "$only rc=$? $(grep -c 'Uninitialized' "$log") reports: $(grep -m1 'ERROR SUMMARY' "$log")"
        grep -m1 -B2 -A40 'Uninitialized' "$log" | cut -c1-200; gzip -f "$log"
      done ;;
    reliability) timeout ${RELIABILITY_TIMEOUT:-300} python -m pytest -q -p no:cacheprovider \
      tests/gpu/test_gpu_reliability.py 2>&1 | tee "$OUT/tests_reliability.txt" | tail -8 ;;
    ncu)
      shape=${NCU_SHAPE:-dlrm_t26_l1}
      timeout 400 ncu --clock-control none --set full -f -o "$OUT/ncu_$shape" \
        -k "regex:${NCU_KERNELS:-_backward|_run_|_chunk_|_linearize|_scan_|RadixSort|split_embedding_backward|linearize_index}" \
        -c "${NCU_COUNT:-40}" python -m torchrec_triton_tbe.bench.cli --suite h200 --compare fbgemm --iters 2 \
        --passes bwd --optimizer "${NCU_OPTIMIZER:-exact_rowwise_adagrad}" --only "$shape" > "$OUT/ncu_$shape.log" 2>&1
      echo "rc=$?"; grep -i "error\|==PROF==.*fail" "$OUT/ncu_$shape.log" | tail -3
      ncu --import "$OUT/ncu_$shape.ncu-rep" --csv --page raw --print-units base > "$OUT/ncu_$shape.csv" 2> /dev/null
      python tools/ncu_table.py "$OUT/ncu_$shape.csv" ;;
    variants)
      [ -n "$VARIANTS" ] || { echo "variants: set VARIANTS (name=section.key:value,...)"; continue; }
      files=$(python tools/config_variants.py --prefix /tmp/sm90_var_ $VARIANTS) || continue
      first=${files%%$'\n'*}
      [ -n "$VARIANT_TESTS" ] && TORCHREC_TRITON_TBE_CONFIG=$first timeout ${VARIANT_TESTS_TIMEOUT:-200} \
        python -m pytest -q -p no:cacheprovider $VARIANT_TESTS 2>&1 | tee "$OUT/tests_variant.txt" | tail -4
      for cfg in configs/sm90.yaml $files; do
        tag=$(basename $cfg .yaml); echo "-- $tag"
        timeout ${VARIANT_TIMEOUT:-200} python -m torchrec_triton_tbe.bench.cli --suite "${VARIANT_SUITE:-h200}" --compare fbgemm --check \
          --iters "${ITERS:-20}" --passes "${VARIANT_PASSES:-bwd}" --optimizer "${VARIANT_OPTIMIZERS:-exact_rowwise_adagrad}" \
          --only "${VARIANT_SHAPES:-prod_small_b16k,prod_t40_b16k,prod_t40_b4k}" --kernel-config $cfg ${VARIANT_EXTRA:-} \
          --json "$OUT/var_$tag.json" > "$OUT/var_$tag.log" 2>&1; echo "rc=$?"
        grep -i "check\|error\|fail" "$OUT/var_$tag.log" | grep -v "_fbgemm_torch_compat\|: ok" | tail -4
        python tools/perf_table.py "$OUT/var_$tag.json" | tail -12
      done ;;
    peers)
      [ -f .stage/torchrec/torchrec/distributed/triton_tbe/triton_table_batched_embeddings.py ] || {
        echo "no .stage/torchrec: run tools/stage_torchrec_triton.sh and carry .stage/torchrec"; continue; }
      cat .stage/torchrec/SOURCE 2> /dev/null
      timeout 540 python -m torchrec_triton_tbe.bench.cli --suite h200 --compare fbgemm,torchrec_triton \
        --torchrec-checkout .stage/torchrec --check --iters 20 --passes fwd,bwd \
        --optimizer exact_sgd,exact_rowwise_adagrad --only "$PEER_SHAPES" \
        --json "$OUT/h200_peers.json" > "$OUT/peers.log" 2>&1; echo "rc=$?"
      grep -i "check\|skipped\|error\|fail" "$OUT/peers.log" | grep -v "_fbgemm_torch_compat" | tail -12
      python tools/perf_table.py "$OUT/h200_peers.json" | tail -20 ;;
    small-table)
      # The small-table path (config small_table) off (the shipped value) and at 64 rows, one config per
      # SMALL_VARIANTS entry (name=key:value,key:value over configs/sm90.yaml's small_table; default: 64
      # rows with the shipped knobs), on the shapes with such tables, --check against FBGEMM
      # first (issue 14: keep it only where it wins).
      files=$(python tools/config_variants.py --prefix /tmp/sm90_small_ $(for v in ${SMALL_VARIANTS:-on=max_rows:64}; do
        k=${v#*=}; echo "${v%%=*}=small_table.${k//,/,small_table.}"; done)) || continue
      for cfg in configs/sm90.yaml $files; do
        tag=$(basename $cfg .yaml); echo "-- $tag"
        timeout ${SMALL_TIMEOUT:-270} python -m torchrec_triton_tbe.bench.cli --suite h200 --compare fbgemm --check \
          --iters 20 --passes fwd,bwd --optimizer "${SMALL_OPTIMIZERS:-exact_sgd,exact_rowwise_adagrad}" \
          --only "${SMALL_SHAPES:-prod_small_b16k,prod_t40_b16k,prod_t100_b2k}" --kernel-config $cfg \
          --json "$OUT/small_$tag.json" > "$OUT/small_$tag.log" 2>&1; echo "rc=$?"
        cp $cfg "$OUT/" 2>/dev/null
        grep -i "check\|error\|fail" "$OUT/small_$tag.log" | grep -v "_fbgemm_torch_compat\|: ok" | tail -4
        python tools/perf_table.py "$OUT/small_$tag.json" | tail -6
      done ;;
    ab)
      base=$(ls -d .ab/*/ 2> /dev/null | head -1); base=${base%/}
      [ -n "$base" ] || { echo "ab: no .ab/<commit> tree: make one (see the header) and carry .ab"; continue; }
      tag=$(basename "$base")
      for i in $(seq "${AB_PROCS:-2}"); do
        for side in base head; do
          dir=.; sha=${TORCHREC_TRITON_TBE_GIT_COMMIT:-}; [ $side = base ] && dir=$base && sha=$tag
          (cd "$dir" && PYTHONPATH=/tmp/site:$PWD TORCHREC_TRITON_TBE_GIT_COMMIT=$sha timeout 200 \
            python -m torchrec_triton_tbe.bench.cli --suite h200 --compare fbgemm ${AB_ARGS:?} \
            --json "$OUT/ab_${side}_$i.json" > "$OUT/ab_${side}_$i.log" 2>&1) \
            && rm -f "$OUT/ab_${side}_$i.log" || echo "$side run $i: rc=$? (log in \$OUT)"
        done
      done
      python tools/perf_spread.py "$OUT"/ab_*_*.json ;;
    grouped)
      # The pooled forward in one launch for every D bucket (forward.grouped_max_batch) vs one per bucket,
      # FBGEMM beside it, at GROUPED_RUNS (shape:batch) and slice widths GROUPED_WIDTHS; then the width
      # with the best geo-mean and the largest batch up to which it won every run go into
      # /tmp/sm90_grouped.yaml (and $OUT) for the demo-prod / tests steps (TORCHREC_TRITON_TBE_CONFIG).
      timeout 500 python tools/forward_grouped.py --widths "${GROUPED_WIDTHS:-32,64,128}" --iters "${ITERS:-20}" \
        --runs "${GROUPED_RUNS:-prod_t100_b2k:2048,prod_t100_b2k:8192,prod_t40_b16k:2048,prod_t40_b16k:8192,prod_t40_b16k:16384,prod_t40_b16k:65536,mixed_d32_256_zipf115:8192}" \
        --json "$OUT/forward_grouped.json" > "$OUT/forward_grouped.log" 2>&1; echo "rc=$?"
      grep "^|\|rror" "$OUT/forward_grouped.log" | quiet
      python - "$OUT" <<'PY'
import json, math, sys, yaml
out = sys.argv[1]
runs = json.load(open(f"{out}/forward_grouped.json"))["runs"]
widths = [k for k in runs[0]["ms"] if k.startswith("one_launch_w")]
geo = {k: math.exp(sum(math.log(r["ms"]["per_bucket"] / r["ms"][k]) for r in runs) / len(runs)) for k in widths}
best = max(geo, key=geo.get)
limit = 0
for b in sorted({r["batch"] for r in runs}):
    if all(r["ms"][best] < r["ms"]["per_bucket"] for r in runs if r["batch"] <= b):
        limit = b
    else:
        break
cfg = yaml.safe_load(open("configs/sm90.yaml"))
cfg["forward"].update(grouped_max_batch=limit, grouped_block_d=int(best[len("one_launch_w"):]))
for path in ("/tmp/sm90_grouped.yaml", f"{out}/sm90_grouped.yaml"):
    yaml.safe_dump(cfg, open(path, "w"))
print("per-bucket / one-launch geo-mean:", {k: round(v, 3) for k, v in geo.items()},
      f"-> grouped_block_d {best[len('one_launch_w'):]}, grouped_max_batch {limit}")
PY
      ;;
    multi)
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "multi: needs two GPUs (nvidia-h200-x2)"; continue; }
      MULTI_GPU_LOG_DIR=$OUT/multi timeout "${MULTI_TIMEOUT:-560}" python -m pytest -q -p no:cacheprovider \
        tests/gpu/test_gpu_multi.py ${MULTI_K:+-k "$MULTI_K"} 2>&1 | tee -a "$OUT/multi_tests.txt" | tail -8
      for f in "$OUT"/multi/*.txt; do echo "-- $(basename $f .txt)"; grep -E "^plan:|^median|MATCH" "$f" | cut -c1-220; done ;;
    multi-prod)
      [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "multi-prod: needs two GPUs (nvidia-h200-x2)"; continue; }
      for sh in ${MULTI_SHARDINGS:-planner table_wise row_wise}; do
        log="$OUT/multi_prod_${MULTI_SHAPE:-prod_t40_b16k}_$sh.log"; echo "-- $sh"
        timeout "${MULTI_PROD_TIMEOUT:-280}" python -m torch.distributed.run --nproc_per_node 2 \
          -m torchrec_triton_tbe.torchrec_demo --shape "${MULTI_SHAPE:-prod_t40_b16k}" --weights fp16 \
          --steps "${MULTI_STEPS:-12}" --sharding "$sh" ${MULTI_ARGS:-} > "$log" 2>&1; echo "rc=$?"
        grep -E "^TorchRec|^plan:|^median|MATCH" "$log" | cut -c1-220 || quiet < "$log" | tail -6
      done ;;
    unseen)
      timeout 560 python -m torchrec_triton_tbe.bench.cli --suite unseen --compare fbgemm --check --iters 20 \
        --json "$OUT/unseen.json" > "$OUT/unseen.log" 2>&1; echo "rc=$?"
      grep -i "check\|error\|fail" "$OUT/unseen.log" | grep -v "_fbgemm_torch_compat" | tail -5
      python tools/perf_table.py "$OUT/unseen.json" | tail -24 ;;
    suite)
      python -m torchrec_triton_tbe.bench.cli --suite h200 --compare fbgemm --check --iters 20 \
        --json "$OUT/h200.json" --plot "$OUT/h200.png" > "$OUT/suite.log" 2>&1; echo "rc=$?"
      grep -i "check\|error\|fail" "$OUT/suite.log" | grep -v "_fbgemm_torch_compat" | tail -5
      python tools/perf_table.py "$OUT/h200.json" | tail -16 ;;
  esac
done
