#!/usr/bin/env bash
# One batched H200 session (see ../shared/device/README.md): gpu tests, kdt verify on CUDA, kdt bench.
# Usage on the device machine (carry .whl):  bash scripts/h200_check.sh engine|kernels|bench|all-engine|baseline|step|final|drafter|mla|profile|session4|train|drafters|moe|moe-ab|session6|tree|moe-wide|all-tests|train-eval|dense-ab|final8|small-linear|final9|moon9|ab9|drafter9|norm-ab|moe10|final10|moon10|norm-moon10|kv-ab|s11a|s11b|s11c|s11d|s12t|s12a|s12b|s12c|s13a|s13b|s13c|s13d|s14t|s14a|s14b|s15a|s15b|s15c|s16a|s16b|s16c|s17a|s17b|s18a|s18b|s18c|s18d|s19a|s19b|s19c|s19d|s19e|s20a|s20b|s20c|s20d|s21a|s21b|s21c|s22a|s22b|s22c|s23a|s23b|s23c|s23d|s24b|s24c|s24d|s24e|s25a|s25b|s25c|s26a|s26b|s26c|s26d|s26e|s27a|s27b|s27c|s27d|s27e|s28a|s28b|s28c|s29a|s29b|s29c|s29d|s30a|s30b|s30c|s30d|s30e|s31a|s31b|s31c|s31d|s32a|s32b|s32c|s32d|s32e|s33a|s33b|s33c|s34a|s34b|s34c|s34d|s35a|s35b|s35c|s35d|s36a|s36b|s36c|s36d|s36e|s37a|s39a|s39b|s39c|s40a|s40b|s40c|s41a|s41b|s41c|s42a|s42b|s42c|s42d|s42e|s43a|s43b|s43c|s44a|s44b|s44c|s45a|s46a|s46b|s46c|s47a|s47b|s47c|s48a|s48b|s48c|s48d|s48e|s49a|s49b|s50a|s50b|s51a|s52a|s52b|s53a|s53b|s53c|s53d|s54a|s54b|s54c|s54d
# (one device call each: a call may run 10 minutes at most).
# Logs and JSON go to $OUT (or ./out); a short summary is printed last.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba_cache
OUT=${OUT:-out}; mkdir -p "$OUT"
MODE=${1:-engine}
if [ "${KDT_CARRY_CACHE:-0}" = 1 ]; then  # the kernel cache carried from call to call: this call starts from
  # .kdt-cache.tar.gz (carry it beside .whl) and leaves the cache it ends with in $OUT/kdt-cache.tar.gz.partNN; for the
  # next call: cat FILES_AT/kdt-cache.tar.gz.part* > .kdt-cache.tar.gz (a kernel source edit makes it all misses)
  export KDT_CACHE_DIR=/tmp/kdt_cache_carried; mkdir -p "$KDT_CACHE_DIR"
  [ -f .kdt-cache.tar.gz ] && tar -xzf .kdt-cache.tar.gz -C "$KDT_CACHE_DIR"
  echo "kernel cache carried in: $(ls "$KDT_CACHE_DIR" | wc -l) files"
  trap 'tar -czf /tmp/kdt-cache.tar.gz -C "$KDT_CACHE_DIR" . && parts /tmp/kdt-cache.tar.gz
        echo "kernel cache carried out: $(ls "$KDT_CACHE_DIR" | wc -l) files, $(du -h /tmp/kdt-cache.tar.gz | cut -f1)"' EXIT
fi
day=$(date +%Y-%m-%d)
summary=()
step() {  # step NAME TIMEOUT CMD...: run, log to $OUT/NAME.log, remember the exit code
  local name=$1 t=$2; shift 2
  local t0=$(date +%s)
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$OUT/$name.log" | cut -c1-90)")")
}
tparts() {  # tparts T NAME TESTS...: a gpu pytest process in the background (T seconds at most, or $TEST_TIMEOUT), its
  # log $OUT/pytest_NAME.log ending in its exit code; `wait` for it
  local t=${TEST_TIMEOUT:-$1} n=$2; shift 2
  ( timeout "$t" python3 -m pytest -q -m gpu "$@" -p no:cacheprovider -rf > "$OUT/pytest_$n.log" 2>&1
    echo "rc=$?" >> "$OUT/pytest_$n.log" ) &
}
verify_beside_tparts() {  # verify_beside_tparts T CODE NAMES...: kdt verify of tiny (fp32) and, with CODE = 1,
  # model_code (bf16) on CUDA (T s each) beside the tparts processes started before; then the verify lines and the
  # summary of each NAME's tests
  local t=$1 code=$2; shift 2
  ( step verify_cuda_fp32 "$t" python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
    [ "$code" = 1 ] && step verify_code_cuda "$t" python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda \
      --dtype bf16
    printf '%s\n' "${summary[@]}" > "$OUT/verify_summary.txt" ) &
  wait
  cat "$OUT/verify_summary.txt"; grep -h "PASS\|FAIL" "$OUT"/verify_*.log | tail -n 4
  for n in "$@"; do echo "pytest $n:"; grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_$n.log" \
    | cut -c1-300; done
}
tiny_bench_by_step_end() {  # tiny_bench_by_step_end TAG: kdt bench on the tiny fixture (bf16) with each step
  # end (KDT_STEP_END=event, then flag; $TINY_TIMEOUT s each, 110), JSON bench-DAY-tiny-TAG-END.json; its decode and
  # host lines
  for e in event flag; do
    KDT_STEP_END=$e step bench_tiny_$e ${TINY_TIMEOUT:-110} python3 -m kdt.cli bench --model fixtures/model_tiny.h5 \
      --dtype bf16 --json "$OUT/bench-$day-tiny-$1-$e.json"
    grep -h "decode AR:\|oracle chain:\|oracle:\|host work" "$OUT/bench_tiny_$e.log"
  done
}
attn_visible_ab() {  # attn_visible_ab TAG: the same-run A/B of the attention's visible tiles (KDT_MLA_ATTN_TC_VISIBLE=0
  # / 1, a process each): Moonlight's attention on tensor cores alone (the engine's pre-split cache and splits, a causal
  # mask) at M = 64 / 256 and L = 0 / 512 / 8192 (session 41's verify rows at L = 8192 read 1.6-2.3% slower than
  # session 39's), JSON mla-DAY-moonlight-visV-TAG.json
  for v in 0 1; do
    KDT_MLA_ATTN_TC_VISIBLE=$v step mla_vis$v ${MLA_TIMEOUT:-200} python3 scripts/bench_mla.py --presets \
      moonlight-16b-a3b --kernels attention --tc --quick --M 64,256 --L 0,512,8192 --only "v2 tc hl S(max)" \
      --json "$OUT/mla-$day-moonlight-vis$v-$1.json"
    grep -h "tc hl" "$OUT/mla_vis$v.log" | cut -c1-160
  done
}
absorb_checks() {  # absorb_checks TAG TESTS M: the MLA gpu tests matching TESTS and the engine's beside kdt verify,
  # then the absorb alone (scripts/bench_mla.py --kernels q_absorb at the token counts M: the engine's launch with the
  # latent write on FMA tiles / on tensor cores, the GEMM by plan), then the visible-tiles A/B (attn_visible_ab)
  tparts 300 mla tests/test_kernels_mla.py -k "$2"
  tparts 300 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay or step_options or stop_token"
  verify_beside_tparts 250 1 mla engine
  step qabs ${MLA_TIMEOUT:-200} python3 scripts/bench_mla.py --presets moonlight-16b-a3b --kernels q_absorb --tc \
    --quick --M "$3" --json "$OUT/mla-$day-moonlight-qabs-$1.json"
  grep -h "q_absorb" "$OUT/qabs.log" | cut -c1-160
  attn_visible_ab "$1"
}
parts() {  # parts FILE: FILE into $OUT in 15 MB pieces (the device returns at most 8 files of 16 MiB each);
  # put it back together with: cat NAME.part* > NAME
  split -b 15000000 -d "$1" "$OUT/$(basename "$1").part"
}
tests_beside_verify() {  # tests_beside_verify PYTEST_ARGS...: gpu tests (280 s at most) in the background while
  # kdt verify runs tiny (fp32) and model_code (bf16) on CUDA; then the tests' summary
  ( timeout 280 python3 -m pytest -q -m gpu "$@" -p no:cacheprovider -rf > "$OUT/pytest_gpu.log" 2>&1
    echo "rc=$?" >> "$OUT/pytest_gpu.log" ) &
  step verify_cuda_fp32 150 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 120 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_gpu.log" | cut -c1-300
}
tests_beside_verifies() {  # tests_beside_verifies MARK VERIFY_TIMEOUT PYTEST_ARGS...: the tests of MARK ($TEST_TIMEOUT s, 300)
  # and kdt verify of tiny (fp32) in the background, kdt verify of model_code (bf16) in the foreground, each in its
  # own process (cold compiles take minutes); then the verify lines and the tests' summary
  local mark=$1 vt=$2; shift 2
  ( timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m "$mark" "$@" -p no:cacheprovider -rf > "$OUT/pytest_gpu.log" 2>&1
    echo "rc=$?" >> "$OUT/pytest_gpu.log" ) &
  ( step verify_cuda_fp32 "$vt" python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
    printf '%s\n' "${summary[@]}" > "$OUT/verify_tiny.txt" ) &
  step verify_code_cuda "$vt" python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  cat "$OUT/verify_tiny.txt"; rm -f "$OUT/verify_tiny.txt"
  grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_gpu.log" | cut -c1-300
}
# session 16: issue 8's table at budget 16, every row timed in 3 rounds (modes s16a-c)
tbl="python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda --dtype bf16 --budgets 16 --repeats 3"
table_before() {  # table_before BASE JSON: issue 8's table ($tbl) with the code in out/BASE (carried: `git archive
  # REV kdt`), its own kernel cache, the log drafter_before.log, the JSON $OUT/JSON
  local outa; outa=$(cd "$OUT" && pwd)
  ( cd "out/$1" && OUT=$outa KDT_CACHE_DIR=/tmp/kdt_cache_base step drafter_before 200 python3 -m kdt.cli \
      train-drafter ../../fixtures/model_code.h5 --eval-only --backend cuda --dtype bf16 --budgets 16 --repeats 3 \
      --json "$outa/$2"; printf '%s\n' "${summary[-1]}" )
}
ncu_moe() {  # ncu_moe M_LIST [SWEEP_VARIANTS]: Nsight Compute on the Moonlight MoE layer's launches at these M,
  # tensor cores (v2) against the FMA tiles (v2 fma), or against bench_moe --sweep's variants named (e.g. "v2 tc_st5"):
  # throughput, memory, warp stalls, pipes, occupancy (bench_moe --ncu: one profiled forward a variant, after the one
  # that compiles); the log ncu_moe.log
  local ncu; ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | tail -n 1)
  step ncu_moe ${NCU_TIMEOUT:-400} "$ncu" --clock-control none --profile-from-start off \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
    --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M "$1" $([ -n "$2" ] && echo --sweep || echo --previous) \
    --only "v2,${2:-v2 fma}" --ncu
  grep -h "moe2_\|Duration\|Memory Throughput\|Compute (SM) Throughput\|DRAM Throughput\|Registers Per\|Achieved Occ\|profiled\|Error\|error" \
    "$OUT/ncu_moe.log" | cut -c1-150
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
case "$MODE" in
engine)
  step verify_cuda_fp32 240 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_cuda_bf16 120 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype bf16
  step verify_code_cuda 120 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step pytest_gpu_engine 180 python3 -m pytest -q -m gpu tests/test_engine_cuda.py -p no:cacheprovider ;;
kernels)  # every measured error goes to $OUT/errors.tsv; the per-test table to $OUT/errors.md
  export KDT_ERR_LOG="$OUT/errors.tsv"
  step pytest_gpu_kernels 420 python3 -m pytest -q -m gpu tests/test_kernels_linear.py \
    tests/test_kernels_elementwise.py tests/test_kernels_mla.py tests/test_kernels_moe.py tests/test_ddtree_kernels.py \
    tests/test_kernels_randn.py -p no:cacheprovider --durations=15
  python3 scripts/err_table.py "$OUT/errors.tsv" > "$OUT/errors.md" 2>&1
  step bench_kernels 150 python3 -m kdt.kernels.bench --json "$OUT/kernels-$day-bf16.json" ;;
all-engine)  # the engine, convert and the bench in one call (< 10 min)
  step verify_cuda_fp32 120 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step pytest_gpu_engine 200 python3 -m pytest -q -m gpu tests/test_engine_cuda.py tests/test_convert.py \
    -p no:cacheprovider --durations=10
  step bench_tiny 100 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny.json"
  step bench_moonlight 240 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16.json" ;;
bench)
  step bench_tiny 200 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny.json"
  step bench_moonlight 420 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16.json" ;;
baseline)  # after engine refactors: verify (incl. the learned drafter), all engine gpu tests, the drafter table
  step verify_cuda_fp32 100 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 100 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step pytest_gpu_engine 200 python3 -m pytest -q -m gpu tests/test_engine_cuda.py -p no:cacheprovider --durations=10
  step drafter_cuda 170 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda.json" ;;
step)  # the one-program DDTree step, the on-disk kernel cache (a fresh one: first run compiles, second loads)
  export KDT_CACHE_DIR=/tmp/kdt_cache_fresh; rm -rf "$KDT_CACHE_DIR"
  step verify_compile 150 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_cached 90 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  du -sh "$KDT_CACHE_DIR" > "$OUT/cache_size.txt" 2>&1; ls "$KDT_CACHE_DIR" | wc -l >> "$OUT/cache_size.txt"
  step pytest_gpu_step 200 python3 -m pytest -q -m gpu tests/test_engine_cuda.py tests/test_ddtree_kernels.py \
    -k "not parity and not max_budget" -p no:cacheprovider --durations=8
  step bench_tiny 90 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny.json"
  step drafter_cuda 150 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda.json" ;;
final)  # the engine after issue 7/8 changes: gpu tests, verify with the learned drafter, both benches, drafter table
  step verify_code_cuda 120 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step pytest_gpu_step 150 python3 -m pytest -q -m gpu tests/test_engine_cuda.py tests/test_ddtree_kernels.py \
    -k "not parity and not max_budget" -p no:cacheprovider --durations=8
  step bench_tiny 80 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny.json"
  step drafter_cuda 80 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda.json"
  step bench_moonlight 300 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16.json"
  step profile_step 60 python3 scripts/profile_step.py ;;
drafter)  # the learned drafter on the GPU: its gpu tests, then its acceptance table on the CUDA backend
  step pytest_gpu_drafter 240 python3 -m pytest -q -m gpu tests/test_engine_cuda.py -k "learned or draft" \
    -p no:cacheprovider
  step drafter_cuda 300 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda.json" ;;
mla)  # MLA v2 (and MoE's shared _mask_groups) on the GPU: kernel tests, v1-v2 bench, the engine on v2, both benches
  export KDT_ERR_LOG="$OUT/errors.tsv"
  step pytest_gpu_mla_moe 200 python3 -m pytest -q -m gpu tests/test_kernels_mla.py tests/test_kernels_moe.py \
    -p no:cacheprovider --durations=8
  step bench_mla 120 python3 scripts/bench_mla.py --json "$OUT/mla-v1-v2-$day-bf16.json"
  step verify_cuda_fp32 90 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 60 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step bench_tiny 60 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny.json"
  step bench_moonlight 240 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16.json" ;;
profile)  # where the step's GPU time goes (kernel by kernel), the tests the mla run left, tiny bench, drafter table
  export KDT_ERR_LOG="$OUT/errors.tsv"
  step profile_kernels 200 python3 scripts/profile_kernels.py --json "$OUT/profile-kernels-$day.json"
  step pytest_gpu_rest 150 python3 -m pytest -q -m gpu tests/test_kernels_mla.py tests/test_kernels_moe.py \
    -k "not test_mla_attention_gpu" -p no:cacheprovider --durations=5
  step bench_tiny 60 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny.json"
  step drafter_cuda 100 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda.json" ;;
session4)  # session 4's final run: the benches first (the numbers), then verify and every gpu test touched
  export KDT_ERR_LOG="$OUT/errors.tsv"
  step bench_tiny 60 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny.json"
  step bench_moonlight 110 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16.json"
  step drafter_cuda 70 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda.json"
  step verify_code_cuda 50 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step pytest_gpu_engine 150 python3 -m pytest -q -m gpu tests/test_engine_cuda.py tests/test_ddtree_kernels.py \
    -k "not parity and not max_budget" -p no:cacheprovider --durations=5
  step pytest_gpu_linear_moe 120 python3 -m pytest -q -m gpu tests/test_kernels_linear.py tests/test_kernels_moe.py \
    -p no:cacheprovider --durations=5 ;;
train)  # issue 8 on the H200: the demo target (torch, scripts/train_target.py), then 1- and 2-layer drafters
  # side by side (kdt train-drafter --device cuda); the gpu tests of the engine and kernels meanwhile
  # (correctness only: they share the GPU with the training, so nothing here is timed)
  ( timeout 560 python3 -m pytest -q -m gpu tests/test_engine_cuda.py tests/test_ddtree_kernels.py \
      tests/test_kernels_linear.py tests/test_kernels_moe.py tests/test_kernels_mla.py -k "not parity and not max_budget" \
      -p no:cacheprovider --durations=5 > "$OUT/pytest_gpu.log" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest_gpu.log" ) &
  step train_target 300 python3 scripts/train_target.py --device cuda --steps 0 --minutes ${TRAIN_MIN:-3.5} \
    --batch 64 --warmup 100 --out /tmp/tt --fixture /tmp/tt/model_code.h5
  cp /tmp/tt/train_log.json "$OUT/train_target_log.json"
  for L in 1 2; do
    timeout 230 python3 -m kdt.cli train-drafter /tmp/tt/model_code.h5 --out "$OUT/model_code_d$L.h5" --layers $L \
      --device cuda --minutes ${DRAFT_MIN:-2.2} --sequences 1536 --batch 32 --eval-prompts 0 \
      > "$OUT/train_drafter_d$L.log" 2>&1 &
  done
  wait
  summary+=("$(tail -n 2 "$OUT/pytest_gpu.log" | tr '\n' ' ')")
  for L in 1 2; do summary+=("d$L: $(grep final: "$OUT/train_drafter_d$L.log" | cut -c1-150)"); done ;;
drafters)  # issue 8: drafters for fixtures/model_code.h5 side by side (torch on the GPU), then each one's acceptance
  # table on held-out stdlib files on kdt's CUDA engine alone on the GPU (timed), written into its copy's drafter
  # meta; then kdt verify of the first. DRAFT_VARIANTS="layers:intermediate ..."; DRAFT_BATCH, DRAFT_ARGS (more
  # train-drafter options);
  # DRAFT_CORPUS=site: train on transformers' own *.py files (code the target never saw: not memorised)
  [ "${DRAFT_CORPUS:-}" = site ] && DRAFT_CORPUS=$(python3 -c 'import os, transformers; print(os.path.dirname(transformers.__file__))')
  corpus=${DRAFT_CORPUS:+--corpus $DRAFT_CORPUS}; echo "corpus: ${DRAFT_CORPUS:-stdlib}" > "$OUT/corpus.txt"
  names=()
  for V in ${DRAFT_VARIANTS:-2:512 1:512}; do
    L=${V%%:*}; I=${V##*:}; n=d${L}i$I; names+=($n)
    timeout ${DRAFT_TIMEOUT:-330} python3 -m kdt.cli train-drafter fixtures/model_code.h5 --out /tmp/$n.h5 --layers $L \
      --intermediate $I --device cuda --minutes ${DRAFT_MIN:-3} --sequences ${DRAFT_SEQ:-12288} \
      --batch ${DRAFT_BATCH:-64} ${DRAFT_ARGS:-} --eval-prompts 0 $corpus > "$OUT/train_drafter_$n.log" 2>&1 &
  done
  wait
  for n in "${names[@]}"; do
    summary+=("$n: $(grep final: "$OUT/train_drafter_$n.log" | cut -c1-150)")
    step drafter_cuda_$n 170 python3 -m kdt.cli train-drafter /tmp/$n.h5 --eval-only --backend cuda --dtype bf16 \
      --out "$OUT/model_code_$n.h5" --json "$OUT/drafter-$day-model_code-cuda-$n.json"
  done
  step verify_code_cuda 60 python3 -m kdt.cli verify "$OUT/model_code_${names[0]}.h5" --backend cuda --dtype bf16
  # what comes back is at most 8 files of 16 MiB: the small ones in one archive, each model file in 15 MB parts
  # (session 7 lost a 24 MB one; put it back together with: cat model_code_NAME.h5.part* > model_code_NAME.h5)
  tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.json *.txt) && rm -f "$OUT"/*.log "$OUT"/*.json
  for f in "$OUT"/model_code_*.h5; do parts "$f" && rm -f "$f"; done ;;
moe)  # issue 7's MoE lever: where version 2's time goes (GPU alone: launch prefixes, launch-shape sweep, ncu
  # counters if this machine's runtime gives them), the per-kernel profile of the decode steps; then MoE's gpu tests
  # and kdt verify on CUDA (correctness, after the timings)
  step bench_moe 240 python3 scripts/bench_moe.py --presets moonlight-16b-a3b,kimi-k2 --M ${MOE_M:-1} --sweep --parts \
    --json "$OUT/moe-$day-bf16.json"
  step profile_kernels 200 python3 scripts/profile_kernels.py --json "$OUT/profile-kernels-$day.json"
  # (ncu lists Numba's closure kernels as kern[abi:...]: "regex:moe2" matched nothing, "regex:kern" also
  # version 1's _mm_kernel; "^kern" is meant to take version 2's three; not yet seen working)
  step ncu_moe 100 ncu --clock-control none -k regex:^kern -c 3 --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 1
  export KDT_ERR_LOG="$OUT/errors.tsv"
  step pytest_gpu_moe 150 python3 -m pytest -q -m gpu tests/test_kernels_moe.py -p no:cacheprovider --durations=5
  step verify_cuda_fp32 60 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 60 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16 ;;
moe-ab)  # MoE version 2's launch-shape variants (bench_moe --sweep), then MoE's gpu tests
  step bench_moe 300 python3 scripts/bench_moe.py --presets moonlight-16b-a3b,kimi-k2 --M ${MOE_M:-1,8} --sweep --parts \
    --json "$OUT/moe-$day-bf16.json"
  export KDT_ERR_LOG="$OUT/errors.tsv"
  step pytest_gpu_moe 150 python3 -m pytest -q -m gpu tests/test_kernels_moe.py -p no:cacheprovider --durations=5 ;;
session6)  # the engine after session 6's MoE change: both benches first (GPU alone), then kdt verify and the
  # engine's gpu tests
  step bench_tiny 120 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny.json"
  step bench_moonlight 240 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16.json"
  step verify_cuda_fp32 40 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 40 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step pytest_gpu_engine 120 python3 -m pytest -q -m gpu tests/test_engine_cuda.py -p no:cacheprovider --durations=5 ;;
tree)  # session 6's last change, unmeasured there (tree_build writes visibility on [0, budget + 1)^2 only): its gpu
  # tests and the engine's, verify, the tiny bench (GPU alone), the per-kernel profile with the bracket calibrated
  step pytest_gpu_tree 150 python3 -m pytest -q -m gpu tests/test_ddtree_kernels.py tests/test_engine_cuda.py \
    -p no:cacheprovider --durations=5
  step verify_cuda_fp32 60 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 60 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step bench_tiny 200 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny.json"
  step profile_kernels 150 python3 scripts/profile_kernels.py --cases tiny,code --json "$OUT/profile-kernels-$day.json" ;;
moe-wide)  # MoE version 2 past M = 8 at the engine level (KDT_MOE_V2_MAX_M=1024: every M): the learned
  # drafter's table on model_code (its verify of 17+ nodes) with version 1 past M = 8 (session 6's default,
  # KDT_MOE_V2_MAX_M=8; session 7 ran this step with the default of the time, the same) and with version 2
  # everywhere (the default since), then the Moonlight bench with version 2 everywhere (its verify n >= 16 rows
  # against the last version-1 run's)
  step drafter_default 150 env KDT_MOE_V2_MAX_M=8 python3 -m kdt.cli train-drafter fixtures/model_code.h5 \
    --eval-only --backend cuda --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-moe-default.json"
  step drafter_v2_all 150 env KDT_MOE_V2_MAX_M=1024 python3 -m kdt.cli train-drafter fixtures/model_code.h5 \
    --eval-only --backend cuda --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-moe-v2-all.json"
  step bench_moonlight_v2_all 280 env KDT_MOE_V2_MAX_M=1024 python3 -m kdt.cli bench --preset moonlight-16b-a3b \
    --dtype bf16 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-moe-v2-all.json" ;;
all-tests)  # every gpu-marked test, three pytest processes side by side (correctness only, nothing timed),
  # then kdt verify on CUDA
  export KDT_ERR_LOG="$OUT/errors.tsv"
  par() {  # par NAME FILES...: a background pytest process
    local name=$1; shift
    ( timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -m gpu "$@" -p no:cacheprovider --durations=5 \
        > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log" ) &
  }
  par pytest_mla tests/test_kernels_mla.py
  par pytest_ddtree tests/test_ddtree_kernels.py
  par pytest_rest tests/test_kernels_linear.py tests/test_kernels_elementwise.py tests/test_kernels_moe.py \
    tests/test_kernels_randn.py tests/test_engine_cuda.py tests/test_convert.py
  wait
  for n in pytest_mla pytest_ddtree pytest_rest; do summary+=("$n: $(tail -n 2 "$OUT/$n.log" | tr '\n' ' ')"); done
  step verify_cuda_fp32 60 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 60 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16 ;;
train-eval)  # session 8, issue 8: one drafter trained alone on the GPU (DRAFT_LAYERS, DRAFT_INTER, DRAFT_SEQ, DRAFT_MIN,
  # DRAFT_BATCH, DRAFT_ARGS) while the gpu tests the all-tests call left (MoE, engine, convert) run beside it
  # (correctness only); the model comes back in 15 MB parts at once, then its acceptance table (GPU alone, timed)
  # replaces them with the copy whose drafter meta records it; then kdt verify of that copy
  export KDT_ERR_LOG="$OUT/errors.tsv"
  ( timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu tests/test_kernels_moe.py tests/test_kernels_randn.py \
      tests/test_engine_cuda.py tests/test_convert.py -p no:cacheprovider --durations=5 > "$OUT/pytest_rest.log" 2>&1
    echo "rc=$?" >> "$OUT/pytest_rest.log" ) &
  n=d${DRAFT_LAYERS:-3}i${DRAFT_INTER:-1024}
  step train_drafter_$n ${DRAFT_TIMEOUT:-400} python3 -m kdt.cli train-drafter fixtures/model_code.h5 --out /tmp/$n.h5 \
    --layers ${DRAFT_LAYERS:-3} --intermediate ${DRAFT_INTER:-1024} --device cuda --minutes ${DRAFT_MIN:-4.5} \
    --sequences ${DRAFT_SEQ:-65536} --batch ${DRAFT_BATCH:-256} ${DRAFT_ARGS:---anchors 16} --eval-prompts 0
  wait
  summary+=("pytest_rest: $(tail -n 2 "$OUT/pytest_rest.log" | tr '\n' ' ')")
  rm -f "$OUT"/*.part*; parts /tmp/$n.h5
  step drafter_cuda_$n ${EVAL_TIMEOUT:-140} python3 -m kdt.cli train-drafter /tmp/$n.h5 --eval-only --backend cuda \
    --dtype bf16 --out /tmp/model_code_$n.h5 --json "$OUT/drafter-$day-model_code-cuda-$n.json"
  [ -f /tmp/model_code_$n.h5 ] && rm -f "$OUT"/*.part* && parts /tmp/model_code_$n.h5
  step verify_code_cuda 50 python3 -m kdt.cli verify /tmp/model_code_$n.h5 --backend cuda --dtype bf16
  tar czf "$OUT/logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.json *.txt *.tsv 2>/dev/null) && rm -f "$OUT"/*.log "$OUT"/*.json ;;
dense-ab)  # session 8: the dense MLP (KDT_DENSE_MLP_VERSION 1: grouped-GEMM kernels in dense mode; 2: linear +
  # silu_mul + linear): its gpu tests, then the learned drafter's table and the tiny bench with each version (GPU
  # alone), then the per-kernel profile of the learned step with the new default (on a fresh machine this ran past
  # the 600 s limit, in the profile: the first drafter table compiles everything, the tiny benches need > 100 s)
  export KDT_ERR_LOG="$OUT/errors.tsv"
  step pytest_dense 200 python3 -m pytest -q -m gpu tests/test_kernels_moe.py tests/test_kernels_elementwise.py \
    -k "dense or silu" -p no:cacheprovider --durations=5
  for v in 1 2; do
    step drafter_mlp_v$v 120 env KDT_DENSE_MLP_VERSION=$v python3 -m kdt.cli train-drafter fixtures/model_code.h5 \
      --eval-only --backend cuda --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-mlp-v$v.json"
  done
  for v in 1 2; do
    step bench_tiny_mlp_v$v 100 env KDT_DENSE_MLP_VERSION=$v python3 -m kdt.cli bench --model fixtures/model_tiny.h5 \
      --dtype float32 --json "$OUT/bench-$day-tiny-mlp-v$v.json"
  done
  step profile_kernels 120 python3 scripts/profile_kernels.py --cases tiny,code --json "$OUT/profile-kernels-$day.json" ;;
final8)  # session 8's last call: the Moonlight bench (GPU alone), then the engine and convert gpu tests beside
  # kdt verify on CUDA (correctness only)
  step bench_moonlight 300 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16.json"
  ( timeout ${TEST_TIMEOUT:-210} python3 -m pytest -q -m gpu tests/test_engine_cuda.py tests/test_convert.py \
      -p no:cacheprovider --durations=5 > "$OUT/pytest_engine.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_engine.log" ) &
  step verify_cuda_fp32 90 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 60 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  summary+=("pytest_engine: $(tail -n 2 "$OUT/pytest_engine.log" | tr '\n' ' ')") ;;
small-linear)  # session 9: KDT_LINEAR_V2_SHRINK_TM=0 vs 1 on the drafter table, then linear_v2's plans at model_code's shapes
  for v in 0 1; do
    export KDT_LINEAR_V2_SHRINK_TM=$v; step "drafter_shrink$v" 200 python3 -m kdt.cli train-drafter fixtures/model_code.h5 \
      --eval-only --backend cuda --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-shrink$v.json"
  done
  unset KDT_LINEAR_V2_SHRINK_TM
  step bench_linear_code 280 python3 scripts/bench_linear.py --fixture fixtures/model_code.h5 --M ${LIN_M:-1,16,17,32} \
    --json "$OUT/linear-code-$day.json"
  [ -n "${LIN_TESTS:-}" ] && step pytest_gpu_linear 200 python3 -m pytest -q -m gpu tests/test_kernels_linear.py \
    -p no:cacheprovider ;;
final9)  # session 9: correctness first (gpu tests beside kdt verify), then the drafter table and the tiny bench alone
  ( timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_engine_cuda.py tests/test_convert.py \
      -p no:cacheprovider --durations=5 > "$OUT/pytest_engine.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_engine.log" ) &
  ( timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_ddtree_kernels.py tests/test_kernels_moe.py \
      tests/test_kernels_linear.py -k "topk or (moonlight and bf16) or dense_mlp or plan" -p no:cacheprovider \
      --durations=5 > "$OUT/pytest_kernels.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_kernels.log" ) &
  step verify_cuda_fp32 200 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 120 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  summary+=("pytest_engine: $(tail -n 2 "$OUT/pytest_engine.log" | tr '\n' ' ')")
  summary+=("pytest_kernels: $(tail -n 2 "$OUT/pytest_kernels.log" | tr '\n' ' ')")
  step drafter_cuda 150 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s9.json"
  step bench_tiny 200 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s9.json" ;;
moon9)  # session 9: the Moonlight bench, then where the learned step's GPU time goes now
  step bench_moonlight 330 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s9.json"
  step profile_kernels 120 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-code-s9.json" ;;
ab9)  # session 9, as run at commit 0b73aab (its knobs KDT_TOPK_RANK_MAX_V and KDT_MOE_PERM_U are gone: both
  # changes lost and were reverted): the learned step's profile with them, then without (old)
  step profile_new 200 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-code-s9-new.json"
  export KDT_TOPK_RANK_MAX_V=0 KDT_MOE_PERM_U=1
  step profile_old 200 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-code-s9-old.json" ;;
drafter9)  # session 9's last call: kdt verify of model_code, then the drafter table alone
  step verify_code_cuda 150 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step drafter_cuda 150 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s9-final.json" ;;
norm-ab)  # KDT_LINEAR_FUSE_NORM (session 9, unmeasured): kdt verify of the learned model with it on, the drafter
  # table on / off back to back (each compiles everything: the variable is part of the kernel-cache key), then
  # the tiny fixture fp32 with it on and the norm tests on the GPU
  export KDT_LINEAR_FUSE_NORM=1
  step verify_code_fused 150 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step drafter_fused 100 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-fused-norm.json"
  export KDT_LINEAR_FUSE_NORM=0
  step drafter_unfused 170 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-unfused-norm.json"
  export KDT_LINEAR_FUSE_NORM=1
  step verify_tiny_fused 90 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step pytest_norm 90 python3 -m pytest -q tests/test_kernels_linear.py tests/test_kernels_moe.py \
    tests/test_engine_cuda.py -k "norm or draft_model or prefill_chunks" -p no:cacheprovider ;;
moe10)  # session 10: kernel A routing by token tile, kernel C one expert per block on small models: the MoE
  # layer A/B (each change undone alone) at model_code's and Moonlight's shapes, then verify, the drafter table
  # and the learned step's kernel profile
  step bench_moe 240 python3 scripts/bench_moe.py --presets fixtures/model_code.h5,moonlight-16b-a3b --M 1,17,65 \
    --previous --json "$OUT/moe-$day-route-tiles.json"
  step verify_code_cuda 150 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step drafter_cuda 100 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s10-moe.json"
  step profile_kernels 100 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-code-s10.json" ;;
final10)  # session 10's last checks: gpu tests beside kdt verify, then the drafter table, the learned step's kernel
  # profile and the tiny bench, each alone
  ( timeout ${TEST_TIMEOUT:-320} python3 -m pytest -q -m gpu tests/test_engine_cuda.py tests/test_convert.py \
      -p no:cacheprovider --durations=5 > "$OUT/pytest_engine.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_engine.log" ) &
  ( timeout ${TEST_TIMEOUT:-320} python3 -m pytest -q -m gpu tests/test_ddtree_kernels.py tests/test_kernels_moe.py \
      tests/test_kernels_linear.py -p no:cacheprovider --durations=5 > "$OUT/pytest_kernels.log" 2>&1; \
      echo "rc=$?" >> "$OUT/pytest_kernels.log" ) &
  step verify_cuda_fp32 200 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 150 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  summary+=("pytest_engine: $(tail -n 2 "$OUT/pytest_engine.log" | tr '\n' ' ')")
  summary+=("pytest_kernels: $(tail -n 2 "$OUT/pytest_kernels.log" | tr '\n' ' ')")
  step drafter_cuda 100 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s10.json"
  step profile_kernels 60 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-code-s10-final.json"
  step bench_tiny 150 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s10.json" ;;
moon10)  # session 10: the Moonlight bench (as run, it first timed a warp-search tree_build against the heap with a
  # session-local script; the warp search lost and was not kept, see docs/PERF.md)
  step bench_moonlight 400 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s10.json" ;;
norm-moon10)  # session 10: Moonlight verify with the norm fused everywhere vs the small-weight rule, one machine
  step ab_all 200 python3 scripts/ab_fused_norm.py all
  step ab_rule 110 python3 scripts/ab_fused_norm.py rule ;;
kv-ab)  # next: KDT_MLA_FUSE_KV (session 10, unmeasured): its gpu test, kdt verify with it on, then the drafter table
  # on / off back to back (each compiles everything: the variable is part of the kernel-cache key)
  export KDT_MLA_FUSE_KV=1
  step pytest_fused_kv 120 python3 -m pytest -q -m gpu tests/test_kernels_mla.py -k latent_write_and_absorb \
    -p no:cacheprovider
  step verify_code_kv 150 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step drafter_kv 100 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-fused-kv.json"
  export KDT_MLA_FUSE_KV=0
  step drafter_no_kv 170 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-unfused-kv.json" ;;
s11a)  # session 11: the one-tile attention splits (H < 16) + small-W_uv uv_project + KDT_MLA_FUSE_KV, against
  # session 10's kernels (each variable off) in the same run; their gpu tests; the MoE layer at M = 17 by launch shape
  ( timeout 300 python3 -m pytest -q -m gpu tests/test_kernels_mla.py -k "code_shape or v2_engine_splits or \
      latent_write_and_absorb or small_weight or num_splits or uv_project_gpu" -p no:cacheprovider --durations=5 \
      > "$OUT/pytest_mla.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_mla.log" ) &
  export KDT_MLA_FUSE_KV=1
  step verify_code_new 150 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  summary+=("pytest_mla: $(tail -n 2 "$OUT/pytest_mla.log" | tr '\n' ' ')")
  step drafter_new 120 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s11-new.json"
  step profile_new 60 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-code-s11-new.json"
  KDT_MLA_FUSE_KV=0 KDT_MLA_SPLITS_BY_WARPS=0 KDT_MLA_UV_ROW_ELEMS=0 step drafter_s10 120 python3 -m kdt.cli \
    train-drafter fixtures/model_code.h5 --eval-only --backend cuda --dtype bf16 \
    --json "$OUT/drafter-$day-model_code-cuda-s11-s10kernels.json"
  KDT_MLA_FUSE_KV=0 step drafter_no_kv 100 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only \
    --backend cuda --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s11-no-fuse-kv.json"
  step moe_sweep 120 python3 scripts/bench_moe.py --presets fixtures/model_code.h5 --M 17 --sweep --parts \
    --json "$OUT/moe-$day-code-m17-sweep.json" ;;
s11b)  # session 11: gpu tests (MLA at model_code's shapes, the gated linear, MoE, engine) beside kdt verify; the
  # drafter table with the defaults and with KDT_LINEAR_FUSE_GLU=0; the learned step's profile; the MoE layer A/B
  # (the gated down projection, KDT_LINEAR_FUSE_GLU, lost and was removed after s11d: see docs/PERF.md)
  ( timeout 330 python3 -m pytest -q -m gpu tests/test_kernels_mla.py -k "code_shape or v2_engine_splits or \
      latent_write_and_absorb or small_weight or num_splits or uv_project_gpu" tests/test_kernels_linear.py \
      tests/test_kernels_moe.py -p no:cacheprovider -rf --durations=5 > "$OUT/pytest_kernels.log" 2>&1; \
      echo "rc=$?" >> "$OUT/pytest_kernels.log" ) &
  ( timeout 330 python3 -m pytest -q -m gpu tests/test_engine_cuda.py tests/test_convert.py tests/test_ddtree_kernels.py \
      -p no:cacheprovider -rf --durations=5 > "$OUT/pytest_engine.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_engine.log" ) &
  step verify_cuda_fp32 200 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 150 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  grep -h "^FAILED\|^ERROR\|passed\|failed" "$OUT/pytest_kernels.log" "$OUT/pytest_engine.log" | cut -c1-300
  summary+=("pytest_kernels: $(tail -n 2 "$OUT/pytest_kernels.log" | tr '\n' ' ')")
  summary+=("pytest_engine: $(tail -n 2 "$OUT/pytest_engine.log" | tr '\n' ' ')")
  step drafter_cuda 100 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s11.json"
  KDT_LINEAR_FUSE_GLU=0 step drafter_no_glu 100 python3 -m kdt.cli train-drafter fixtures/model_code.h5 \
    --eval-only --backend cuda --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s11-no-glu.json"
  step profile_kernels 60 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-code-s11.json"
  step moe_ab 100 python3 scripts/bench_moe.py --presets fixtures/model_code.h5 --M 16,17,65 --previous \
    --json "$OUT/moe-$day-code-s11.json"
  grep -h "budget\|acceptance" "$OUT"/drafter_*.log ;;
s11c)  # session 11: the tiny bench, then the Moonlight bench (its latent write now in q_absorb's launch). As run:
  # the tiny bench alone (the same command); the Moonlight bench did not fit the session's device time
  step bench_tiny 150 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s11.json"
  step bench_moonlight 400 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s11.json" ;;
s11d)  # session 11's last call: the gpu tests of its last changes (the latent write's block, the MoE tile rule,
  # the gated linear) beside kdt verify; the drafter table with the defaults, then with KDT_LINEAR_FUSE_GLU=0
  ( timeout 240 python3 -m pytest -q -m gpu tests/test_kernels_mla.py::test_latent_write_and_absorb_fused_gpu \
      tests/test_kernels_mla.py::test_mla_chain_gpu_code_shape tests/test_kernels_mla.py::test_kv_latent_write_gpu \
      tests/test_kernels_moe.py::test_moe_forward_code_shape_gpu tests/test_kernels_moe.py::test_dense_mlp_gpu \
      -p no:cacheprovider -rf > "$OUT/pytest_gpu.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_gpu.log" ) &
  ( timeout 240 python3 -m pytest -q tests/test_kernels_linear.py -k "glu or norm" -p no:cacheprovider -rf \
      > "$OUT/pytest_linear.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_linear.log" ) &
  step verify_cuda_fp32 120 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 120 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_gpu.log" "$OUT/pytest_linear.log" | cut -c1-300
  step drafter_cuda 90 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s11-final.json"
  KDT_LINEAR_FUSE_GLU=0 step drafter_no_glu 130 python3 -m kdt.cli train-drafter fixtures/model_code.h5 \
    --eval-only --backend cuda --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s11-no-glu.json"
  grep -h "budget\|acceptance" "$OUT"/drafter_*.log ;;
s12t)  # session 12, issue 8: the committed drafter trained further, alone on the GPU (fresh continuations: seed 1,
  # a lower peak lr); the model comes back in 15 MB parts (its acceptance table runs in the next call)
  step train_resume ${DRAFT_TIMEOUT:-540} python3 -m kdt.cli train-drafter fixtures/model_code.h5 --resume \
    --out /tmp/resumed.h5 --device cuda --minutes ${DRAFT_MIN:-7} --sequences ${DRAFT_SEQ:-65536} --batch 256 \
    --anchors 16 --seed ${DRAFT_SEED:-1} --lr ${DRAFT_LR:-0.001} --eval-prompts 0
  grep -h "eval\|wrote" "$OUT/train_resume.log" | tail -n 4 | cut -c1-300
  [ -f /tmp/resumed.h5 ] && parts /tmp/resumed.h5 ;;
s12a)  # session 12: tree_build's warp search and the resumed drafter (carry out/resumed.h5 too): the ddtree and
  # engine gpu tests beside kdt verify (the committed model, the resumed one); then alone: tree_build warp vs heap,
  # the drafter table of the resumed drafter, of the committed one, and of the resumed one with the heap search
  ( timeout 240 python3 -m pytest -q -m gpu tests/test_ddtree_kernels.py tests/test_engine_cuda.py -p no:cacheprovider \
      -rf > "$OUT/pytest_gpu.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_gpu.log" ) &
  step verify_cuda_fp32 150 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 120 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step verify_resumed 90 python3 -m kdt.cli verify out/resumed.h5 --backend cuda --dtype bf16
  wait
  grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_gpu.log" | cut -c1-300
  step bench_tree 60 python3 scripts/bench_tree.py --json "$OUT/tree-build-$day-warp-vs-heap.json"
  step drafter_resumed 170 python3 -m kdt.cli train-drafter out/resumed.h5 --eval-only --backend cuda --dtype bf16 \
    --out /tmp/model_code_resumed.h5 --json "$OUT/drafter-$day-model_code-cuda-s12-resumed.json"
  step drafter_committed 55 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --budgets 16 --json "$OUT/drafter-$day-model_code-cuda-s12-committed.json"
  KDT_TREE_WARP_MAX=0 step drafter_resumed_heap 55 python3 -m kdt.cli train-drafter out/resumed.h5 --eval-only \
    --backend cuda --dtype bf16 --budgets 16 --json "$OUT/drafter-$day-model_code-cuda-s12-resumed-heap.json"
  [ -f /tmp/model_code_resumed.h5 ] && parts /tmp/model_code_resumed.h5
  cat "$OUT/bench_tree.log"; grep -h "budget\|acceptance\| ar \|chain" "$OUT"/drafter_*.log | cut -c1-200 ;;
s12b)  # session 12's last call: tree_build warp vs heap (GPU time behind a spin kernel), the Moonlight bench (not
  # run since session 10: the latent write in q_absorb's launch is on by default since session 11), the tiny bench
  step bench_tree 45 python3 scripts/bench_tree.py --json "$OUT/tree-build-$day-warp-vs-heap.json"
  step bench_moonlight 380 python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s12.json"
  step bench_tiny 150 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s12.json"
  cat "$OUT/bench_tree.log" ;;
s12c)  # session 12's last call: the split combine in the W_uv projection's launch and tree_build's K >= 2 rule: the
  # MLA / ddtree / engine gpu tests beside kdt verify (the fixture's new drafter); then alone: the drafter table,
  # the same at budget 16 with KDT_MLA_FUSE_COMBINE_UV=0, tree_build by the rule vs the heap, the tiny bench.
  # As run; the combine fusion (mla.attention_uv, its tests and variable) was removed after it (no measured gain)
  ( timeout 280 python3 -m pytest -q -m gpu tests/test_ddtree_kernels.py tests/test_engine_cuda.py \
      "tests/test_kernels_mla.py::test_attention_uv_gpu_code_shape" "tests/test_kernels_mla.py::test_mla_chain_gpu_code_shape" \
      -p no:cacheprovider -rf > "$OUT/pytest_gpu.log" 2>&1
    echo "rc=$?" >> "$OUT/pytest_gpu.log" ) &
  step verify_cuda_fp32 150 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
  step verify_code_cuda 120 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_gpu.log" | cut -c1-300
  step drafter_final 170 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --json "$OUT/drafter-$day-model_code-cuda-s12-final.json"
  KDT_MLA_FUSE_COMBINE_UV=0 step drafter_unfused 60 python3 -m kdt.cli train-drafter fixtures/model_code.h5 \
    --eval-only --backend cuda --dtype bf16 --budgets 16 --json "$OUT/drafter-$day-model_code-cuda-s12-unfused-combine.json"
  step bench_tree 30 python3 scripts/bench_tree.py --json "$OUT/tree-build-$day-rule-vs-heap.json"
  step bench_tiny 60 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s12c.json"
  cat "$OUT/bench_tree.log"; grep -h "budget\|acceptance" "$OUT"/drafter_*.log | cut -c1-200 ;;
s13a)  # session 13's first call: the warp search's one lane helper (session 12's last commits) on the H200: the
  # ddtree / engine / MLA gpu tests beside kdt verify; then alone: where a step's time goes (tiny AR / oracle chain,
  # model_code AR / learned budget 16), kernel by kernel
  tests_beside_verify tests/test_ddtree_kernels.py tests/test_engine_cuda.py \
    "tests/test_kernels_mla.py::test_mla_chain_gpu_code_shape"
  step profile 200 python3 scripts/profile_kernels.py --cases tiny,code --json "$OUT/profile-kernels-$day-s13a.json"
  grep -v "^ *$" "$OUT/profile.log" | cut -c1-160 ;;
s13b)  # session 13, issue 8: fewer DDTree-only launches (the block's rows in stage_draft, the feature copies in MoE
  # kernel C) and the drafter trained further (carry out/resumed.h5): the gpu tests beside kdt verify; then alone:
  # the resumed drafter's table with bf16 weights and with float32 (the drafter was trained on the float32 target)
  tests_beside_verify tests/test_ddtree_kernels.py tests/test_engine_cuda.py \
    "tests/test_kernels_moe.py::test_moe_forward_code_shape_gpu"
  step drafter_resumed 170 python3 -m kdt.cli train-drafter out/resumed.h5 --eval-only --backend cuda --dtype bf16 \
    --json "$OUT/drafter-$day-model_code-cuda-s13-resumed-bf16.json"
  step drafter_resumed_fp32 ${FP32_TIMEOUT:-200} python3 -m kdt.cli train-drafter out/resumed.h5 --eval-only \
    --backend cuda --dtype float32 --json "$OUT/drafter-$day-model_code-cuda-s13-resumed-fp32.json"
  grep -h "budget\|acceptance\| ar \|chain" "$OUT"/drafter_*.log | cut -c1-200 ;;
s13c)  # session 13: draft_topk's rank path; then this code against the code before the session (carry out/base13 =
  # `git archive 0733207 kdt` and out/resumed.h5) on one machine with the same drafter: the full table, then
  # budget 16 with the code before and again with this code. As run; the rank path was reverted after it (no
  # measured gain; the eager profile of s13d timed it slower than the sort)
  ( timeout 200 python3 -m pytest -q -m gpu tests/test_ddtree_kernels.py tests/test_engine_cuda.py -k "topk or learned" \
      -p no:cacheprovider -rf > "$OUT/pytest_gpu.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_gpu.log" ) &
  step verify_code_cuda 120 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_gpu.log" | cut -c1-300
  step drafter_after 170 python3 -m kdt.cli train-drafter out/resumed.h5 --eval-only --backend cuda --dtype bf16 \
    --json "$OUT/drafter-$day-model_code-cuda-s13-after.json"
  OUTA=$(cd "$OUT" && pwd)
  ( cd out/base13 && OUT=$OUTA KDT_CACHE_DIR=/tmp/kdt_cache_base step drafter_before 150 python3 -m kdt.cli \
      train-drafter ../resumed.h5 --eval-only --backend cuda --dtype bf16 --budgets 16 \
      --json "$OUTA/drafter-$day-model_code-cuda-s13-before.json"; printf '%s\n' "${summary[-1]}" )
  step drafter_after2 60 python3 -m kdt.cli train-drafter out/resumed.h5 --eval-only --backend cuda --dtype bf16 \
    --budgets 16 --json "$OUT/drafter-$day-model_code-cuda-s13-after2.json"
  grep -h "budget\|acceptance\| ar \|chain" "$OUT"/drafter_*.log | cut -c1-200 ;;
s13d)  # session 13's last call: kdt verify of model_code.h5 with the drafter trained further (now the fixture's), then
  # where the learned step's time goes kernel by kernel (compare s13a: the launches this session removed)
  step verify_code_cuda 130 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  step profile 90 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-s13d.json"
  grep -v "^ *$" "$OUT/profile.log" | cut -c1-160 ;;
s14t)  # session 14's first call: the drafter trained a fourth time (seed 3, a lower peak lr) in the foreground, while
  # in the background the gpu tests of commit 788a1f2 (ddtree, engine, MLA and MoE code shapes) and kdt verify of
  # tiny (fp32) and model_code (bf16, session 13's drafter) run, each in its own process (cold compiles take minutes)
  ( timeout 420 python3 -m pytest -q -m gpu tests/test_ddtree_kernels.py tests/test_engine_cuda.py \
      "tests/test_kernels_mla.py::test_mla_chain_gpu_code_shape" "tests/test_kernels_moe.py::test_moe_forward_code_shape_gpu" \
      -p no:cacheprovider -rf > "$OUT/pytest_gpu.log" 2>&1; echo "rc=$?" >> "$OUT/pytest_gpu.log" ) &
  ( step verify_cuda_fp32 420 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
    printf '%s\n' "${summary[@]}" > "$OUT/verify_tiny.txt" ) &
  ( step verify_code_cuda 450 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
    printf '%s\n' "${summary[@]}" > "$OUT/verify_code.txt" ) &
  step train_resume ${DRAFT_TIMEOUT:-540} python3 -m kdt.cli train-drafter fixtures/model_code.h5 --resume \
    --out /tmp/resumed.h5 --device cuda --minutes ${DRAFT_MIN:-6.5} --sequences 65536 --batch 256 \
    --anchors 16 --seed ${DRAFT_SEED:-3} --lr ${DRAFT_LR:-0.0005} --eval-prompts 0
  wait
  cat "$OUT/verify_tiny.txt" "$OUT/verify_code.txt"; rm -f "$OUT"/verify_*.txt
  grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_gpu.log" | cut -c1-300
  grep -h "eval\|wrote" "$OUT/train_resume.log" | tail -n 4 | cut -c1-300
  [ -f /tmp/resumed.h5 ] && parts /tmp/resumed.h5 ;;
s14a)  # session 14: the small-layer MoE path (two launches, every expert for every token; carry out/resumed14.h5, the
  # drafter trained a fourth time in s14t): gpu tests (MoE code shape both paths, the engine) beside kdt verify; then
  # alone: the resumed drafter's table with the small path, the same drafter at budget 16 with it off
  # (KDT_MOE_SMALL=0: version 2, the code before), the tiny bench (issue 7) and the committed drafter at budget 16
  tests_beside_verifies gpu 280 tests/test_engine_cuda.py "tests/test_kernels_moe.py::test_moe_forward_code_shape_gpu"
  step drafter_small 150 python3 -m kdt.cli train-drafter out/resumed14.h5 --eval-only --backend cuda --dtype bf16 \
    --json "$OUT/drafter-$day-model_code-cuda-s14-resumed-small.json"
  KDT_MOE_SMALL=0 step drafter_v2 90 python3 -m kdt.cli train-drafter out/resumed14.h5 --eval-only --backend cuda \
    --dtype bf16 --budgets 16 --json "$OUT/drafter-$day-model_code-cuda-s14-resumed-v2.json"
  step bench_tiny 80 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s14-small.json"
  step drafter_committed 50 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --budgets 16 --json "$OUT/drafter-$day-model_code-cuda-s14-committed-small.json"
  grep -h "budget\|acceptance\| ar \|chain" "$OUT"/drafter_*.log | cut -c1-200 ;;
s14b)  # session 14's last call: the small-layer MoE path against version 2 on one machine: the MoE layer alone
  # (scripts/bench_moe.py, model_code's shape, M = 1 / 17), the drafter table at budget 16 (carry out/resumed14.h5)
  # off / on, the tiny bench on / off (issue 7)
  step bench_moe 150 python3 scripts/bench_moe.py --presets fixtures/model_code.h5 --M 1,17 \
    --json "$OUT/moe-$day-code-s14-small.json"
  KDT_MOE_SMALL=0 step drafter_v2 200 python3 -m kdt.cli train-drafter out/resumed14.h5 --eval-only --backend cuda \
    --dtype bf16 --budgets 16 --json "$OUT/drafter-$day-model_code-cuda-s14-resumed-v2.json"
  step drafter_small 90 python3 -m kdt.cli train-drafter out/resumed14.h5 --eval-only --backend cuda --dtype bf16 \
    --budgets 16 --json "$OUT/drafter-$day-model_code-cuda-s14-resumed-small-b16.json"
  step bench_tiny 80 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s14b-small.json"
  KDT_MOE_SMALL=0 step bench_tiny_v2 100 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s14b-v2.json"
  grep -h "v1\|v2\|v3" "$OUT/bench_moe.log" | cut -c1-160
  grep -h "budget" "$OUT"/drafter_*.log | cut -c1-200
  grep -h "decode AR:\|oracle chain:\|host work" "$OUT"/bench_tiny*.log ;;
s15a)  # session 15: the drafter trained a fifth time (s14t with DRAFT_SEED=4 DRAFT_MIN=7.5; carry out/resumed15.h5):
  # its table (bf16, every budget, GPU alone); then the step's GPU time by phase (drafter forward, top-k, tree build,
  # target forward, the rest) for tiny AR / oracle chain and model_code AR / learned budget 16
  step drafter_resumed 220 python3 -m kdt.cli train-drafter out/resumed15.h5 --eval-only --backend cuda --dtype bf16 \
    --json "$OUT/drafter-$day-model_code-cuda-s15-resumed.json"
  step profile 240 python3 scripts/profile_kernels.py --cases tiny,code --json "$OUT/profile-kernels-$day-s15a.json"
  grep -h "budget\|acceptance\| ar \|chain" "$OUT"/drafter_*.log | cut -c1-200
  grep -v "^ *$" "$OUT/profile.log" | cut -c1-160 ;;
s15b)  # session 15: S1's route warps sum all E logits in one pass over D: the small path's gpu tests and the engine's
  # beside kdt verify; then alone: the phase profile (S1's time at M = 1 and 17 against s15a's), the committed
  # drafter's table at budget 16 (issue 8), the tiny bench (issue 7)
  # (the MoE simulator tests run on the GPU too: -m "gpu or kernels")
  tests_beside_verifies "gpu or kernels" 250 tests/test_engine_cuda.py tests/test_kernels_moe.py \
    -k "engine or code_shape or small or matches_reference or tee"
  step profile 150 python3 scripts/profile_kernels.py --cases tiny,code --json "$OUT/profile-kernels-$day-s15b.json"
  step drafter_committed 150 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --budgets 16 --json "$OUT/drafter-$day-model_code-cuda-s15b.json"
  step bench_tiny 120 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s15b.json"
  grep -h "budget\|acceptance\| ar \|chain" "$OUT"/drafter_*.log | cut -c1-200
  grep -h "decode AR:\|oracle chain:\|host work" "$OUT"/bench_tiny.log
  grep -h "==\|graph wall\|_small_\|phase\|^   [a-z ]*forward  \|tree build  \|rest  " "$OUT/profile.log" | cut -c1-160 ;;
s15c)  # session 15's last call: the MoE kernel tests on the GPU again (s15b's copy of the tree carried a mutation of
  # the tail loop, made locally to check that the new test can fail: its 5 failures were that), then the S1 change
  # A/B on one machine: the committed drafter at budget 16 with the code before (carry out/base15 = `git archive
  # e15ffe5 kdt`), then with this code
  step pytest_moe 200 python3 -m pytest -q -m "gpu or kernels" tests/test_kernels_moe.py \
    -k "small or matches_reference or code_shape or tee" -p no:cacheprovider -rf
  OUTA=$(cd "$OUT" && pwd)
  ( cd out/base15 && OUT=$OUTA KDT_CACHE_DIR=/tmp/kdt_cache_base step drafter_before 200 python3 -m kdt.cli \
      train-drafter ../../fixtures/model_code.h5 --eval-only --backend cuda --dtype bf16 --budgets 16 \
      --json "$OUTA/drafter-$day-model_code-cuda-s15c-before.json"; printf '%s\n' "${summary[-1]}" )
  step drafter_after 200 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda \
    --dtype bf16 --budgets 16 --json "$OUT/drafter-$day-model_code-cuda-s15c-after.json"
  grep -h "passed\|failed\|^FAILED" "$OUT/pytest_moe.log" | cut -c1-200
  grep -h "budget" "$OUT"/drafter_*.log | cut -c1-200 ;;
s16a)  # session 16: issue 8's table (budget 16) timed in 3 rounds on this code, then A/B by env on one machine: the
  # drafter's matrices in bf16 (KDT_DRAFTER_DTYPE), the dense MLP's version 1 (silu * up in the gate_up launch), both;
  # then the phase profile with the 1000 us spin (q_absorb2's stalls), then the drafter's gpu parity tests
  step drafter_base 200 $tbl --json "$OUT/drafter-$day-model_code-cuda-s16a-base.json"
  step drafter_bf16 120 env KDT_DRAFTER_DTYPE=bf16 $tbl --json "$OUT/drafter-$day-model_code-cuda-s16a-bf16.json"
  step drafter_mlp1 120 env KDT_DENSE_MLP_VERSION=1 $tbl --json "$OUT/drafter-$day-model_code-cuda-s16a-mlp1.json"
  step drafter_both 120 env KDT_DRAFTER_DTYPE=bf16 KDT_DENSE_MLP_VERSION=1 $tbl \
    --json "$OUT/drafter-$day-model_code-cuda-s16a-both.json"
  step profile 150 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-s16a.json"
  step pytest_draft 100 python3 -m pytest -q -m gpu tests/test_engine_cuda.py -k "draft_model or learned" \
    -p no:cacheprovider -rf
  grep -h "budget\|chain\| ar " "$OUT"/drafter_*.log | cut -c1-200
  grep -h "passed\|failed\|^FAILED" "$OUT/pytest_draft.log" | cut -c1-200
  grep -h "==\|graph wall\|q_absorb\|phase\|^   [a-z ]*forward  \|tree build  \|rest  " "$OUT/profile.log" | cut -c1-160 ;;
s16b)  # session 16: the warp top-k: the ddtree and engine gpu tests (and the ddtree simulator tests, run on the GPU)
  # beside kdt verify; then issue 8's table (budget 16, 3 rounds) with the warp top-k, with the sort
  # (KDT_TOPK_WARP=0), with the warp top-k again (one machine, alternated); then the phase profile
  tests_beside_verifies "gpu or kernels" 250 tests/test_ddtree_kernels.py tests/test_engine_cuda.py
  step drafter_warp 150 $tbl --json "$OUT/drafter-$day-model_code-cuda-s16b-warp.json"
  step drafter_sort 100 env KDT_TOPK_WARP=0 $tbl --json "$OUT/drafter-$day-model_code-cuda-s16b-sort.json"
  step drafter_warp2 100 $tbl --json "$OUT/drafter-$day-model_code-cuda-s16b-warp2.json"
  step profile 100 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-s16b.json"
  grep -h "budget\|chain\| ar " "$OUT"/drafter_*.log | cut -c1-200
  grep -h "==\|graph wall\|draft_topk\|phase\|^   [a-z ]*forward  \|tree build  \|rest  " "$OUT/profile.log" | cut -c1-160 ;;
s16c)  # session 16: the drafter's next rows staged in gather_accepted (one launch less a learned step): the ddtree
  # and engine gpu tests (and the ddtree simulator tests, run on the GPU) beside kdt verify; then issue 8's table
  # (budget 16, 3 rounds) with this code, with the code before (carry out/base16 = `git archive 8d876c2 kdt`),
  # with this code again (one machine, alternated); then the phase profile
  tests_beside_verifies "gpu or kernels" 250 tests/test_ddtree_kernels.py tests/test_engine_cuda.py
  step drafter_after 100 $tbl --json "$OUT/drafter-$day-model_code-cuda-s16c-after.json"
  OUTA=$(cd "$OUT" && pwd)
  ( cd out/base16 && OUT=$OUTA KDT_CACHE_DIR=/tmp/kdt_cache_base step drafter_before 200 python3 -m kdt.cli \
      train-drafter ../../fixtures/model_code.h5 --eval-only --backend cuda --dtype bf16 --budgets 16 --repeats 3 \
      --json "$OUTA/drafter-$day-model_code-cuda-s16c-before.json"; printf '%s\n' "${summary[-1]}" )
  step drafter_after2 100 $tbl --json "$OUT/drafter-$day-model_code-cuda-s16c-after2.json"
  step profile 100 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-s16c.json"
  grep -h "budget\|chain\| ar " "$OUT"/drafter_*.log | cut -c1-200
  grep -h "==\|graph wall\|phase\|^   [a-z ]*forward  \|tree build  \|rest  \|gather\|stage_draft" "$OUT/profile.log" | cut -c1-160 ;;
s17a)  # session 17: Nsight Compute on the learned step's single-warp kernels, at its shapes: tree_build (15 x 16
  # drafts, budget 16: the warp search) and draft_topk (15 x 256 logits, K 16: the sort, then the warp selection);
  # what the ~4x between their time and their instruction count is made of (stall reasons, issue rate)
  command -v ncu > /dev/null || PATH=$PATH:$(ls -d /opt/nvidia/nsight-compute/*/ | tail -1)
  ncu --version | tail -1
  met='smsp__inst_executed.sum,smsp__cycles_active.max,gpu__time_duration.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
  secs="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats"
  step ncu_tree 200 ncu --clock-control none -k regex:tree_build -c 1 $secs --metrics "$met" \
    python3 scripts/bench_tree.py --budgets 16 --shapes 15x16
  cat > /tmp/topk_once.py <<'PY'
import numpy as np
from numba import cuda
from kdt.kernels import ddtree as kd
x = cuda.to_device(np.random.default_rng(0).standard_normal((15, 256)).astype(np.float32))
tok, lp = cuda.device_array((1, 15, 16), np.int64), cuda.device_array((1, 15, 16), np.float32)
for warp in (False, True):
    kd.TOPK_WARP = warp
    kd.topk_gpu(x, tok, lp)
    cuda.synchronize()
    print("warp" if warp else "sort", tok.copy_to_host()[0, 0, :4])
PY
  step ncu_topk 200 ncu --clock-control none -k regex:draft_topk -c 2 $secs --metrics "$met" python3 /tmp/topk_once.py
  grep -h "tree_build\|draft_topk\|Duration\|Elapsed Cycles\|Executed Ipc A\|Issue Slots Busy\|Warp Cycles Per Issued\|Registers Per\|inst_executed.sum\|cycles_active.max\|stalled_[a-z_]*_per_issue_active.ratio  *[a-z/]*  *[0-9.]*[1-9]" \
    "$OUT"/ncu_*.log | cut -c1-150 ;;
s17b)  # session 17: the final code's ddtree and engine gpu tests (and the ddtree simulator tests, run on the GPU)
  # beside kdt verify of tiny (fp32) and model_code (bf16)
  tests_beside_verifies "gpu or kernels" 250 tests/test_ddtree_kernels.py tests/test_engine_cuda.py ;;
s18a)  # session 18: draft_tree (the learned step's top-k and tree build in one launch, since removed), the packed
  # warp search, chains without a search, silu * up in the dense MLP's down projection: the ddtree and engine gpu
  # tests (and the ddtree simulator tests, run on the GPU) beside kdt verify; the GLU linear and dense MLP tests;
  # issue 8's table (budget 16, 3 rounds); the phase profile
  tests_beside_verifies "gpu or kernels" 250 tests/test_ddtree_kernels.py tests/test_engine_cuda.py
  step glu_tests 150 python3 -m pytest -q -m "gpu or kernels" tests/test_kernels_linear.py tests/test_kernels_moe.py \
    -k "glu or dense_mlp" -p no:cacheprovider -rf
  step drafter_after 150 $tbl --json "$OUT/drafter-$day-model_code-cuda-s18a.json"
  step profile 100 python3 scripts/profile_kernels.py --cases code --json "$OUT/profile-kernels-$day-s18a.json"
  grep -h "budget\|chain\| ar " "$OUT"/drafter_*.log | cut -c1-200
  grep -h "==\|graph wall\|phase\|^   [a-z +-]*  \|tree build  \|rest  \|draft_tree" "$OUT/profile.log" | cut -c1-160 ;;
s18c)  # session 18, the final kernels (draft_tree removed; branch-free comparisons in the search and the sort): the
  # ddtree and engine gpu tests beside kdt verify; draft_topk and tree_build from the learned step's logits and
  # drafts (scripts/bench_tree.py)
  tests_beside_verifies "gpu or kernels" 250 tests/test_ddtree_kernels.py tests/test_engine_cuda.py
  step tree_logits 100 python3 scripts/bench_tree.py --logits 15x256x16 --budgets 0,15,16,31,64 \
    --json "$OUT/tree-logits-$day-s18c.json"
  step tree_shapes 100 python3 scripts/bench_tree.py --budgets 15,16 --shapes 15x1,15x16 \
    --json "$OUT/tree-build-$day-s18c.json"
  cat "$OUT/tree_logits.log" "$OUT/tree_shapes.log" | cut -c1-160 ;;
s18b)  # session 18: issue 8's table (budget 16, 3 rounds) with this code, the code before (carry out/base18 = `git
  # archive 086eaad kdt`), this code again (one machine, alternated); the tiny bench (issue 7's oracle chain)
  step drafter_after 150 $tbl --json "$OUT/drafter-$day-model_code-cuda-s18b-after.json"
  table_before base18 "drafter-$day-model_code-cuda-s18b-before.json"
  step drafter_after2 120 $tbl --json "$OUT/drafter-$day-model_code-cuda-s18b-after2.json"
  step bench_tiny 120 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s18b.json"
  grep -h "budget\|chain\| ar " "$OUT"/drafter_*.log | cut -c1-200
  tail -n 30 "$OUT/bench_tiny.log" | cut -c1-160 ;;
s18d)  # session 18: silu * up in the down projection, on and off (env KDT_LINEAR_FUSE_GLU), alternated on one machine,
  # issue 8's table (budget 16, 3 rounds); the code before once more (carry out/base18); the tiny bench with it off
  for r in 1 2; do
    step drafter_glu1_$r 150 $tbl --json "$OUT/drafter-$day-model_code-cuda-s18d-glu1-$r.json"
    KDT_LINEAR_FUSE_GLU=0 step drafter_glu0_$r 150 $tbl --json "$OUT/drafter-$day-model_code-cuda-s18d-glu0-$r.json"
  done
  table_before base18 "drafter-$day-model_code-cuda-s18d-before.json"
  KDT_LINEAR_FUSE_GLU=0 step bench_tiny 120 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s18d-glu0.json"
  for f in "$OUT"/drafter_*.log; do echo "== $f"; grep -h "budget\|chain\| ar " "$f" | cut -c1-150; done
  grep -h "decode AR:\|oracle chain:\|host work" "$OUT/bench_tiny.log" ;;
s19a)  # session 19: HEAD's ddtree and engine gpu tests beside kdt verify; every launch of the learned step timed inside
  # a CUDA graph (scripts/profile_graphs.py); issue 8's table at budgets 16 / 24 / 32 (3 rounds)
  tests_beside_verifies "gpu or kernels" 250 tests/test_ddtree_kernels.py tests/test_engine_cuda.py
  step graphs 120 python3 scripts/profile_graphs.py --json "$OUT/profile-graphs-$day-s19a.json"
  step budgets 200 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda --dtype bf16 \
    --budgets 16,24,32 --repeats 3 --json "$OUT/drafter-$day-model_code-cuda-s19a-budgets.json"
  cut -c1-120 "$OUT/graphs.log"
  grep -h "budget\|chain\| ar " "$OUT/budgets.log" | cut -c1-200 ;;
s19b)  # session 19: the attention's minimum keys per split (KDT_MLA_MIN_KEYS, read on the device against L): the
  # in-graph sweep, then issue 8's table at budgets 16 / 24 / 28 / 31 alternated on one machine with 8 (the bound
  # before), 64 and 32 keys; the learned step's launches with 64. As run at the session's uncommitted code: the
  # knob and profile_graphs.py's --attention sweep were removed after it (more keys a split was slower everywhere)
  step attn_sweep 150 python3 scripts/profile_graphs.py --attention 8,32,64,128 --json "$OUT/attn-min-keys-$day-s19b.json"
  b="--budgets 16,24,28,31 --repeats 3"
  for k in 8 64 32 8 64; do
    KDT_MLA_MIN_KEYS=$k step table_k${k}_$SECONDS 150 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only \
      --backend cuda --dtype bf16 $b --json "$OUT/drafter-$day-model_code-cuda-s19b-k$k-$SECONDS.json"
  done
  KDT_MLA_MIN_KEYS=64 step graphs64 100 python3 scripts/profile_graphs.py --json "$OUT/profile-graphs-$day-s19b-k64.json"
  cat "$OUT/attn_sweep.log" | cut -c1-150
  for f in "$OUT"/table_*.log; do echo "== $f"; grep -h "budget\|chain\| ar " "$f" | cut -c1-150; done
  grep -h "^  [a-zA-Z]" "$OUT/graphs64.log" | grep -v "^   *[0-9]" | cut -c1-120 ;;
s19c)  # session 19's last call: the final code's ddtree and engine gpu tests beside kdt verify; issue 8's table at
  # the default budgets (16 / 31 / 64 / 256, 3 rounds); every launch of the budget-31 step inside a graph
  tests_beside_verifies "gpu or kernels" 250 tests/test_ddtree_kernels.py tests/test_engine_cuda.py
  step table 200 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda --dtype bf16 \
    --repeats 3 --json "$OUT/drafter-$day-model_code-cuda-s19c.json"
  step graphs31 100 python3 scripts/profile_graphs.py --budget 31 --json "$OUT/profile-graphs-$day-s19c-b31.json"
  step generate 100 python3 -m kdt.cli generate --model fixtures/model_code.h5 --prompt "def " -n 200 --backend cuda \
    --dtype bf16
  grep -h "budget\|chain\| ar " "$OUT/table.log" | cut -c1-200
  grep -h "^  [a-zA-Z]" "$OUT/graphs31.log" | cut -c1-120
  tail -n 3 "$OUT/generate.log" | cut -c1-300 ;;
s19d)  # session 19, issue 7's tiny oracle chain (6x AR): the AR and oracle-chain steps launch by launch inside a
  # graph (scripts/profile_graphs.py, the oracle drafted on the host), then the tiny bench (wall clock, host work)
  step graphs_tiny 200 python3 scripts/profile_graphs.py --model fixtures/model_tiny.h5 --dtype float32 --budget 7 \
    --json "$OUT/profile-graphs-$day-s19d-tiny-chain.json"
  step bench_tiny 150 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s19d.json"
  grep -h "^  [a-zA-Z]" "$OUT/graphs_tiny.log" | cut -c1-120
  grep -h "decode AR:\|oracle chain:\|host work" "$OUT/bench_tiny.log" ;;
s19e)  # session 19's last call: the step's record in mapped host memory behind an event, host work counted as the
  # decode's wall time less the wait, the oracle's draft from a cached block: the ddtree and engine gpu tests beside
  # kdt verify; the tiny bench (issue 7's oracle chain and host work); issue 8's table; where the host time goes
  tests_beside_verifies "gpu or kernels" 200 tests/test_ddtree_kernels.py tests/test_engine_cuda.py
  step bench_tiny 100 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s19e.json"
  step table 100 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda --dtype bf16 \
    --repeats 3 --json "$OUT/drafter-$day-model_code-cuda-s19e.json"
  step host 60 python3 scripts/profile_step.py
  grep -h "decode AR:\|oracle chain:\|oracle:\|host work" "$OUT/bench_tiny.log"
  grep -h "budget\|chain\| ar " "$OUT/table.log" | cut -c1-200
  cut -c1-200 "$OUT/host.log" | tail -n 4 ;;
s20a)  # session 20: the attention's blocks take the query rows of several tokens (KDT_MLA_PACK_TOKENS, H < 16):
  # every launch of the budget-31 step in a graph with and without; issue 8's table at budgets 16 / 31 alternated
  # (1, 0, 1); then the MLA gpu tests of the shapes it changes. As run at the session's uncommitted code: the knob
  # was removed after s20b (no gain at the table's L)
  KDT_MLA_PACK_TOKENS=1 step graphs_pack1 120 python3 scripts/profile_graphs.py --budget 31 \
    --json "$OUT/profile-graphs-$day-s20a-b31-pack1.json"
  KDT_MLA_PACK_TOKENS=0 step graphs_pack0 120 python3 scripts/profile_graphs.py --budget 31 \
    --json "$OUT/profile-graphs-$day-s20a-b31-pack0.json"
  for p in 1 0 1; do
    KDT_MLA_PACK_TOKENS=$p step table_pack${p}_$SECONDS 150 python3 -m kdt.cli train-drafter fixtures/model_code.h5 \
      --eval-only --backend cuda --dtype bf16 --budgets 16,31 --repeats 3 \
      --json "$OUT/drafter-$day-model_code-cuda-s20a-pack$p-$SECONDS.json"
  done
  step mla_tests 120 python3 -m pytest -q -m gpu tests/test_kernels_mla.py -p no:cacheprovider -rf \
    -k "engine_splits or code_shape or num_splits"
  for f in "$OUT"/graphs_pack*.log; do echo "== $f"; grep -h "^  [a-zA-Z]\|mla_attention2" "$f" | cut -c1-120; done
  for f in "$OUT"/table_*.log; do echo "== $f"; grep -h "budget\|chain\| ar " "$f" | cut -c1-150; done
  tail -n 3 "$OUT/mla_tests.log" ;;
s20b)  # session 20: profile_graphs.py with every replay at the warm-up's L (prompt 128 + 48; before, L grew by
  # thousands over the replays), the rows of several tokens a block on and off; issue 8's table alternated 5 times.
  # As s20a: KDT_MLA_PACK_TOKENS=0 is the committed code
  for p in 1 0; do
    KDT_MLA_PACK_TOKENS=$p step graphs_pack$p 150 python3 scripts/profile_graphs.py --budget 31 \
      --json "$OUT/profile-graphs-$day-s20b-b31-pack$p.json"
  done
  for p in 1 0 1 0 1; do
    KDT_MLA_PACK_TOKENS=$p step table_pack${p}_$SECONDS 150 python3 -m kdt.cli train-drafter fixtures/model_code.h5 \
      --eval-only --backend cuda --dtype bf16 --budgets 16,31 --repeats 5 \
      --json "$OUT/drafter-$day-model_code-cuda-s20b-pack$p-$SECONDS.json"
  done
  for f in "$OUT"/graphs_pack*.log; do echo "== $f"; grep -h "^  [a-zA-Z]\|mla_\|^==" "$f" | cut -c1-120; done
  for f in "$OUT"/table_*.log; do echo "== $f"; grep -h "budget\|chain\| ar " "$f" | cut -c1-150; done ;;
s20c)  # session 20's last call (the final code: af823d0's drafters and profile_graphs.py's pinned L): the ddtree
  # and engine gpu tests beside kdt verify; issue 8's table; the tiny bench; kdt generate on CUDA; the step's profile
  # (each step's lines printed as it ends: the call may be cut short)
  tests_beside_verifies "gpu or kernels" 200 tests/test_ddtree_kernels.py tests/test_engine_cuda.py
  step table 100 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda --dtype bf16 \
    --repeats 3 --json "$OUT/drafter-$day-model_code-cuda-s20c.json"
  grep -h "budget\|chain\| ar " "$OUT/table.log" | cut -c1-200
  step bench_tiny 100 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s20c.json"
  grep -h "decode AR:\|oracle chain:\|oracle:\|host work" "$OUT/bench_tiny.log"
  step generate 60 python3 -m kdt.cli generate --model fixtures/model_code.h5 --prompt "def " -n 200 --backend cuda \
    --dtype bf16
  tail -n 3 "$OUT/generate.log" | cut -c1-300
  step graphs31 110 python3 scripts/profile_graphs.py --budget 31 --json "$OUT/profile-graphs-$day-s20c-b31.json"
  grep -h "^  [a-zA-Z]\|^==" "$OUT/graphs31.log" | cut -c1-130 ;;
s20d)  # session 20: the tiny bench with every decode row the median of 5 runs (host work: the median run's)
  step bench_tiny 115 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s20d.json"
  grep -h "decode AR:\|oracle chain:\|oracle:\|host work" "$OUT/bench_tiny.log" ;;
s21a)  # session 21: device steps launched one ahead of the host's read (KDT_STEP_AHEAD, default 1): the ddtree
  # and engine gpu tests beside kdt verify; issue 8's table at budgets 16 / 31 alternated (1, 0, 1); the tiny bench
  tests_beside_verifies "gpu or kernels" 200 tests/test_ddtree_kernels.py tests/test_engine_cuda.py
  for a in 1 0 1; do
    KDT_STEP_AHEAD=$a step table_ahead${a}_$SECONDS 110 python3 -m kdt.cli train-drafter fixtures/model_code.h5 \
      --eval-only --backend cuda --dtype bf16 --budgets 16,31 --repeats 3 \
      --json "$OUT/drafter-$day-model_code-cuda-s21a-ahead$a-$SECONDS.json"
    grep -h "budget\|chain\| ar \|==" "$(ls -t "$OUT"/table_ahead*.log | head -1)" | cut -c1-150
  done
  step bench_tiny 100 python3 -m kdt.cli bench --model fixtures/model_tiny.h5 --dtype float32 \
    --json "$OUT/bench-$day-tiny-s21a.json"
  grep -h "decode AR:\|oracle chain:\|oracle:\|host work" "$OUT/bench_tiny.log" ;;
s21b)  # session 21, issue 8: a 2-layer drafter from the committed drafter's first two layers (kdt train-drafter
  # --resume --layers 2), alone on the GPU; its acceptance at budget 31 (one round); the model back in 15 MB parts
  step train_d2 ${DRAFT_TIMEOUT:-470} python3 -m kdt.cli train-drafter fixtures/model_code.h5 --resume --layers 2 \
    --out /tmp/d2.h5 --device cuda --minutes ${DRAFT_MIN:-6} --sequences 65536 --batch 256 --anchors 16 \
    --seed ${DRAFT_SEED:-6} --lr ${DRAFT_LR:-0.001} --eval-prompts 0
  grep -h "eval\|wrote\|final" "$OUT/train_d2.log" | tail -n 4 | cut -c1-300
  [ -f /tmp/d2.h5 ] && parts /tmp/d2.h5
  step table_d2 100 python3 -m kdt.cli train-drafter /tmp/d2.h5 --eval-only --backend cuda --dtype bf16 \
    --budgets 16,31 --json "$OUT/drafter-$day-model_code-cuda-s21b-d2.json"
  grep -h "budget\|chain\| ar " "$OUT/table_d2.log" | cut -c1-150 ;;
s21c)  # session 21: issue 8's table at budgets 16 / 31, 3 rounds each, one machine: the committed 3-layer drafter with
  # steps launched ahead (KDT_STEP_AHEAD) on, off; s21b's 2-layer drafter (carry out/d2.h5) with it on; off again
  for run in d3:1:150 d3:0:90 d2:1:90 d3:0:90; do
    IFS=: read -r d a t <<< "$run"
    m=fixtures/model_code.h5; [ "$d" = d2 ] && m=out/d2.h5
    KDT_STEP_AHEAD=$a step table_${d}_ahead${a}_$SECONDS "$t" python3 -m kdt.cli train-drafter "$m" --eval-only \
      --backend cuda --dtype bf16 --budgets 16,31 --repeats 3 \
      --json "$OUT/drafter-$day-model_code-cuda-s21c-$d-ahead$a-$SECONDS.json"
    grep -h "budget\|chain\| ar " "$(ls -t "$OUT"/table_*.log | head -1)" | cut -c1-150
  done ;;
s22a)  # session 22, issue 8: s21b's 2-layer drafter (carry out/d2.h5) trained further (--resume), alone on the GPU;
  # the model back in 15 MB parts (its table runs in a later call)
  step train_d2 ${DRAFT_TIMEOUT:-540} python3 -m kdt.cli train-drafter out/d2.h5 --resume \
    --out /tmp/d2b.h5 --device cuda --minutes ${DRAFT_MIN:-7} --sequences 65536 --batch 256 --anchors 16 \
    --seed ${DRAFT_SEED:-7} --lr ${DRAFT_LR:-0.0005} --eval-prompts 0
  grep -h "eval\|wrote\|final" "$OUT/train_d2.log" | tail -n 4 | cut -c1-300
  [ -f /tmp/d2b.h5 ] && parts /tmp/d2b.h5 ;;
s22b)  # session 22, issue 8: the committed 2-layer drafter (s22a's): the ddtree and engine gpu tests beside kdt verify;
  # issue 8's whole table (budgets 16 / 31 / 64 / 256, 3 rounds) recorded in a copy of the model (its drafter meta)
  tests_beside_verifies "gpu or kernels" 200 tests/test_ddtree_kernels.py tests/test_engine_cuda.py
  step table_full 200 python3 -m kdt.cli train-drafter fixtures/model_code.h5 --eval-only --backend cuda --dtype bf16 \
    --budgets 16,31,64,256 --repeats 3 --out /tmp/model_code.h5 --json "$OUT/drafter-$day-model_code-cuda-s22b.json"
  grep -h "budget\|chain\| ar " "$OUT/table_full.log" | cut -c1-150
  [ -f /tmp/model_code.h5 ] && parts /tmp/model_code.h5 ;;
s22c)  # session 22: issue 8's table at budgets 16 / 31, 3 rounds each, alternated on one machine: the 2-layer drafter
  # (fixtures/model_code.h5) and the 3-layer one it replaced (carry out/d3.h5); kdt generate
  for run in d2:150 d3:90 d2:90 d3:90; do
    IFS=: read -r d t <<< "$run"
    m=fixtures/model_code.h5; [ "$d" = d3 ] && m=out/d3.h5
    step table_${d}_$SECONDS "$t" python3 -m kdt.cli train-drafter "$m" --eval-only \
      --backend cuda --dtype bf16 --budgets 16,31 --repeats 3 \
      --json "$OUT/drafter-$day-model_code-cuda-s22c-$d-$SECONDS.json"
    grep -h "budget\|chain\| ar " "$(ls -t "$OUT"/table_*.log | head -1)" | cut -c1-150
  done
  step generate 90 python3 -m kdt.cli generate --model fixtures/model_code.h5 --prompt "def " -n 200 --backend cuda \
    --dtype bf16
  tail -n 25 "$OUT/generate.log" ;;
s23a)  # session 23, issue 7: where a Moonlight-16B AR step's time goes: every launch of the AR step and the oracle
  # chain step in a graph (scripts/profile_graphs.py --preset), the MoE layer's launches as prefixes (bench_moe --parts)
  step profile_moon 330 python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --budget 7 \
    --json "$OUT/profile-graphs-$day-moonlight-s23a.json"
  step moe_parts 200 python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 1,8 --parts \
    --json "$OUT/moe-$day-moonlight-s23a.json"
  grep -h "==\|  all \|step\|forward" "$OUT/profile_moon.log" | grep -v "^ *[0-9]" | cut -c1-150
  tail -n 30 "$OUT/moe_parts.log" ;;
s23b)  # session 23, issue 7: the split argmax and the norm folded into linear at M = 1: their gpu tests and the engine's
  # beside kdt verify; the Moonlight AR step's programs and launches (profile_graphs --preset), then the programs with
  # the norm fold off at M = 1 (KDT_LINEAR_FUSE_NORM_M=0)
  tests_beside_verifies gpu 150 tests/test_kernels_elementwise.py tests/test_kernels_linear.py tests/test_engine_cuda.py
  step profile_moon 200 python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --budget 7 --launches ar \
    --json "$OUT/profile-graphs-$day-moonlight-s23b.json"
  KDT_LINEAR_FUSE_NORM_M=0 step profile_moon_norm0 120 python3 scripts/profile_graphs.py --preset moonlight-16b-a3b \
    --budget 7 --launches none --json "$OUT/profile-graphs-$day-moonlight-s23b-norm0.json"
  for f in profile_moon profile_moon_norm0; do grep -h "==\|  all \|step  \|forward\|empty" "$OUT/$f.log" \
    | grep -v "^ *[0-9]" | cut -c1-150; done ;;
s23c)  # session 23, issue 7: the norm fold's block-wide squares: the split argmax's, the norm's and the engine's gpu
  # tests beside kdt verify; the Moonlight AR step launch by launch (fold on at M = 1), then its programs with it off
  TEST_TIMEOUT=330 tests_beside_verifies gpu 150 tests/test_kernels_elementwise.py tests/test_kernels_linear.py \
    tests/test_engine_cuda.py -k "argmax or norm or cuda or stop"
  step profile_moon 150 python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --budget 7 --launches ar \
    --json "$OUT/profile-graphs-$day-moonlight-s23c.json"
  KDT_LINEAR_FUSE_NORM_M=0 step profile_moon_norm0 170 python3 scripts/profile_graphs.py --preset moonlight-16b-a3b \
    --budget 7 --launches none --json "$OUT/profile-graphs-$day-moonlight-s23c-norm0.json"
  for f in profile_moon profile_moon_norm0; do grep -h "==\|  all \|step  \|forward\|empty" "$OUT/$f.log" \
    | grep -v "^ *[0-9]" | cut -c1-150; done ;;
s23d)  # session 23, issue 7: kdt bench on the Moonlight shape with the final code (the split argmax, the norm fold at
  # M = 1 but lm_head), alone on the GPU
  step bench_moonlight ${BENCH_TIMEOUT:-430} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s23d.json"
  tail -n 45 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
s24b)  # session 24, issue 7: kernel AB (MoE kernels A and B in one launch at M = 1): the MoE layer at M = 1 with it and
  # apart (bench_moe --previous), the Moonlight AR step's programs with it on and off (KDT_MOE_AB_M=0), then its gpu
  # tests (64 forwards against A and B apart, Moonlight at every M, Kimi K2, model_code's shape)
  step moe_ab 200 python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 1,8 --previous \
    --json "$OUT/moe-$day-moonlight-s24b.json"
  step profile_moon 170 python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --budget 7 --launches none \
    --json "$OUT/profile-graphs-$day-moonlight-s24b.json"
  KDT_MOE_AB_M=0 step profile_moon_ab0 150 python3 scripts/profile_graphs.py --preset moonlight-16b-a3b \
    --budget 7 --launches none --json "$OUT/profile-graphs-$day-moonlight-s24b-ab0.json"
  step pytest_moe ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_kernels_moe.py -p no:cacheprovider -rf \
    -k "ab_repeated or moonlight or kimi or code_shape"
  grep -h "moonlight" "$OUT/moe_ab.log" | cut -c1-150
  for f in profile_moon profile_moon_ab0; do grep -h "==\|  all \|step  \|forward\|empty" "$OUT/$f.log" \
    | grep -v "^ *[0-9]" | cut -c1-150; done
  grep -h "^FAILED\|^ERROR\|passed\|failed" "$OUT/pytest_moe.log" | cut -c1-300 ;;
s24c)  # session 24, issue 7: kernel AB with a register cap (the uncapped kernel: 128 registers, 4 blocks an SM, against
  # kernel B's 79): the MoE layer at M = 1 with it, capped at 80 / 96 and apart; then kernel AB's gpu tests (64
  # forwards against A and B apart, Moonlight's and Kimi K2's layer at M = 1, model_code's shape at M = 1)
  step moe_ab 260 python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 1 --previous \
    --json "$OUT/moe-$day-moonlight-s24c.json"
  step pytest_moe ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu tests/test_kernels_moe.py -p no:cacheprovider -rf \
    -s -k "ab_repeated or kimi or 1-fp32-2 or 1-bf16-2 or 16-bf16-2 or code_shape and 1-2"
  grep -h "moonlight" "$OUT/moe_ab.log" | cut -c1-150
  grep -h "rel_err\|^FAILED\|^ERROR\|passed\|failed" "$OUT/pytest_moe.log" | cut -c1-300 ;;
s24d)  # session 24, issue 7: kdt bench on the Moonlight shape with kernel AB (alone on the GPU); then where the host
  # work of a Moonlight DDTree step goes (scripts/profile_step.py, the wait blocking and spinning) beside kdt verify
  step bench_moonlight ${BENCH_TIMEOUT:-360} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s24d.json"
  ( step verify_cuda_fp32 150 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
    step verify_code_cuda 150 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
    printf '%s\n' "${summary[@]}" > "$OUT/verify_summary.txt" ) &
  step profile_step_moon 170 python3 scripts/profile_step.py moonlight-16b-a3b
  wait
  tail -n 45 "$OUT/bench_moonlight.log" | cut -c1-160
  grep -v "^ *$" "$OUT/profile_step_moon.log" | tail -n 6 | cut -c1-250
  cat "$OUT/verify_summary.txt"; grep -h "PASS\|FAIL" "$OUT"/verify_*.log | tail -n 4 ;;
s24e)  # session 24, issue 7: the host work of a Moonlight DDTree step alone on the machine, runs of 64 and 256 tokens
  # (does a one-time cost of a run, spread over its 8 steps, make the 145-211 us?)
  step profile_step_64 150 python3 scripts/profile_step.py moonlight-16b-a3b 64
  step profile_step_256 100 python3 scripts/profile_step.py moonlight-16b-a3b 256
  grep -hv "^ *$" "$OUT/profile_step_64.log" "$OUT/profile_step_256.log" | grep "steps" | cut -c1-250 ;;
s25a)  # session 25, issue 7: kernel A's one-round routing (A 126 -> 80 registers at M = 1) and kernel AB's lighter
  # flags (95 registers): the MoE layer at M = 1 (bench_moe --previous) alone on the GPU; then the MoE gpu tests beside
  # kdt verify (tiny fp32, model_code bf16)
  step moe_ab 240 python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 1,8 --previous \
    --json "$OUT/moe-$day-moonlight-s25a.json"
  grep -h "moonlight" "$OUT/moe_ab.log" | cut -c1-150
  TEST_TIMEOUT=${TEST_TIMEOUT:-300} tests_beside_verifies gpu 200 tests/test_kernels_moe.py \
    -k "ab_repeated or moonlight or kimi or code_shape or route" ;;
s25b)  # session 25, issue 7: programmatic dependent launch (PDL) in the captured graphs: Moonlight's whole programs
  # (AR step, oracle chain step, forwards) captured with and without it in one process (the same kernels); then the
  # engine's gpu tests (graph replay == direct launches, with PDL) beside kdt verify (tiny fp32, model_code bf16)
  step profile_pdl ${PROFILE_TIMEOUT:-300} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --budget 7 --launches none \
    --pdl-ab --json "$OUT/profile-graphs-$day-moonlight-s25b.json"
  grep -h "==\|step\|forward\|empty\|build\|PDL\|Error\|error" "$OUT/profile_pdl.log" | grep -v "^ *[0-9]" | cut -c1-150
  TEST_TIMEOUT=${TEST_TIMEOUT:-200} tests_beside_verifies gpu 150 tests/test_engine_cuda.py ;;
s25c)  # session 25, issue 7: PDL off by default (s25b: slower) and its launch hook moved to the launch configuration
  # (a kernel loaded from the disk cache has no py_func): kdt verify (tiny fp32, model_code bf16) with the default,
  # beside the engine's graph-replay and verify gpu tests with KDT_PDL=1 (each process compiles its own kernels)
  ( step verify_cuda_fp32 170 python3 -m kdt.cli verify fixtures/model_tiny.h5 --backend cuda --dtype float32
    printf '%s\n' "${summary[@]}" > "$OUT/verify_tiny.txt" ) &
  ( KDT_PDL=1 step pdl_tests 170 python3 -m pytest -q -m gpu tests/test_engine_cuda.py -p no:cacheprovider -rf \
      -k "graph_replay or verify_fixture_on_cuda"
    printf '%s\n' "${summary[@]}" > "$OUT/pdl_tests.txt" ) &
  step verify_code_cuda 170 python3 -m kdt.cli verify fixtures/model_code.h5 --backend cuda --dtype bf16
  wait
  cat "$OUT/verify_tiny.txt" "$OUT/pdl_tests.txt"; rm -f "$OUT/verify_tiny.txt" "$OUT/pdl_tests.txt"
  grep -h "PASS\|FAIL" "$OUT"/verify_*.log | tail -n 4
  grep -h "^FAILED\|^ERROR\|passed\|failed" "$OUT/pdl_tests.log" | cut -c1-300 ;;
s26a)  # session 26, issue 7: where Moonlight's budget-63 DDTree step goes (its target forward verifies 64 tokens), launch
  # by launch (the oracle drafter, L ~ 176): the sizing of tensor cores; then s25c's checks of the fixed PDL hook
  step profile_b63 ${PROFILE_TIMEOUT:-300} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --budget 63 \
    --launches step --json "$OUT/profile-graphs-$day-moonlight-s26a.json"
  grep -h "==\|step\|forward\|empty\|build\|phase\|launches\|Error\|error" "$OUT/profile_b63.log" | cut -c1-150 | tail -n 40
  bash "$0" s25c ;;  # (the nested call packs and removes every log: this call's rc is then 2; the logs are in logs.tgz)
s26b)  # session 26, issue 7: tensor cores (mma.sync m16n8k16 through inline PTX) in the MoE kernels at M >= 16: the
  # Moonlight layer at M = 16 / 64 / 256 against the FMA tiles (bench_moe --previous: "fma"), alone on the GPU; then
  # the MoE and tensor-core gpu tests beside kdt verify (tiny fp32, model_code bf16)
  step moe_tc ${BENCH_TIMEOUT:-200} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 16,64,256 --previous \
    --json "$OUT/moe-$day-moonlight-s26b.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_tc.log" | cut -c1-150
  TEST_TIMEOUT=${TEST_TIMEOUT:-300} tests_beside_verifies gpu 200 tests/test_kernels_moe.py tests/test_kernels_tc.py \
    -k "tc_gemm or moonlight or kimi or code_shape" ;;
s26c)  # session 26, issue 7: tensor cores at M = 64 / 256 (s26b timed out after M = 16): the Moonlight MoE layer (v2
  # with them against its FMA tiles), the Moonlight projections (linear_tc against v2), alone on the GPU; then the
  # tensor-core, Moonlight MoE and linear gpu tests beside kdt verify (tiny fp32, model_code bf16)
  step moe_tc ${BENCH_TIMEOUT:-170} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 64,256 --previous \
    --only "v2,v2 fma" --json "$OUT/moe-$day-moonlight-s26c.json"
  step linear_tc 110 python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 64,256 --tc "" \
    --json "$OUT/linear-tc-$day-moonlight-s26c.json"
  grep -h "moonlight\|N=\|Error\|error" "$OUT/moe_tc.log" "$OUT/linear_tc.log" | cut -c1-150
  m=tests/test_kernels_moe.py::test_moe_forward_moonlight; l=tests/test_kernels_linear.py::test_linear_gpu
  TEST_TIMEOUT=${TEST_TIMEOUT:-250} tests_beside_verifies gpu 200 tests/test_kernels_tc.py "$m[16-bf16-2]" \
    "$m[64-bf16-2]" "$m[256-bf16-2]" "$m[1-bf16-2]" "$l[2-3072-2048-bf16]" "$l[2-576-2048-bf16]" \
    "$l[2-2048-2048-bf16]" ;;
s26d)  # session 26, issue 7 (s26c, slimmer: little device time left): the Moonlight MoE layer at M = 64 with tensor cores
  # against its FMA tiles and the Moonlight projections (linear_tc against v2) at M = 64, alone on the GPU; then the
  # tensor-core and Moonlight MoE / linear gpu tests beside kdt verify (tiny fp32, model_code bf16)
  KDT_MOE_TC_M=32 step moe_tc ${BENCH_TIMEOUT:-110} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 64 \
    --previous --only "v2,v2 fma" --json "$OUT/moe-$day-moonlight-s26d.json"
  step linear_tc ${LINEAR_TIMEOUT:-80} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 64 --tc "" \
    --json "$OUT/linear-tc-$day-moonlight-s26d.json"
  grep -h "moonlight\|N=\|Error\|error" "$OUT/moe_tc.log" "$OUT/linear_tc.log" | cut -c1-150
  m=tests/test_kernels_moe.py::test_moe_forward_moonlight; l=tests/test_kernels_linear.py::test_linear_gpu
  TEST_TIMEOUT=${TEST_TIMEOUT:-170} tests_beside_verifies gpu ${VERIFY_TIMEOUT:-170} tests/test_kernels_tc.py "${m}_tc" \
    "${l/test_linear_gpu/test_linear_tc_gpu}[576-2048]" ;;
s26e)  # session 26, issue 7 (s26d, slimmer still: ~5 min of device time left): the Moonlight MoE layer at M = 64 with
  # tensor cores against its FMA tiles, alone on the GPU; then the tensor-core gpu tests (no kdt verify: its code paths
  # did not change, tensor cores being off by default)
  KDT_MOE_TC_M=32 step moe_tc ${BENCH_TIMEOUT:-100} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 64 \
    --previous --only "v2,v2 fma" --json "$OUT/moe-$day-moonlight-s26e.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_tc.log" | cut -c1-150
  step tc_tests ${TEST_TIMEOUT:-110} python3 -m pytest -q -m gpu tests/test_kernels_tc.py \
    "tests/test_kernels_moe.py::test_moe_forward_moonlight_tc[64]" \
    "tests/test_kernels_linear.py::test_linear_tc_gpu[576-2048]" -p no:cacheprovider -rf
  grep -h "^FAILED\|^ERROR\|passed\|failed\|rel_err" "$OUT/tc_tests.log" | cut -c1-300 ;;
s27a)  # session 27, issue 7: tensor cores in the Moonlight MoE layer at M = 16 / 64 / 256 against its FMA tiles, with
  # the tensor-core sweep (token tiles a pass, words in flight, down row tiles), every variant compiled first in 15
  # processes (bench_moe --jobs); then the tensor-core gpu tests; then linear_tc against v2 on the projections, M = 64
  KDT_MOE_TC_M=16 step moe_tc ${BENCH_TIMEOUT:-330} python3 scripts/bench_moe.py --presets moonlight-16b-a3b \
    --M 16,64,256 --sweep --jobs 15 --json "$OUT/moe-$day-moonlight-s27a.json" \
    --only "v2,v2 fma,v2 tc1,v2 tc2,v2 tc4,v2 tc_words1,v2 tc_words4,v2 tc_rows1,v2 tc_rows4"
  grep -h "moonlight\|compiled\|Error\|error" "$OUT/moe_tc.log" | cut -c1-150
  step tc_tests ${TEST_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/test_kernels_tc.py \
    tests/test_kernels_moe.py::test_moe_forward_moonlight_tc \
    "tests/test_kernels_linear.py::test_linear_tc_gpu" -p no:cacheprovider -rf
  grep -h "^FAILED\|^ERROR\|passed\|failed\|rel_err" "$OUT/tc_tests.log" | cut -c1-300
  step linear_tc ${LINEAR_TIMEOUT:-80} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 16,64,256 \
    --tc "" --json "$OUT/linear-tc-$day-moonlight-s27a.json"
  grep -h "moonlight\|N=\|Error\|error" "$OUT/linear_tc.log" | cut -c1-150 ;;
s27b)  # session 27, issue 7: Nsight Compute on the Moonlight MoE layer's three launches at M = 64 / 16, tensor cores
  # (v2) against the FMA tiles (v2 fma)
  KDT_MOE_TC_M=16 ncu_moe 64,16 ;;
s27c)  # session 27, issue 7: tensor cores on by default (MoE from 32 tokens and 3 an expert, linear from 16): the
  # tensor-core, Moonlight MoE (bf16) and linear gpu tests in three processes beside kdt verify (tiny fp32, model_code
  # bf16); then Nsight Compute on the MoE layer at M = 64 (s27b's, its kernels from the tests' disk cache); then
  # linear_tc's plans at M = 64 (row groups of warps sharing x in L1 against warps splitting K), alone
  m=tests/test_kernels_moe.py::test_moe_forward_moonlight
  tparts 300 tc "${m}_tc"
  tparts 300 big "$m[64-bf16-2]" "$m[256-bf16-2]" "$m[64-bf16-1]" "$m[256-bf16-1]"
  tparts 300 small tests/test_kernels_linear.py tests/test_kernels_tc.py -k tc
  tparts 300 small_moe "$m[1-bf16-2]" "$m[16-bf16-2]" "$m[1-bf16-1]" "$m[16-bf16-1]"
  verify_beside_tparts 200 1 tc big small small_moe
  NCU_TIMEOUT=${NCU_TIMEOUT:-120} ncu_moe 64
  step linear_tc ${LINEAR_TIMEOUT:-120} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 64 \
    --tc 64 --json "$OUT/linear-tc-$day-moonlight-s27c.json"
  grep -h "moonlight\|N=\|Error\|error" "$OUT/linear_tc.log" | cut -c1-150 ;;
s27d)  # session 27, issue 7: kdt bench on the Moonlight shape with tensor cores on by default, alone on the GPU
  step bench_moonlight ${BENCH_TIMEOUT:-540} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s27d.json"
  tail -n 45 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
s27e)  # session 27, issue 7: s27d with the kernels compiled first in 8 processes (kdt bench --compile-jobs: s27d ran out
  # of its 540 s compiling, after the verify n = 1 row), alone on the GPU
  step bench_moonlight ${BENCH_TIMEOUT:-540} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 8 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s27e.json"
  tail -n 60 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
s28a)  # session 28, issue 7: the tensor cores' x written hi / lo by its producers (MoE: kernel A's b_perm and h_shared,
  # B's h; linear: the norm before the lm_head and [q_a | kv_a]) against float32 x, alone on the GPU: the Moonlight
  # MoE layer at M = 64 / 256 (with session 27's untimed tc_split), linear_tc per projection; then the gpu tests of
  # the changed kernels in three processes beside kdt verify (tiny fp32, model_code bf16)
  step moe_hilo ${BENCH_TIMEOUT:-230} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 64,256 --sweep \
    --jobs 9 --only "v2,v2 tc_f32_x,v2 tc_split" --json "$OUT/moe-$day-moonlight-s28a.json"
  grep -h "moonlight\|compiled\|Error\|error" "$OUT/moe_hilo.log" | cut -c1-150
  step linear_hilo ${LINEAR_TIMEOUT:-120} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 16,64,256 \
    --tc "" --jobs 8 --json "$OUT/linear-tc-$day-moonlight-s28a.json"
  grep -h "moonlight\|N=\|Error\|error" "$OUT/linear_hilo.log" | cut -c1-190
  m=tests/test_kernels_moe.py::test_moe_forward_moonlight
  tparts 190 tc tests/test_kernels_tc.py "${m}_tc"
  tparts 190 big "$m[64-bf16-2]" "$m[256-bf16-2]"
  tparts 190 linear tests/test_kernels_linear.py -k "tc or norm"
  verify_beside_tparts 190 1 tc big linear ;;
s28b)  # session 28, issue 7: kdt bench on the Moonlight shape with the tensor cores' x hi / lo and the MoE's shared GEMMs
  # one pass a block (the new defaults), alone; then the gpu tests of the changed kernels beside kdt verify; then the
  # MoE layer at M = 32 / 64 / 256 against the variants with one of the session's changes undone
  step bench_moonlight ${BENCH_TIMEOUT:-290} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 8 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s28b.json"
  tail -n 42 "$OUT/bench_moonlight.log" | cut -c1-160
  m=tests/test_kernels_moe.py::test_moe_forward_moonlight
  tparts 140 big "$m[64-bf16-2]" "$m[256-bf16-2]" "${m}_tc"
  tparts 140 linear tests/test_kernels_linear.py -k "norm_tc"
  verify_beside_tparts 140 1 big linear
  step moe_s28 ${MOE_TIMEOUT:-120} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 32,64,256 --previous \
    --jobs 12 --only "v2,v2 tc_f32_x,v2 tc_all_tokens,v2 tc_s27" --json "$OUT/moe-$day-moonlight-s28b.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_s28.log" | cut -c1-150 ;;
s28c)  # session 28, issue 7: uv_project on tensor cores (M >= 16), the MoE's hi / lo x from 4 token tiles a pass: their
  # gpu tests (and the linear norm's, fixed) in three processes beside kdt verify (tiny fp32); then uv_project alone
  m=tests/test_kernels_moe.py::test_moe_forward_moonlight
  tparts 170 moe "$m[64-bf16-2]" "$m[256-bf16-2]" "${m}_tc"
  tparts 170 mla tests/test_kernels_mla.py -k "uv_project_gpu and bf16"
  tparts 170 linear tests/test_kernels_linear.py -k "norm_tc"
  verify_beside_tparts 170 0 moe mla linear
  step uv_tc ${MLA_TIMEOUT:-70} python3 scripts/bench_mla.py --presets moonlight-16b-a3b,kimi-k2 --quick \
    --kernels uv_project --json "$OUT/mla-uv-$day-s28c.json"
  grep -h "uv_project\|Error\|error" "$OUT/uv_tc.log" | cut -c1-150 ;;
s29a)  # session 29, issue 7: kdt bench on the Moonlight shape with session 28's defaults (its compile jobs now one a
  # prefill size), alone; then the MoE layer at the budget-64 verify's 65 tokens: 4 token tiles a pass (the default
  # there, hi / lo x) against 2 (float32 x, the default at 64) and the other mixes
  step bench_moonlight ${BENCH_TIMEOUT:-480} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s29a.json"
  tail -n 48 "$OUT/bench_moonlight.log" | cut -c1-160
  step moe_65 ${MOE_TIMEOUT:-100} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65 --sweep --jobs 4 \
    --only "v2,v2 tc2,v2 tc2_f32_x,v2 tc_f32_x" --json "$OUT/moe-$day-moonlight-s29a.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_65.log" | cut -c1-150 ;;
s29b)  # session 29, issue 7: the MoE layer at 128 / 192 tokens with 2 against 4 token tiles a pass (the rule then: 2 up
  # to 128 tokens), each M's default launches as prefixes (--parts), and at the budget-64 verify's 65 tokens; then the
  # gpu tests of the MoE (128 tokens: 2 tiles, experts past a pass) and of the engine (the MoE in chunks past version
  # 2's pairs, graphs, the step's wait) beside kdt verify (tiny fp32, model_code bf16)
  step moe_tiles ${MOE_TIMEOUT:-170} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 128,192 --sweep \
    --parts --jobs 10 --only "v2,v2 tc2,v2 tc4,v2 tc2_f32_x,v2 tc4_hilo" --json "$OUT/moe-$day-moonlight-s29b.json"
  step moe_65 ${MOE_TIMEOUT:-60} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65 --parts --only v2 \
    --json "$OUT/moe-$day-moonlight-65-s29b.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_tiles.log" "$OUT/moe_65.log" | cut -c1-150
  m=tests/test_kernels_moe.py::test_moe_forward_moonlight
  tparts 230 moe "$m[128-bf16-2]" "$m[64-bf16-2]" "$m[256-bf16-2]" "$m[128-fp32-2]"
  tparts 230 engine tests/test_engine_cuda.py -k "chunks or graph_replay or stop_token or invariant"
  verify_beside_tparts 200 1 moe engine ;;
s29c)  # session 29, issue 7: kdt bench on the Moonlight shape with this session's code (the MoE in chunks past version
  # 2's pairs: the prefill rows past 341 tokens; 2 token tiles a pass to 96 tokens, 4 past), alone; then the engine's
  # gpu tests (the MoE in chunks, graphs, the step's wait: s29b's ran out of their 230 s beside kdt verify after their
  # 4 dots, before pytest's summary) in two processes, each test's time
  step bench_moonlight ${BENCH_TIMEOUT:-370} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s29c.json"
  tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160
  e=tests/test_engine_cuda.py
  tparts 190 engine $e -k "chunks or graph_replay or stop_token" --durations=0
  tparts 190 invariant $e -k "invariant_200" --durations=0
  wait
  for n in engine invariant; do echo "pytest $n:"; grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=\|s call" \
    "$OUT/pytest_$n.log" | cut -c1-200; done ;;
s29d)  # session 29: the engine's gpu tests of s29b / s29c that ran out of their time beside other processes (the MoE in
  # chunks, graph replay, the stop token's dropped step), alone, each test's name as it passes
  step engine ${TEST_TIMEOUT:-190} python3 -m pytest -v -m gpu tests/test_engine_cuda.py \
    -k "chunks or graph_replay or stop_token" -p no:cacheprovider -rf --durations=0
  grep -h "PASSED\|FAILED\|ERROR\|passed\|failed\|s call" "$OUT/engine.log" | cut -c1-200 ;;
s30a)  # session 30, issue 7: the MoE's routed GEMMs with their warps in row groups (V2Tiles.tc_kw, untimed) at 65 / 256
  # tokens; then the engine-level A/B of s29's token tiles at the budget-64 verify's 65 tokens (2 tiles, the default,
  # against KDT_MOE_TC2_M=64: 4 tiles there), each program timed in its CUDA graph, one machine
  step moe_kw ${MOE_TIMEOUT:-150} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65,256 --sweep --parts \
    --jobs 6 --only "v2,v2 tc_kw1,v2 tc_kw2" --json "$OUT/moe-$day-moonlight-s30a.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_kw.log" | cut -c1-150
  for tiles in 96 64; do
    step graphs_tc2m$tiles ${GRAPH_TIMEOUT:-200} env KDT_MOE_TC2_M=$tiles python3 scripts/profile_graphs.py \
      --preset moonlight-16b-a3b --budget 64 --drafter oracle --launches none \
      --json "$OUT/profile-graphs-$day-moonlight-tc2m$tiles-s30a.json"
    grep -h "step\|forward\|Error\|error" "$OUT/graphs_tc2m$tiles.log" | cut -c1-150
  done ;;
s30b)  # session 30, issue 7: the routed GEMMs' loads staged through shared memory by cp.async (V2Tiles.tc_st): the
  # tensor-core GEMM and the Moonlight MoE's staged gpu tests beside kdt verify; then the MoE layer at 32 / 65 tokens:
  # the default, its x hi / lo unstaged, staged with 2 / 3 stages, alone on the GPU
  tparts 240 tc tests/test_kernels_tc.py -k gemm
  tparts 240 staged tests/test_kernels_moe.py::test_moe_forward_moonlight_tiles
  verify_beside_tparts 150 1 tc staged
  step moe_st ${MOE_TIMEOUT:-280} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 32,65 --sweep --parts \
    --jobs 8 --only "v2,v2 tc_hilo,v2 tc_st2,v2 tc_st3" --json "$OUT/moe-$day-moonlight-s30b.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_st.log" | cut -c1-150 ;;
s30c)  # session 30, issue 7: s30b with the stages' rings in the blocks' sums array (sm), so deeper pipelines fit in
  # 48 KB: the staged gpu tests beside kdt verify; then the MoE layer at 65 tokens with 3 / 4 / 5 stages, alone
  tparts 240 tc tests/test_kernels_tc.py -k gemm
  tparts 240 staged tests/test_kernels_moe.py::test_moe_forward_moonlight_tiles
  verify_beside_tparts 150 1 tc staged
  step moe_st ${MOE_TIMEOUT:-240} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65 --sweep --parts \
    --jobs 8 --only "v2,v2 tc_hilo,v2 tc_st3,v2 tc_st4,v2 tc_st5" --json "$OUT/moe-$day-moonlight-s30c.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_st.log" | cut -c1-150 ;;
s30d)  # session 30: s29d (the engine's gpu tests that ran out of their time beside other processes), then Nsight
  # Compute on the MoE layer at 65 tokens, the default against 5 stages of staged loads (tc_st5)
  step engine ${TEST_TIMEOUT:-190} python3 -m pytest -v -m gpu tests/test_engine_cuda.py \
    -k "chunks or graph_replay or stop_token" -p no:cacheprovider -rf --durations=0
  grep -h "PASSED\|FAILED\|ERROR\|passed\|failed\|s call" "$OUT/engine.log" | cut -c1-200
  NCU_TIMEOUT=${NCU_TIMEOUT:-240} ncu_moe 65 "v2 tc_st5" ;;
s30e)  # session 30: the staged loads with their addresses as element offsets computed once a GEMM (cp.async at offsets,
  # no per-copy index arithmetic): the MoE layer at 65 tokens (the default, hi / lo x, 3 / 5 stages), alone; then the
  # tensor-core GEMM gpu tests (the staged warp tile among them)
  step moe_st ${MOE_TIMEOUT:-120} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65 --sweep --jobs 4 \
    --only "v2,v2 tc_hilo,v2 tc_st3,v2 tc_st5" --json "$OUT/moe-$day-moonlight-s30e.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_st.log" | cut -c1-150
  step tc ${TEST_TIMEOUT:-80} python3 -m pytest -q -m gpu tests/test_kernels_tc.py -k gemm -p no:cacheprovider -rf
  tail -n 3 "$OUT/tc.log" ;;
s31a)  # session 31: s30e (the staged loads at precomputed element offsets: the MoE layer at 65 tokens, the default,
  # hi / lo x, 3 / 4 / 5 stages, alone); then beside each other: the tensor-core GEMM and staged MoE gpu tests, and
  # the engine's gpu tests that s29d / s30d could not finish (stop token, graph replay; cold compiles, 400 s)
  step moe_st ${MOE_TIMEOUT:-150} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65 --sweep --jobs 8 \
    --only "v2,v2 tc_hilo,v2 tc_st3,v2 tc_st4,v2 tc_st5" --json "$OUT/moe-$day-moonlight-s31a.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_st.log" | cut -c1-150
  tparts 400 engine tests/test_engine_cuda.py -k "graph_replay or stop_token" --durations=0
  tparts 240 tc tests/test_kernels_tc.py -k gemm
  tparts 300 staged tests/test_kernels_moe.py::test_moe_forward_moonlight_tiles
  wait
  for n in engine tc staged; do echo "pytest $n:"; grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=\|s call" \
    "$OUT/pytest_$n.log" | cut -c1-200; done ;;
s31b)  # session 31: kernel B's routed gate_up on 2 output tiles a warp (tc_ot = 2: half the x loads a weight byte),
  # alone, hi / lo, with kernel C on 4 row tiles, staged; the MoE layer at 65 / 128 tokens, alone; then its gpu tests
  step moe_ot ${MOE_TIMEOUT:-330} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65,128 --sweep \
    --jobs 12 --only "v2,v2 tc_ot2,v2 tc_ot2_hilo,v2 tc_rows4,v2 tc_ot2_rows4,v2 tc_ot2_st3,v2 tc_st4" \
    --json "$OUT/moe-$day-moonlight-s31b.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_ot.log" | cut -c1-150
  step ot ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_kernels_moe.py -k moonlight_tiles \
    -p no:cacheprovider -rf
  tail -n 3 "$OUT/ot.log" ;;
s31c)  # session 31: Nsight Compute on the MoE layer at 65 tokens, the default against kernel B's gate_up on 2 output
  # tiles a warp (tc_ot2, slower in s31b)
  NCU_TIMEOUT=${NCU_TIMEOUT:-330} ncu_moe 65 "v2 tc_ot2" ;;
s31d)  # session 31: the v2 attention with a floor on a split's keys (KDT_MLA_SPLIT_KEYS: the engine's max_len splits
  # give a short prefix one 8-key tile a split): attention + combine at M = 1 / 16 / 64, L = 176 .. 8192, floors 16 ..
  # 128 beside the default, alone; then the floor's and the MoE tiles' gpu tests
  step mla_keys ${MLA_TIMEOUT:-300} python3 scripts/bench_mla.py --presets moonlight-16b-a3b --kernels attention \
    --quick --split-keys 16,32,64,128 --L 176,512,2048,8192 --json "$OUT/mla-$day-moonlight-split-keys-s31d.json"
  grep -h "attention\|Error\|error" "$OUT/mla_keys.log" | grep -v "v1 " | cut -c1-110
  tparts 220 keys tests/test_kernels_mla.py -k split_keys
  tparts 220 tiles tests/test_kernels_moe.py::test_moe_forward_moonlight_tiles
  wait
  for n in keys tiles; do echo "pytest $n:"; grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_$n.log" \
    | cut -c1-200; done ;;
s32a)  # session 32: version 2's attention on tensor cores (kdt.kernels.attn_tc): its gpu tests, then attention + combine
  # at M = 16 / 64 / 128 / 256, L = 512 / 8192 beside the FMA kernel (Moonlight), alone
  tparts 240 tc tests/test_kernels_mla.py -k attention_tc
  wait
  echo "pytest tc:"; grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=\|Error" "$OUT/pytest_tc.log" | cut -c1-300
  step mla_tc ${MLA_TIMEOUT:-300} python3 scripts/bench_mla.py --presets moonlight-16b-a3b --kernels attention \
    --quick --tc --M 16,64,128,256 --L 512,8192 --json "$OUT/mla-$day-moonlight-tc-s32a.json"
  grep -h "attention\|Error\|error" "$OUT/mla_tc.log" | grep -v "v1 " | cut -c1-110 ;;
s32b)  # session 32: Nsight Compute of the attention on tensor cores against version 2's FMA kernel (Moonlight, M = 64,
  # L = 8192): throughput, warp stalls, pipes, occupancy
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | tail -n 1)
  step ncu_attn ${NCU_TIMEOUT:-300} "$ncu" --clock-control none --profile-from-start off --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
    python3 scripts/bench_mla.py --presets moonlight-16b-a3b --kernels attention --quick --tc --M 64 --L 8192 \
    --only "v2 S(max),v2 tc S(max),v2 tc bc32 S(max)" --ncu
  grep -v "^==PROF==\|^ *$\|----" "$OUT/ncu_attn.log" | cut -c1-150 | head -300 ;;
s32c)  # session 32, issue 7: kdt bench on the Moonlight shape with the attention on tensor cores from 128 tokens (the
  # verify rows of 128 / 256 nodes, the prefill rows), alone
  step bench_moonlight ${BENCH_TIMEOUT:-420} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s32c.json"
  tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
s32d)  # session 32: the greedy invariant (200 trials, 4 drafters, budgets to 128) and kdt verify (tiny fp32, model_code
  # bf16) with the attention on tensor cores from 16 tokens (KDT_MLA_ATTN_TC_M=16: every tree verify of 16+ nodes)
  export KDT_MLA_ATTN_TC_M=${KDT_MLA_ATTN_TC_M:-16}
  tparts 230 invariant tests/test_engine_cuda.py -k "invariant_200 or graph_replay" --durations=0
  verify_beside_tparts 200 1 invariant ;;
s32e)  # session 32: the attention at short prefixes (the prefill's), M = 128 / 256, L = 0 / 128: the default (on tensor
  # cores from 128 tokens), version 2's FMA kernel and the tensor-core kernel, alone
  step mla_short ${MLA_TIMEOUT:-200} python3 scripts/bench_mla.py --presets moonlight-16b-a3b --kernels attention \
    --quick --tc --M 128,256 --L 0,128 --only "v2 S(max),v2 fma S(max),v2 tc S(max)" \
    --json "$OUT/mla-$day-moonlight-tc-short-s32e.json"
  grep -h "attention\|Error\|error" "$OUT/mla_short.log" | cut -c1-110 ;;
s33a)  # session 33: the pre-split cache (kv_hl) and the oracle drafting on the device: the gpu tests of the tensor-core
  # attention (pre-split against split in shared memory, bit for bit), the latent write, the compaction, the engine's
  # invariant (250 trials, the device oracle among the drafters) and graph replay with the attention on tensor cores
  # from 16 tokens, kdt verify (tiny fp32, model_code bf16); then the Moonlight attention + combine with and without
  # the pre-split cache, alone
  tparts 300 kern tests/test_kernels_mla.py tests/test_ddtree_kernels.py -k "attention_tc or latent_write or compact"
  ( KDT_MLA_ATTN_TC_M=16 timeout 300 python3 -m pytest -q -m gpu tests/test_engine_cuda.py -k \
      "invariant_200 or graph_replay" -p no:cacheprovider -rf --durations=0 > "$OUT/pytest_invariant.log" 2>&1
    echo "rc=$?" >> "$OUT/pytest_invariant.log" ) &  # (every tree verify of 16+ nodes on tensor cores, kv_hl)
  verify_beside_tparts 250 1 kern invariant
  step mla_hl ${MLA_TIMEOUT:-200} python3 scripts/bench_mla.py --presets moonlight-16b-a3b --kernels attention \
    --quick --tc --M 64,128,256 --L 512,8192 --only "v2 fma S(max),v2 tc S(max),v2 tc hl S(max)" \
    --json "$OUT/mla-$day-moonlight-tc-hl-s33a.json"
  grep -h "attention\|Error\|error" "$OUT/mla_hl.log" | cut -c1-110 ;;
s33b)  # session 33, issue 7: kdt bench on the Moonlight shape with the pre-split cache and the oracle drafting on the
  # device (its host-drafted row beside it), alone
  step bench_moonlight ${BENCH_TIMEOUT:-480} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s33b.json"
  tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
s33c)  # session 33: the attention shared by prefix between 64 and 127 tokens (both kernels in the graph, the tensor
  # cores from KDT_MLA_ATTN_TC_LONG_L keys): its gpu tests and the tensor-core kernel's, the invariant and graph replay
  # with the shared range from 16 tokens and the tensor cores from 40 keys (both sides met in the trials), kdt verify
  # (defaults); then the Moonlight attention + combine at 64 / 96 tokens, the default beside each kernel alone
  tparts 300 kern tests/test_kernels_mla.py -k "shared_by_prefix or attention_tc"
  ( KDT_MLA_ATTN_TC_LONG_M=16 KDT_MLA_ATTN_TC_LONG_L=40 timeout 300 python3 -m pytest -q -m gpu \
      tests/test_engine_cuda.py -k "invariant_200 or graph_replay" -p no:cacheprovider -rf --durations=0 \
      > "$OUT/pytest_invariant.log" 2>&1
    echo "rc=$?" >> "$OUT/pytest_invariant.log" ) &
  verify_beside_tparts 250 1 kern invariant
  step mla_shared ${MLA_TIMEOUT:-200} python3 scripts/bench_mla.py --presets moonlight-16b-a3b --kernels attention \
    --quick --tc --M 64,96 --L 512,1024,8192 --only "v2 S(max),v2 fma S(max),v2 tc hl S(max)" \
    --json "$OUT/mla-$day-moonlight-shared-s33c.json"
  grep -h "attention\|Error\|error" "$OUT/mla_shared.log" | cut -c1-110 ;;
s34a)  # session 34: the attention shared by prefix on by default (from 64 tokens), the FMA kernel in its own splits
  # below TC_LONG_L keys: the attention's gpu tests (shared by prefix, tensor cores, v2 as the engine calls it), the
  # engine's invariant and graph replay with the shared range from 16 tokens and the tensor cores from 40 keys (both
  # sides met), kdt verify (defaults); then the Moonlight attention + combine at 16 / 32 / 64 tokens, the default
  # beside each kernel alone
  tparts 300 kern tests/test_kernels_mla.py -k "shared_by_prefix or attention_tc or v2_engine_splits"
  KDT_MLA_ATTN_TC_LONG_M=16 KDT_MLA_ATTN_TC_LONG_L=40 tparts 300 invariant tests/test_engine_cuda.py \
    -k "invariant_200 or graph_replay"
  verify_beside_tparts 250 1 kern invariant
  step mla_own ${MLA_TIMEOUT:-200} python3 scripts/bench_mla.py --presets moonlight-16b-a3b --kernels attention \
    --quick --tc --M 16,32,64 --L 512,1024,2048,8192 --only "v2 S(max),v2 fma S(max),v2 tc hl S(max)" \
    --json "$OUT/mla-$day-moonlight-shared-own-s34a.json"
  grep -h "attention\|Error\|error" "$OUT/mla_own.log" | cut -c1-110 ;;
s34b)  # session 34, issue 7: kdt bench on the Moonlight shape with the attention shared by prefix from 16 tokens, by
  # tiers (the DDTree rows now say where a decode leaves AR's tokens), alone
  step bench_moonlight ${BENCH_TIMEOUT:-480} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s34b.json"
  tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
s34c)  # session 34: where greedy DDTree leaves greedy AR on Moonlight's random weights (the budget-64 oracle, 512
  # tokens), and the routing near-tie behind it: scripts/probe_divergence.py with the attention shared by prefix on
  # (the default) and off, side by side
  ( step probe_shared 500 python3 scripts/probe_divergence.py --tokens 512 --json "$OUT/probe-$day-shared-s34c.json"
    ) &
  KDT_MLA_ATTN_TC_LONG_M=0 NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/nc}-off step probe_off 500 python3 \
    scripts/probe_divergence.py --tokens 512 --json "$OUT/probe-$day-off-s34c.json"
  wait
  tail -c 1500 "$OUT/probe_shared.log"; tail -c 1500 "$OUT/probe_off.log" ;;
s34d)  # session 34: the shared range from 16 tokens (the tensor cores from 4096 / 2048 / 1024 keys at 16 / 32 / 64
  # tokens, where the cache reaches them): the attention's gpu tests as the engine calls it, beside the engine's
  # invariant and graph replay with the shared range's prefixes lowered to 40 / 80 / 160 keys, and kdt verify
  tparts 420 kern tests/test_kernels_mla.py -k "shared_by_prefix or v2_engine_splits or gpu_forced_splits"
  KDT_MLA_ATTN_TC_LONG_L=40 tparts 360 invariant tests/test_engine_cuda.py -k "invariant_200 or graph_replay"
  verify_beside_tparts 250 1 kern invariant ;;
s35a)  # session 35: the MoE's tensor-core passes of at most 8 (16) tokens on 1 (2) token tiles (tc_fit; at 65 tokens
  # most experts' second tile is padding): the Moonlight layer at 16 / 32 / 65 / 128 tokens beside the default,
  # alone; then the tc_fit gpu tests (bit for bit against the full passes) beside kdt verify (in the run, -k "moonlight_tiles
  # and fit" matched no test id: none ran; the variants' names are those of bench_moe.py before tc_fit was the default)
  step moe_fit ${MOE_TIMEOUT:-330} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 16,32,65,128 --sweep \
    --jobs 12 --only "v2,v2 tc_fit,v2 tc_fit_hilo,v2 tc_fit_f32_x,v2 tc2,v2 tc2_fit,v2 tc2_fit_hilo,v2 tc4_fit_hilo" \
    --json "$OUT/moe-$day-moonlight-fit-s35a.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_fit.log" | cut -c1-150
  tparts 200 fit tests/test_kernels_moe.py -k "moonlight_tiles and fit0"
  verify_beside_tparts 200 1 fit ;;
s35b)  # session 35, issue 7: kdt bench on the Moonlight shape with the MoE's short tensor-core passes fitted, x hi / lo,
  # and the tensor cores from 16 tokens, alone
  step bench_moonlight ${BENCH_TIMEOUT:-480} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s35b.json"
  tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
s35c)  # session 35: the MoE's gpu tests at Moonlight's shape with the new defaults (16 / 64 / 128 tokens on tensor
  # cores, fitted, hi / lo; session 34's full passes bit for bit against the fitted ones), the attention tests session
  # 34 left unrun, beside the engine's invariant, graph replay and kdt verify
  tparts 330 moe tests/test_kernels_moe.py -k "tiles and fit0 or 16-bf16-2 or 64-bf16-2 or 128-bf16-2"
  tparts 330 mla tests/test_kernels_mla.py -k "attention_tc_gpu or v2_engine_splits or 2-16-8192-256"
  tparts 330 invariant tests/test_engine_cuda.py -k "invariant_200 or graph_replay"
  verify_beside_tparts 250 1 moe mla invariant ;;
s35d)  # session 35: Nsight Compute on the Moonlight MoE layer at 65 tokens, the default (short passes fitted, x hi / lo)
  # against session 34's (every pass on 2 token tiles, float32 x): what the fitted passes left of kernels B and C's
  # issue-bound time (s30d) and of their L2 traffic
  NCU_TIMEOUT=${NCU_TIMEOUT:-400} ncu_moe 65 "v2 tc_s34" ;;
s36a)  # session 36, issue 7: the one-token attention's combine in its launch (KDT_MLA_COMBINE_IN_M=1) and PDL with the
  # wait alone (KDT_PDL=2), both on: their gpu tests (the combine in the launch at Moonlight's / Kimi's shapes, three
  # launches on one sync array; the engine's invariant and graph replay) beside kdt verify; then the attention at one
  # token with its combine in the launch against apart, alone
  export KDT_MLA_COMBINE_IN_M=1 KDT_PDL=2
  tparts 230 ci tests/test_kernels_mla.py -k "combine_in_launch"
  tparts 230 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay"
  verify_beside_tparts 230 1 ci engine
  step mla_ci ${MLA_TIMEOUT:-120} python3 scripts/bench_mla.py --presets moonlight-16b-a3b,kimi-k2 --kernels attention \
    --quick --combine-in --M 1 --L 176,512,2048,8192 --only "v2 ci S(max),v2 ci0 S(max)" \
    --json "$OUT/mla-$day-combine-in-s36a.json"
  grep -h "attention\|Error\|error" "$OUT/mla_ci.log" | cut -c1-150 ;;
s36b)  # session 36, issue 7: Moonlight's whole programs in their graphs (the AR step, the oracle chain step, the
  # target's forwards), PDL with the wait alone (KDT_PDL=2) against no PDL, and the one-token attention's combine in
  # its launch against apart, in one process (the same kernels otherwise)
  export KDT_PDL=2
  step profile_ab ${PROFILE_TIMEOUT:-420} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --budget 7 \
    --launches none --pdl-ab --combine-in-ab --json "$OUT/profile-graphs-$day-moonlight-s36b.json"
  grep -h "==\|step\|forward\|empty\|build\|PDL\|Error\|error" "$OUT/profile_ab.log" | grep -v "^ *[0-9]" \
    | cut -c1-150 ;;
s36c)  # session 36, issue 7: the block-tiled tensor-core GEMM (kdt.kernels.tc_tiled, KDT_LINEAR_TILED_M): its plans
  # compiled in 14 processes, Moonlight's projections at 16 .. 256 tokens, the warp tile against the tiled GEMM,
  # float32 and hi / lo x, alone; then its gpu tests on the compiled plans (the lm_head at 65 tokens, [q_a | kv_a] at
  # 16, the dense MLP's shapes at 100 / 256, ragged; the fixtures' matrices are below linear_tc's size, so kdt verify
  # never meets it)
  step linear_tiled ${BENCH_TIMEOUT:-330} python3 scripts/bench_linear.py --presets moonlight-16b-a3b \
    --M 16,32,64,65,128,256 --tiled --jobs 14 --json "$OUT/linear-tiled-$day-moonlight-s36c.json"
  step tiled_tests ${TEST_TIMEOUT:-150} python3 -m pytest -q -m gpu tests/test_kernels_tc.py -k tiled -p no:cacheprovider -rf
  grep -h "^FAILED\|^ERROR\|passed\|failed" "$OUT/tiled_tests.log" | cut -c1-300
  grep -h "N=\|bandwidth\|Error\|error" "$OUT/linear_tiled.log" | cut -c1-150 ;;
s36e)  # session 36, issue 7: the MoE's routed gate_up on the block-tiled GEMM (KDT_MOE_TILED_M): the Moonlight layer
  # at 65 / 128 / 256 tokens, the default against "tc_tiled", alone; then its gpu tests (the layer at Moonlight's
  # shape, 65 / 256 tokens, against float64)
  step moe_tiled ${MOE_TIMEOUT:-300} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65,128,256 --sweep \
    --jobs 12 --only "v2,v2 tc_tiled" --json "$OUT/moe-$day-moonlight-tiled-s36e.json"
  grep -h "moonlight\|Error\|error" "$OUT/moe_tiled.log" | cut -c1-150
  step moe_tiled_tests ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_kernels_moe.py -k "tiled1" \
    -p no:cacheprovider -rf
  grep -h "^FAILED\|^ERROR\|passed\|failed" "$OUT/moe_tiled_tests.log" | cut -c1-300 ;;
s36d)  # session 36, issue 7: kdt bench on the Moonlight shape with the tiled GEMM from 16 tokens (KDT_LINEAR_TILED_M=16),
  # alone; its decode rows say where DDTree leaves AR's tokens (leaves_ar_at)
  export KDT_LINEAR_TILED_M=16
  step bench_moonlight ${BENCH_TIMEOUT:-480} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-tiled-s36d.json"
  tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
s37a)  # session 37, issue 7: the gpu tests session 37's calls left unfinished (compiling; numba's inlining was quadratic
  # then, kdt.kernels.inline_copy, now fast_compile): the combine in the attention's launch at every shape, the
  # block-tiled GEMM (its long-K bound now K-scaled) and the MoE's tiled gate_up, session 34's float32-x passes
  # against the fitted ones; beside kdt verify
  tparts 480 ci tests/test_kernels_mla.py -k "combine_in_launch"
  tparts 480 tiled tests/test_kernels_tc.py -k "tiled"
  tparts 480 moe tests/test_kernels_moe.py -k "32-tc_fit0-tc_hilo0 or tiled1"
  verify_beside_tparts 250 1 ci tiled moe ;;
s39a)  # session 39, issue 7: s36b's whole programs (PDL with the wait alone against none, the one-token attention's
  # combine in its launch against apart; its oracle step no longer fails), then s36a's timing of that combine alone at
  # Moonlight's / Kimi's shapes, L = 176 .. 8192
  export KDT_PDL=2
  step profile_ab ${PROFILE_TIMEOUT:-420} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --budget 7 \
    --launches none --pdl-ab --combine-in-ab --json "$OUT/profile-graphs-$day-moonlight-s39a.json"
  grep -h "==\|step\|forward\|empty\|build\|PDL\|Error\|error" "$OUT/profile_ab.log" | grep -v "^ *[0-9]" \
    | cut -c1-150
  step mla_ci ${MLA_TIMEOUT:-150} python3 scripts/bench_mla.py --presets moonlight-16b-a3b,kimi-k2 --kernels attention \
    --quick --combine-in --M 1 --L 176,512,2048,8192 --only "v2 ci S(max),v2 ci0 S(max)" \
    --json "$OUT/mla-$day-combine-in-s39a.json"
  grep -h "attention\|Error\|error" "$OUT/mla_ci.log" | cut -c1-150 ;;
s39b)  # session 39, issue 7: what a step graph's launch costs the host onto an idle GPU, ahead of a running step, and
  # ahead with two captures used in turn (scripts/probe_graph_launch.py)
  step probe_launch ${PROBE_TIMEOUT:-240} python3 scripts/probe_graph_launch.py --nodes 100,300,700 --gpu-us 3000
  cat "$OUT/probe_launch.log" | cut -c1-150 ;;
s39c)  # session 39, issue 7: its defaults (PDL with the wait alone, KDT_PDL=2; the lm_head's rows on the block-tiled GEMM
  # from 65 tokens) on the H200: the engine's invariant and graph replay, the tiled GEMM's tests, beside kdt verify and
  # s39b's launch probe; then (unless S39_BENCH=0) kdt bench on the Moonlight shape, alone
  tparts 300 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay"
  tparts 300 tiled tests/test_kernels_tc.py -k "tiled"
  step probe_launch ${PROBE_TIMEOUT:-120} python3 scripts/probe_graph_launch.py --nodes 100,300,700 --gpu-us 3000
  cat "$OUT/probe_launch.log" | cut -c1-150
  verify_beside_tparts 250 1 engine tiled
  [ "${S39_BENCH:-1}" = 1 ] && step bench_moonlight ${BENCH_TIMEOUT:-400} python3 -m kdt.cli bench \
    --preset moonlight-16b-a3b --dtype bf16 --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s39c.json" \
    && tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
s40a)  # session 40, issue 7: the Moonlight step's host work by part (scripts/profile_step.py: AR, the budget-64 oracle
  # drafting on the host and on the device, the chain, the other wait, two captures in turn) beside the steps' tests
  # (the invariant, graph replay, the step options); the launch probe at a Moonlight step's 18 ms first
  step probe_launch18 ${PROBE_TIMEOUT:-120} python3 scripts/probe_graph_launch.py --nodes 300,700 --gpu-us 18000 \
    --steps 24
  cat "$OUT/probe_launch18.log" | cut -c1-150
  tparts 300 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay or step_options"
  wait
  grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_engine.log" | cut -c1-300
  step profile_step ${PROFILE_TIMEOUT:-400} python3 scripts/profile_step.py moonlight-16b-a3b 256
  tail -n 12 "$OUT/profile_step.log" | cut -c1-220 ;;
s40b)  # session 40, issue 7: kdt bench on the Moonlight shape with this session's code (a prefill's lm_head on its last
  # row alone; the peer's logits_to_keep=1), alone on the GPU after the engine's tests beside kdt verify; then (unless
  # S40_PROFILE=0) scripts/profile_step.py with launch() and result() split; S40_BENCH=0: the tests and verify alone
  tparts 300 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay or step_options"
  verify_beside_tparts 250 1 engine
  [ "${S40_BENCH:-1}" = 0 ] && S40_PROFILE=0
  [ "${S40_BENCH:-1}" = 1 ] && step bench_moonlight ${BENCH_TIMEOUT:-400} python3 -m kdt.cli bench \
    --preset moonlight-16b-a3b --dtype bf16 --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s40b.json" \
    && tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160
  [ "${S40_PROFILE:-1}" = 1 ] && step profile_step ${PROFILE_TIMEOUT:-150} python3 scripts/profile_step.py \
    moonlight-16b-a3b 256 && tail -n 6 "$OUT/profile_step.log" | cut -c1-260 ;;
s40c)  # session 40, issue 7: the step's end read from the record (KDT_STEP_END=flag, off by default) and the prefill's
  # last row alone: the engine's gpu tests (step_commit runs in every step) beside kdt verify; then the tiny bench
  # with each step end
  tparts 300 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay or step_options or stop_token"
  verify_beside_tparts 200 1 engine
  tiny_bench_by_step_end s40c ;;
s41a)  # session 41, issue 7: where the Moonlight prefill's time goes (scripts/profile_kernels.py --prefill: P = 2048 as
  # kdt bench times it, 256 as kdt generate's chunks), then the step's end read from its record against the event
  # (scripts/profile_step.py on Moonlight with KDT_STEP_END=event / flag), then the tiny bench with each
  step prefill_kernels ${PREFILL_TIMEOUT:-240} python3 scripts/profile_kernels.py --prefill 2048,256 --top 16
  grep -h -A19 "^== " "$OUT/prefill_kernels.log" | cut -c1-120
  for e in event flag; do
    KDT_STEP_END=$e step profile_step_$e ${PROFILE_TIMEOUT:-150} python3 scripts/profile_step.py moonlight-16b-a3b 256
    tail -n 6 "$OUT/profile_step_$e.log" | cut -c1-250
  done
  tiny_bench_by_step_end s41a ;;
s41b)  # session 41, issue 7: the attention's key tiles stop at the block's last visible key (half a prefill's): the
  # attention's tensor-core gpu tests and the engine's beside kdt verify, then the prefill by kernel
  # (scripts/profile_kernels.py --prefill 2048,256), then (unless S41_BENCH=0) kdt bench on the Moonlight shape, then
  # the warp tile against the block-tiled GEMM at a prefill's M (scripts/bench_linear.py --tiled --M 512,2048)
  tparts 300 attn tests/test_kernels_mla.py -k "tc_gpu or shared_by_prefix_gpu"
  tparts 300 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay or step_options or stop_token"
  verify_beside_tparts 250 1 attn engine
  step prefill_kernels ${PREFILL_TIMEOUT:-200} python3 scripts/profile_kernels.py --prefill 2048,256 --top 8
  grep -h -A11 "^== " "$OUT/prefill_kernels.log" | cut -c1-120
  [ "${S41_BENCH:-1}" = 1 ] && step bench_moonlight ${BENCH_TIMEOUT:-300} python3 -m kdt.cli bench \
    --preset moonlight-16b-a3b --dtype bf16 --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s41b.json" \
    && tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160
  step linear_tiled ${LINEAR_TIMEOUT:-120} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 512,2048 \
    --tiled --jobs 14 --json "$OUT/linear-$day-moonlight-tiled-s41b.json"
  tail -n 16 "$OUT/linear_tiled.log" | cut -c1-160 ;;
s41c)  # session 41 (owed): the same-run A/B of the attention's visible tiles (attn_visible_ab)
  attn_visible_ab s41c ;;
s42a)  # session 42, issue 7: q_absorb on tensor cores (absorb_checks): its gpu tests and the engine's beside kdt verify,
  # the absorb alone at M = 16 / 65 / 256 / 2048, session 41's owed visible-tiles A/B
  absorb_checks s42a "absorb_tc_gpu or fused_gpu" 16,65,256,2048 ;;
s42b)  # session 42, issue 7: the absorb's rule and plans from s42a, the attention's visible-tiles max a warp at a time:
  # the same with the attention's tensor-core gpu tests, the absorb from M = 32
  absorb_checks s42b "absorb_tc_gpu or fused_gpu or tc_gpu or shared_by_prefix_gpu" 32,65,256,2048 ;;
s42c)  # session 42, issue 7: kdt bench on the Moonlight shape with session 42's defaults, then the budget-64 oracle
  # step's programs in their graphs with the absorb on tensor cores against FMA tiles (scripts/profile_graphs.py
  # --absorb-tc-ab, one process), then (unless S42_PREFILL=0) the prefill by kernel
  step bench_moonlight ${BENCH_TIMEOUT:-360} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s42c.json" \
    && tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160
  step graphs_ab ${GRAPHS_TIMEOUT:-150} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --drafter oracle \
    --budget 64 --launches none --absorb-tc-ab --json "$OUT/profile-graphs-$day-moonlight-absorb-ab-s42c.json"
  grep -h -A8 "^== whole" "$OUT/graphs_ab.log" | cut -c1-120
  if [ "${S42_PREFILL:-1}" = 1 ]; then
    step prefill_kernels ${PREFILL_TIMEOUT:-150} python3 scripts/profile_kernels.py --prefill 2048,256 --top 9
    grep -h -A12 "^== " "$OUT/prefill_kernels.log" | cut -c1-120
  fi ;;
s42d)  # session 42, issue 7: where the budget-64 oracle leaves AR with the absorb on tensor cores (s42c's kdt bench: at
  # token 220, acceptance 8.0 -> 4.05): scripts/probe_divergence.py (AR and the oracle as kdt bench decodes, then
  # direct with each MoE layer's routing read back)
  step probe ${PROBE_TIMEOUT:-420} python3 scripts/probe_divergence.py --tokens 256 \
    --json "$OUT/probe-$day-moonlight-absorb-tc-s42d.json"
  tail -n 30 "$OUT/probe.log" | cut -c1-200 ;;
s42e)  # session 42, issue 7: the warp tile's full steps at raw row addresses (KDT_TC_PTR, built, off): the Moonlight MoE
  # layer at 65 / 256 tokens off / on (scripts/bench_moe.py, a process each), then its gpu tests with it on (the warp
  # tile's GEMMs, the Moonlight MoE layer in bf16, the absorb's GEMM)
  for p in 0 1; do
    KDT_TC_PTR=$p step moe_ptr$p ${MOE_TIMEOUT:-150} python3 scripts/bench_moe.py --presets moonlight-16b-a3b \
      --M 65,256 --only v2 --json "$OUT/moe-$day-moonlight-ptr$p-s42e.json"
    grep -h "v2 " "$OUT/moe_ptr$p.log" | cut -c1-160
  done
  KDT_TC_PTR=1 tparts 200 tc tests/test_kernels_tc.py -k "tc_gemm_gpu"
  KDT_TC_PTR=1 tparts 200 moe tests/test_kernels_moe.py -k "test_moe_forward_moonlight and (64-bf16-2 or 256-bf16-2)"
  wait
  for n in tc moe; do echo "pytest $n:"; grep -h "^FAILED\|passed\|failed\|rc=" "$OUT/pytest_$n.log" | cut -c1-300; done ;;
s43a)  # session 43, issue 7: the routed experts in fragment order (V2Tiles.tc_fo, KDT_MOE_TC_FO; built, off) and the
  # warp tile at raw addresses (KDT_TC_PTR, s42e's): the Moonlight MoE layer at 65 / 256 tokens, the default against
  # tc_fo in one process (its output diff against the default must read 0: the same sums), a process with PTR off and
  # one with it on; then at 1 / 4 / 8 / 16 tokens the default (FMA tiles below 16) against the tensor cores in fragment
  # order (scripts/bench_moe.py --sweep's tc_fo / tc_fo_small; MOE_TIMEOUT s each, 200)
  for p in 0 1; do
    KDT_TC_PTR=$p step moe_p$p ${MOE_TIMEOUT:-200} python3 scripts/bench_moe.py --presets moonlight-16b-a3b \
      --M 65,256 --sweep --only "v2,v2 tc_fo" --json "$OUT/moe-$day-moonlight-fo-ptr$p-s43a.json"
    grep -h "v2" "$OUT/moe_p$p.log" | cut -c1-160
  done
  step moe_small ${MOE_TIMEOUT:-200} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 1,4,8,16 --sweep \
    --only "v2,v2 tc_fo_small,v2 tc_fo" --json "$OUT/moe-$day-moonlight-fo-small-s43a.json"
  grep -h "v2" "$OUT/moe_small.log" | cut -c1-160 ;;
s43b)  # session 43, issue 7: the gpu tests of s43a's switches (the warp tile's GEMMs, the Moonlight MoE layer in bf16;
  # FO alone, FO with PTR, PTR alone; FO at 1 and 16 tokens on tensor cores), then the budget-64 oracle step's
  # programs in their graphs with the routed experts in fragment order against the natural order (scripts/
  # profile_graphs.py --moe-fo-ab, one process, both orders kept; KDT_TC_PTR as the caller sets it)
  fo_tests="fragment_order_gpu or (test_moe_forward_moonlight and (64-bf16-2 or 256-bf16-2))"
  KDT_MOE_TC_FO=1 KDT_TC_PTR=0 tparts 240 fo tests/test_kernels_tc.py tests/test_kernels_moe.py -k "$fo_tests"
  KDT_MOE_TC_FO=1 KDT_TC_PTR=1 tparts 240 fo_ptr tests/test_kernels_tc.py tests/test_kernels_moe.py -k "$fo_tests"
  KDT_TC_PTR=1 tparts 240 ptr tests/test_kernels_tc.py -k "tc_gemm_gpu"
  KDT_MOE_TC_M=1 KDT_MOE_TC_LOAD=0 KDT_MOE_TC_FO=1 KDT_MOE_AB_M=0 tparts 240 fo_small tests/test_kernels_moe.py \
    -k "test_moe_forward_moonlight and (1-bf16-2 or 16-bf16-2)"
  wait
  for n in fo fo_ptr ptr fo_small; do echo "pytest $n:"; grep -h "^FAILED\|passed\|failed\|rc=" "$OUT/pytest_$n.log" | cut -c1-300
  done
  step graphs_fo ${GRAPHS_TIMEOUT:-200} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --drafter oracle \
    --budget 64 --launches none --moe-fo-ab --json "$OUT/profile-graphs-$day-moonlight-fo-ab-s43b.json"
  grep -h -A8 "^== whole" "$OUT/graphs_fo.log" | cut -c1-120 ;;
s43c)  # session 43, issue 7: the 2048- and 256-token prefills by kernel with the routed experts in fragment order
  # (KDT_MOE_TC_FO=1; KDT_TC_PTR as the caller sets it; s41a's table is the natural order's)
  KDT_MOE_TC_FO=1 step prefill_fo ${PREFILL_TIMEOUT:-300} python3 scripts/profile_kernels.py --prefill 2048,256 --top 9
  grep -h -A12 "^== " "$OUT/prefill_fo.log" | cut -c1-120 ;;
s44a)  # session 44, issue 7: the routed experts in fragment order by default (KDT_MOE_TC_FO=auto, the tensor cores from 8
  # tokens on them): kdt bench on the Moonlight shape, then its gpu tests (the Moonlight MoE layer in bf16 at 1 .. 256
  # tokens, the fragment order's GEMMs, the engine's invariant) beside kdt verify (tiny fp32, model_code bf16)
  step bench_moonlight ${BENCH_TIMEOUT:-300} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-s44a.json" \
    && tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160
  tparts 240 moe tests/test_kernels_moe.py tests/test_kernels_tc.py \
    -k "(test_moe_forward_moonlight and bf16-2) or fragment_order_gpu or moonlight_tc"
  tparts 240 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay or step_options or stop_token"
  verify_beside_tparts 150 1 moe engine ;;
s44b)  # session 44, issue 7: s44a's kdt bench with KDT_MOE_TC_FO=0 (session 43's kernels, no copy) on the same card
  KDT_MOE_TC_FO=0 step bench_moonlight_nofo ${BENCH_TIMEOUT:-300} python3 -m kdt.cli bench --preset moonlight-16b-a3b \
    --dtype bf16 --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-nofo-s44b.json" \
    && tail -n 42 "$OUT/bench_moonlight_nofo.log" | cut -c1-160 ;;
s44c)  # session 44, issue 7: kernel B's register cap (V2Tiles.tc_regs, built, off): the Moonlight MoE layer at 65 / 256 tokens, the
  # default (fragment order) against kernel B capped at 128 registers (scripts/bench_moe.py --sweep's tc_regs128, one
  # process), then its gpu test (the layer at 256 tokens against float64, the cap in the kernel's name)
  step moe_regs ${MOE_TIMEOUT:-200} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65,256 --sweep \
    --only "v2,v2 tc_regs128" --json "$OUT/moe-$day-moonlight-regs-s44c.json"
  grep -h "v2" "$OUT/moe_regs.log" | cut -c1-160
  tparts 240 regs tests/test_kernels_moe.py -k "test_moe_forward_moonlight_tiles and tc_regs128"
  wait; echo "pytest regs:"; grep -h "^FAILED\|passed\|failed\|rc=" "$OUT/pytest_regs.log" | cut -c1-300 ;;
s45a)  # session 45, issue 7: where the budget-64 oracle step goes now, launch by launch (the fragment order on; L ~ 176;
  # scripts/profile_graphs.py --launches step: each launch in a graph of its own), then s44c (kernel B's register cap)
  step profile_b64 ${PROFILE_TIMEOUT:-300} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --drafter oracle \
    --budget 64 --launches step --json "$OUT/profile-graphs-$day-moonlight-b64-launches-s45a.json"
  grep -h "==\|step\|forward\|empty\|build\|phase\|launches\|Error\|error" "$OUT/profile_b64.log" | cut -c1-150 | tail -n 30
  bash "$0" s44c ;;  # (the nested call packs the logs: this call's logs are in its logs.tgz)
s46a)  # session 46, issue 7: the tensor-core GEMMs' token tiles fitted to M (kdt.kernels.tc.token_tiles: 65 tokens in
  # blocks of 3 tiles, not 4): Moonlight's projections at 64 / 65 tokens, 4 vs 3 tiles a block (bench_linear --plans),
  # the budget-64 oracle step's programs with the fit on and off (profile_graphs --tiles-ab), then the gpu tests of
  # linear_tc, uv_project / the absorb on tensor cores and the engine's invariant
  step linear_tiles ${LINEAR_TIMEOUT:-200} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 64,65 \
    --tc 65 --plans '2,4,2,8,8;2,3,2,8,8;2,4,2,4,4;2,3,2,4,4' --jobs 8 --json "$OUT/linear-tiles-$day-moonlight-s46a.json"
  grep -h "shape\|N=" "$OUT/linear_tiles.log" | cut -c1-160
  tparts 300 tiles tests/test_kernels_linear.py tests/test_kernels_mla.py \
    -k "test_linear_tc_gpu or test_linear_norm_tc_gpu or (uv_project_gpu and 65) or absorb_tc_gpu"
  step profile_tiles ${PROFILE_TIMEOUT:-330} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b \
    --drafter oracle --budget 64 --launches none --tiles-ab --json "$OUT/profile-graphs-$day-moonlight-b64-tiles-s46a.json"
  grep -h "==\|step\|forward\|empty\|build\|fit\|Error\|error" "$OUT/profile_tiles.log" | cut -c1-150 | tail -n 20
  wait; echo "pytest tiles:"; grep -h "^FAILED\|passed\|failed\|rc=" "$OUT/pytest_tiles.log" | cut -c1-300 ;;
s46b|s47c)  # session 46, issue 7: the final code: kdt bench on the Moonlight shape, then its gpu tests (the Moonlight MoE
  # layer, the engine's invariant) beside kdt verify (tiny fp32, model_code bf16): s44a under this session's name
  # (s47c: the same for session 47's code, next session)
  step bench_moonlight ${BENCH_TIMEOUT:-300} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-$MODE.json" \
    && tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160
  ;&
s46c)  # s46b's checks without its bench (where the device time left is short): the Moonlight MoE layer's and the
  # engine's gpu tests beside kdt verify (tiny fp32, model_code bf16)
  tparts 240 moe tests/test_kernels_moe.py tests/test_kernels_tc.py \
    -k "(test_moe_forward_moonlight and bf16-2) or fragment_order_gpu or moonlight_tc"
  tparts 240 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay or step_options or stop_token"
  verify_beside_tparts 150 1 moe engine ;;
s47a)  # next session, issue 7: the warps a block of linear_tc (kdt.kernels.linear.tc_plan: 8 warps on K where N <= 4096)
  # at 64 and 65 tokens: s46a had qkv_a at 65 tokens faster with 4 warps (23.7 us) than 8 (30.6), o_proj and the dense
  # down slower; both at 64 and 65, with 4 and 3 token tiles
  step linear_warps ${LINEAR_TIMEOUT:-240} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 64,65 \
    --tc 64,65 --plans '2,4,2,8,8;2,4,2,4,4;2,3,2,8,8;2,3,2,4,4' --jobs 8 --json "$OUT/linear-warps-$day-moonlight-s47a.json"
  grep -h "shape\|N=" "$OUT/linear_warps.log" | cut -c1-160
  # the tiled lm_head (163840 x 2048, kdt.kernels.tc_tiled: 1 block of 8 warps an SM at ~236 registers) at 64 / 65
  # tokens with more stages in flight (3 -> 4 / 6 / 8) and 4-warp / 256-row blocks
  step lmhead_stages ${LINEAR_TIMEOUT:-240} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 64,65 \
    --tiled --layers lm_head --tiled-plans '4,2,2,5,4;4,2,2,5,6;4,2,2,5,8;4,1,2,9,3;4,1,2,9,6;8,1,2,9,4;4,2,2,4,6' \
    --jobs 8 --json "$OUT/lmhead-stages-$day-moonlight-s47a.json"
  grep -h "shape\|N=\|plan" "$OUT/lmhead_stages.log" | cut -c1-160 ;;
s47b)  # next session, issue 7: linear_tc's 4 warps past TC_WIDE_BLOCKS blocks (qkv_a at 65 tokens) and the tiled
  # GEMM's wide plan (8 warps on 256 rows, 4 stages, up to 72 tokens: the lm_head at 65), both defaults now, and
  # uv_project writing o as hi / lo for o_proj (kdt.engine.cuda_model.O_HILO, off until this runs): the projections
  # at 128 / 256 tokens with 8 and 4 warps, the tiled lm_head's plans at 65 / 128 / 256, the budget-64 oracle step
  # with the two plans off (session 46's) and with O_HILO on (profile_graphs --ab), the gpu tests of linear_tc, the
  # tiled GEMM and uv_project's hi / lo o beside it
  step linear_wide ${LINEAR_TIMEOUT:-150} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 128,256 \
    --tc 128,256 --plans '2,4,2,8,8;2,4,2,4,4' --jobs 8 --json "$OUT/linear-wide-$day-moonlight-s47b.json"
  grep -h "shape\|N=" "$OUT/linear_wide.log" | cut -c1-160
  step lmhead_wide ${LINEAR_TIMEOUT:-150} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 65,128,256 \
    --tiled --layers lm_head --tiled-plans '8,1,2,9,3;8,1,2,9,6;8,1,1,9,4;8,1,2,8,4;4,2,2,8,4' --jobs 8 \
    --json "$OUT/lmhead-wide-$day-moonlight-s47b.json"
  grep -h "shape\|N=\|plan" "$OUT/lmhead_wide.log" | cut -c1-160
  tparts 300 wide tests/test_kernels_linear.py tests/test_kernels_tc.py tests/test_kernels_mla.py \
    -k "test_linear_tc_gpu or test_linear_norm_tc_gpu or tc_tiled_gemm_gpu or (q_absorb_uv_project_gpu and bf16 and 65)"
  step profile_wide ${PROFILE_TIMEOUT:-300} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b \
    --drafter oracle --budget 64 --launches none \
    --ab kdt.kernels.linear.TC_WIDE_BLOCKS=0,kdt.kernels.tc_tiled.WIDE_MAX_M=0 --ab kdt.engine.cuda_model.O_HILO=1 \
    --json "$OUT/profile-graphs-$day-moonlight-b64-wide-s47b.json"
  grep -h "==\|step\|forward\|empty\|build\|WIDE\|Error\|error" "$OUT/profile_wide.log" | cut -c1-150 | tail -n 20
  wait; echo "pytest wide:"; grep -h "^FAILED\|passed\|failed\|rc=" "$OUT/pytest_wide.log" | cut -c1-300 ;;
s48a)  # next session, issue 7: the shared experts in fragment order (moe.SHARED_FO) and b's hi / lo from the engine's
  # norm (moe.B_HILO: kernel A's shared gate_up on it, no b_perm conversion), both off until timed: the Moonlight MoE
  # layer at 16 / 65 / 256 tokens with each on (bench_moe --previous --only, --parts: A's head and A), the budget-64
  # oracle step with each on (profile_graphs --ab), then the gpu tests with both on (the Moonlight layer with and
  # without b_hl, rmsnorm's two outputs, the engine's invariant) beside kdt verify
  step moe_shared ${MOE_TIMEOUT:-260} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 16,65,256 \
    --previous --only "v2,shared_fo_b_hl,shared_fo_no_b_hl,b_hl" --parts --jobs 8 \
    --json "$OUT/moe-shared-fo-$day-moonlight-s48a.json"
  grep -h "moonlight" "$OUT/moe_shared.log" | grep -v compiled | cut -c1-150
  step profile_shared ${PROFILE_TIMEOUT:-230} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b \
    --drafter oracle --budget 64 --launches none --ab kdt.kernels.moe.SHARED_FO=1 \
    --ab kdt.kernels.moe.B_HILO=1,kdt.kernels.moe.SHARED_FO=1 \
    --json "$OUT/profile-graphs-$day-moonlight-b64-shared-s48a.json"
  grep -h "==\|step\|forward\|empty\|build\|B_HILO\|Error\|error" "$OUT/profile_shared.log" | cut -c1-150 | tail -n 20
  export KDT_MOE_SHARED_FO=1 KDT_MOE_B_HILO=1
  tparts 200 moe tests/test_kernels_moe.py tests/test_kernels_elementwise.py \
    -k "(test_moe_forward_moonlight and bf16-2) or rmsnorm_gpu"
  tparts 200 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay or step_options"
  verify_beside_tparts 100 1 moe engine ;;
s48c|s48d)  # (s48d: its tests and verify alone) s48a trimmed to ~4 minutes, by priority: the gpu tests with both on beside kdt verify, the layer at 65 tokens
  # with both on, then the budget-64 oracle step with both on (cut where the call ends)
  ( export KDT_MOE_SHARED_FO=1 KDT_MOE_B_HILO=1
    tparts 150 moe tests/test_kernels_moe.py tests/test_kernels_elementwise.py \
      -k "(test_moe_forward_moonlight and bf16-2) or (rmsnorm_gpu and 2048)"
    tparts 150 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay"
    verify_beside_tparts 100 1 moe engine )
  if [ "$MODE" = s48c ]; then
    step moe_shared ${MOE_TIMEOUT:-150} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65 \
      --previous --only "v2,shared_fo_b_hl" --parts --jobs 8 --json "$OUT/moe-shared-fo-$day-moonlight-s48c.json"
    grep -h "moonlight" "$OUT/moe_shared.log" | grep -v compiled | cut -c1-150
    step profile_shared ${PROFILE_TIMEOUT:-200} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b \
      --drafter oracle --budget 64 --launches none --ab kdt.kernels.moe.B_HILO=1,kdt.kernels.moe.SHARED_FO=1 \
      --json "$OUT/profile-graphs-$day-moonlight-b64-shared-s48c.json"
    grep -h "==\|step\|forward\|empty\|build\|B_HILO\|Error\|error" "$OUT/profile_shared.log" | cut -c1-150 \
      | tail -n 20
  fi ;;
s48e)  # next session, issue 7: the tiled GEMM's copy offsets computed once a block (kdt.kernels.tc_tiled.PRE, off until
  # timed; sm_90 SASS: the wide plan's k loop 1130 -> 419 instructions for 72 HMMA, 254 -> 168 registers): the
  # lm_head at 65 / 128 / 256 tokens with it (bench_linear --tiled --tiled-plans with a sixth element 1), the
  # budget-64 oracle step with it on (profile_graphs --ab), then the tiled GEMM's gpu tests (both ways, the same bits)
  step tiled_pre ${LINEAR_TIMEOUT:-200} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 65,128,256 \
    --tiled --layers lm_head --tiled-plans '8,1,2,9,4,1;4,2,2,8,3,1;4,2,2,8,4,1' --jobs 8 \
    --json "$OUT/lmhead-pre-$day-moonlight-s48e.json"
  grep -h "shape\|N=\|plan" "$OUT/tiled_pre.log" | cut -c1-160
  step profile_pre ${PROFILE_TIMEOUT:-230} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b \
    --drafter oracle --budget 64 --launches none --ab kdt.kernels.tc_tiled.PRE=1 \
    --json "$OUT/profile-graphs-$day-moonlight-b64-pre-s48e.json"
  grep -h "==\|step\|forward\|empty\|build\|PRE\|Error\|error" "$OUT/profile_pre.log" | cut -c1-150 | tail -n 20
  tparts 150 tiled tests/test_kernels_tc.py tests/test_kernels_linear.py -k "tc_tiled_gemm_gpu or test_linear_norm_tc_gpu"
  wait; echo "pytest tiled:"; grep -h "^FAILED\|passed\|failed\|rc=" "$OUT/pytest_tiled.log" | cut -c1-300 ;;
s49a)  # session 49, issue 7: the attention's qkv_a / o_proj on fragment-ordered weights (kdt.engine.cuda_model.ATTN_FO,
  # off until timed) and the tiled GEMM's copy offsets once a block (tc_tiled.PRE, s48e's): their gpu tests (the same
  # bits both ways) in the background, qkv_a / o_proj at 16 / 65 / 128 / 256 tokens (bench_linear --tc: hilo against
  # fo), the lm_head at 65 / 128 with PRE plans, then the budget-64 oracle step with each on (profile_graphs)
  tparts 200 fo tests/test_kernels_linear.py tests/test_kernels_tc.py -k "fo_same_bits_gpu or tc_tiled_gemm_gpu"
  step attn_fo ${LINEAR_TIMEOUT:-150} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 16,65,128,256 \
    --tc 65 --plans '2,3,2,4,4;2,3,2,8,8' --layers qkv_a,o_proj --jobs 8 --json "$OUT/attn-fo-$day-moonlight-s49a.json"
  grep -h "shape\|N=" "$OUT/attn_fo.log" | cut -c1-200
  step tiled_pre ${TILED_TIMEOUT:-120} python3 scripts/bench_linear.py --presets moonlight-16b-a3b --M 65,128 \
    --tiled --layers lm_head --tiled-plans '8,1,2,9,4,1;4,2,2,8,3,1' --jobs 8 \
    --json "$OUT/lmhead-pre-$day-moonlight-s49a.json"
  grep -h "shape\|N=\|plan" "$OUT/tiled_pre.log" | cut -c1-160
  step profile_fo ${PROFILE_TIMEOUT:-240} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b \
    --drafter oracle --budget 64 --launches none --attn-fo-ab --ab kdt.kernels.tc_tiled.PRE=1 \
    --json "$OUT/profile-graphs-$day-moonlight-b64-fo-pre-s49a.json"
  grep -h "==\|step\|forward\|empty\|build\|PRE\|afo\|Error\|error" "$OUT/profile_fo.log" | cut -c1-150 | tail -n 20
  wait; echo "pytest fo:"; grep -h "^FAILED\|passed\|failed\|rc=" "$OUT/pytest_fo.log" | cut -c1-300 ;;
s49b)  # session 49, short of device time: every built-and-off change in one call (~450 s): the gpu tests with all
  # four on (moe.SHARED_FO, moe.B_HILO, cuda_model.ATTN_FO, tc_tiled.PRE) beside kdt verify with all on, then the
  # budget-64 oracle step with each on and all four together (profile_graphs: whole programs in their graphs)
  ( export KDT_MOE_SHARED_FO=1 KDT_MOE_B_HILO=1 KDT_ATTN_FO=1 KDT_TILED_PRE=1
    tparts 220 kern tests/test_kernels_moe.py tests/test_kernels_elementwise.py tests/test_kernels_linear.py \
      tests/test_kernels_tc.py -k "(test_moe_forward_moonlight and bf16-2) or (rmsnorm_gpu and 2048) or \
      fo_same_bits_gpu or tc_tiled_gemm_gpu"
    tparts 220 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay"
    verify_beside_tparts 110 1 kern engine )
  step profile_all ${PROFILE_TIMEOUT:-300} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b \
    --drafter oracle --budget 64 --launches none --attn-fo-ab --ab kdt.kernels.moe.SHARED_FO=1,kdt.kernels.moe.B_HILO=1 \
    --ab kdt.kernels.tc_tiled.PRE=1 \
    --ab kdt.kernels.moe.SHARED_FO=1,kdt.kernels.moe.B_HILO=1,kdt.kernels.tc_tiled.PRE=1,kdt.engine.cuda_model.ATTN_FO=1 \
    --json "$OUT/profile-graphs-$day-moonlight-b64-all-s49b.json"
  grep -h "==\|step\|forward\|empty\|build\|PRE\|afo\|set \|Error\|error" "$OUT/profile_all.log" | cut -c1-170 \
    | tail -n 24 ;;
s50a)  # next session, issue 7: where the budget-64 oracle step goes with session 49's defaults, launch by launch on an
  # H200 (scripts/profile_graphs.py --launches all: each launch of the AR step and of the DDTree step in a graph of its
  # own; s45a's was an H100's; LAUNCHES=step: the DDTree step alone), then kdt bench (s48b's command, JSON named
  # s50a) as far as the call's time goes
  step profile_b64 ${PROFILE_TIMEOUT:-300} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --drafter oracle \
    --budget 64 --launches ${LAUNCHES:-all} --json "$OUT/profile-graphs-$day-moonlight-b64-launches-s50a.json"
  grep -h "==\|step\|forward\|empty\|build\|phase\|launches\|Error\|error" "$OUT/profile_b64.log" | cut -c1-150 \
    | tail -n 30
  step bench_moonlight ${BENCH_TIMEOUT:-270} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-$MODE.json" \
    && tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
s50b)  # session 50, issue 7: session 49's gpu tests and kdt verify on the final code with its defaults (no env): the
  # kernel and engine tests (420 s each) beside verify of tiny (fp32) and model_code (bf16), then MoE parts
  tparts 420 kern tests/test_kernels_moe.py tests/test_kernels_elementwise.py tests/test_kernels_linear.py \
    tests/test_kernels_tc.py -k "(test_moe_forward_moonlight and bf16-2) or (rmsnorm_gpu and 2048) or \
    fo_same_bits_gpu or tc_tiled_gemm_gpu"
  tparts 420 engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay or step_options or stop_token"
  verify_beside_tparts 150 1 kern engine
  # then the Moonlight MoE layer's launches as growing prefixes at 1 and 65 tokens (kernel A's head: the router
  # logits, routing and grouping without the shared gate_up; kdt's defaults)
  step moe_parts ${MOE_TIMEOUT:-110} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 1,65 --parts \
    --only v2 --json "$OUT/moe-parts-$day-moonlight-s50b.json"
  grep -h "prefix\|+ \|whole" "$OUT/moe_parts.log" | cut -c1-150 ;;
s51a)  # session 51, issue 7: kernel A's head (router logits, routing, grouping) at 8 and 65 tokens with the grouping's
  # placement by match.any.sync (the default) and by the serial loop before it (KDT_MOE_GROUP_MATCH=0), a process each,
  # each in token tiles of 8 (the default at 65) / 4 / 2 (bench_moe's sweep variants "v2 A_tiles4" / "v2 A_tiles2"; the
  # session's run named them without "v2 " and timed the default alone); then the MoE gpu tests
  for gm in 0 1; do
    KDT_MOE_GROUP_MATCH=$gm step moe_a_gm$gm ${MOE_TIMEOUT:-150} python3 scripts/bench_moe.py --presets \
      moonlight-16b-a3b --M 8,65 --parts --sweep --only "v2,v2 A_tiles4,v2 A_tiles2" --jobs 8 \
      --json "$OUT/moe-a-$day-moonlight-gm$gm-s51a.json"
    grep -h "v2\|A_tiles\|A route\|Error\|error" "$OUT/moe_a_gm$gm.log" | cut -c1-150
  done
  tparts ${TEST_TIMEOUT:-240} kern tests/test_kernels_moe.py -k "(test_moe_forward_moonlight and bf16-2) or \
    ab_repeated_moonlight or code_shape_gpu"
  wait; grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_kern.log" | cut -c1-300 ;;
s52a)  # next session, issue 7: kernel A's token tiles of 4 where it runs on tensor cores (KDT_MOE_A_TT=4; session 51's
  # s51b: -3.3 to -4.9 us a Moonlight layer at 65 tokens): the MoE and engine gpu tests and kdt verify with it, then the
  # budget-64 step in its graphs with it on and off (--ab kdt.kernels.moe.A_TT=4, one process; run in session 52 when
  # the default was 0: A_TT is 4 by default since, so its A/B now runs 4 against 4)
  export KDT_MOE_A_TT=4
  tparts ${TEST_TIMEOUT:-300} kern tests/test_kernels_moe.py -k "(test_moe_forward_moonlight and bf16-2) or \
    ab_repeated_moonlight or code_shape_gpu"
  tparts ${TEST_TIMEOUT:-300} engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay"
  verify_beside_tparts 150 1 kern engine
  unset KDT_MOE_A_TT  # (the A/B below turns it on itself)
  step profile_att ${PROFILE_TIMEOUT:-230} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --drafter oracle \
    --budget 64 --launches none --ab kdt.kernels.moe.A_TT=4 --json "$OUT/profile-graphs-$day-moonlight-b64-att-s52a.json"
  grep -h "==\|step\|forward\|empty\|build\|A_TT\|Error\|error" "$OUT/profile_att.log" | cut -c1-150 | tail -n 12 ;;
s52b)  # next session, issue 7: which launch of the AR step is slower with GROUP_MATCH on (session 51's s51c-e: the AR
  # step +27-45 us, the budget-64 step -555-590 us): the AR step launch by launch (profile_graphs times launches with
  # its defaults only) in a process with GROUP_MATCH on and one with it off (LAUNCHES=all: the DDTree step's too)
  for gm in 1 0; do
    KDT_MOE_GROUP_MATCH=$gm step profile_gm$gm ${PROFILE_TIMEOUT:-240} python3 scripts/profile_graphs.py --preset \
      moonlight-16b-a3b --drafter oracle --budget 64 --launches ${LAUNCHES:-ar} \
      --json "$OUT/profile-graphs-$day-moonlight-b64-gm$gm-launches-s52b.json"
    grep -h "==\|AR step\|forward\|moe\|launches\|Error\|error" "$OUT/profile_gm$gm.log" | cut -c1-150 | tail -n 30
  done ;;
s53a)  # session 53, issue 7: kernel C at 65 tokens (s51b: 156 us for 64 experts' 369 MB, ~78% of copy, where kernel B's
  # routed gate_up ran at ~100%): capped at 96 / 80 registers (5 / 6 blocks an SM) and its ticketed combine with 1 / 2 /
  # 4 outputs a thread in flight, a token's slots compiled in (kc) or not (bench_moe's sweep variants, --parts: C's
  # added time); beside it the gpu tests of those tiles at Moonlight's shape (its variant names are the run's, before
  # a453fec; the defaults then took them, and bench_moe's sweep now names the forms around the new default: s53c)
  tparts ${TEST_TIMEOUT:-300} kern tests/test_kernels_moe.py -k "test_moe_forward_moonlight_tiles and (c_regs or cmb)"
  step moe_c ${MOE_TIMEOUT:-420} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65 --parts --sweep \
    --only "v2,v2 C_regs96,v2 C_regs80,v2 C_cmb4,v2 C_kc,v2 C_cmb2_kc,v2 C_cmb4_kc,v2 C_regs80_cmb2_kc,v2 \
C_regs96_cmb4_kc" --jobs 12 --json "$OUT/moe-c-$day-moonlight-s53a.json"
  grep -h "v2\|C down\|Error\|error" "$OUT/moe_c.log" | cut -c1-150
  wait; grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" "$OUT/pytest_kern.log" | cut -c1-300 ;;
s53b)  # session 53, issue 7: kernel C's cap and combine in the engine's graphs: the budget-64 oracle step and the AR
  # step with the default and with C_REGS / C_CMB / C_KC set (--ab columns, one process; $AB overrides them)
  ab=()
  for c in ${AB:-kdt.kernels.moe.C_REGS=80 kdt.kernels.moe.C_CMB=2,kdt.kernels.moe.C_KC=1 \
           kdt.kernels.moe.C_REGS=80,kdt.kernels.moe.C_CMB=2,kdt.kernels.moe.C_KC=1}; do ab+=(--ab "$c"); done
  step profile_c ${PROFILE_TIMEOUT:-500} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --drafter oracle \
    --budget 64 --launches none "${ab[@]}" --json "$OUT/profile-graphs-$day-moonlight-b64-c-s53b.json"
  grep -h "==\|step\|forward\|empty\|build\|C_\|Error\|error" "$OUT/profile_c.log" | cut -c1-170 | tail -n 16 ;;
s53c)  # session 53, issue 7: the gpu tests and kdt verify with kernel C's new defaults (capped at 80 registers at 2
  # token tiles, its combine's loads in flight: C_REGS / C_CMB / C_KC): the Moonlight MoE layer, kernel C's other forms
  # at Moonlight's shape, the engine's invariant and graph replay, tiny (fp32) and model_code (bf16) verify
  tparts ${TEST_TIMEOUT:-330} kern tests/test_kernels_moe.py -k "(test_moe_forward_moonlight and bf16-2) or \
    ab_repeated_moonlight or code_shape_gpu or (test_moe_forward_moonlight_tiles and (c_regs or cmb))"
  tparts ${TEST_TIMEOUT:-330} engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay"
  verify_beside_tparts 150 1 kern engine
  # then kernel C's forms at 65 tokens again with the new defaults (C_s52: as before session 53), in blocks of 8 warps
  # and with its ticket fenced by thread 0 alone
  step moe_c ${MOE_TIMEOUT:-200} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65 --parts --sweep \
    --only "v2,v2 C_s52,v2 C_uncapped,v2 C_cmb1,v2 C_no_kc,v2 C_8warps_kw4,v2 C_fence1" --jobs 12 \
    --json "$OUT/moe-c-$day-moonlight-s53c.json"
  grep -h "v2\|C down\|Error\|error" "$OUT/moe_c.log" | cut -c1-150 ;;
s54a)  # session 54, issue 7: the gpu tests and kdt verify with session 53's defaults (kernel C capped at 80 registers,
  # its combine's loads in flight), linear_v2's post norm (new, off) on the GPU; then verify and the engine's invariant
  # with the post norm on at one token (KDT_LINEAR_POST_NORM_M=1: o_proj writes the MoE's input norm)
  tparts ${TEST_TIMEOUT:-330} kern tests/test_kernels_moe.py -k "(test_moe_forward_moonlight and bf16-2) or \
    ab_repeated_moonlight or code_shape_gpu or (test_moe_forward_moonlight_tiles and (c_regs or cmb))"
  tparts ${TEST_TIMEOUT:-330} lin tests/test_kernels_linear.py -k "post_norm or norm_gpu"
  tparts ${TEST_TIMEOUT:-330} engine tests/test_engine_cuda.py -k "invariant_200 or graph_replay"
  verify_beside_tparts 150 1 kern lin engine
  summary=()
  export KDT_LINEAR_POST_NORM_M=1
  tparts ${TEST_TIMEOUT:-200} engine_post tests/test_engine_cuda.py -k "invariant_200 or graph_replay"
  verify_beside_tparts 150 1 engine_post
  unset KDT_LINEAR_POST_NORM_M ;;
s54b)  # session 54, issue 7: the post norm in the engine's graphs (the AR step and the budget-64 oracle step with
  # POST_NORM_MAX_M = 1, --ab, one process), then kernel C's forms at 65 tokens (s53c's bench: the new defaults against
  # C_s52, 8-warp blocks, the ticket fenced by thread 0 alone)
  step profile_post ${PROFILE_TIMEOUT:-330} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --drafter oracle \
    --budget 64 --launches none --ab kdt.kernels.linear.POST_NORM_MAX_M=1 \
    --json "$OUT/profile-graphs-$day-moonlight-b64-post-s54b.json"
  grep -h "==\|step\|forward\|empty\|build\|POST\|Error\|error" "$OUT/profile_post.log" | cut -c1-170 | tail -n 16
  step moe_c ${MOE_TIMEOUT:-200} python3 scripts/bench_moe.py --presets moonlight-16b-a3b --M 65 --parts --sweep \
    --only "v2,v2 C_s52,v2 C_uncapped,v2 C_cmb1,v2 C_no_kc,v2 C_8warps_kw4,v2 C_fence1" --jobs 12 \
    --json "$OUT/moe-c-$day-moonlight-s54b.json"
  grep -h "v2\|C down\|Error\|error" "$OUT/moe_c.log" | cut -c1-150 ;;
s54c)  # session 54, issue 7: the post norm's tail with its loads in flight (s54b's tail loaded in loops: +157 us a
  # step), in the engine's graphs (--ab, one process), then its gpu tests and the Moonlight layer's bf16 tests (their
  # name check fixed for kernel C's _fo_r80_cmb2_k6)
  # (budget ${BUDGET:-4}: the AR step is what it changes, and a small verify compiles fewer kernels on a cold card)
  step profile_post ${PROFILE_TIMEOUT:-300} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --drafter oracle \
    --budget ${BUDGET:-4} --launches none --ab kdt.kernels.linear.POST_NORM_MAX_M=1 \
    --json "$OUT/profile-graphs-$day-moonlight-b${BUDGET:-4}-post-s54c.json"
  grep -h "==\|step\|forward\|empty\|build\|POST\|Error\|error" "$OUT/profile_post.log" | cut -c1-170 | tail -n 16
  tparts ${TEST_TIMEOUT:-250} lin tests/test_kernels_linear.py -k "post_norm"
  tparts ${TEST_TIMEOUT:-250} kern tests/test_kernels_moe.py -k "test_moe_forward_moonlight and bf16-2"
  wait; for n in lin kern; do echo "pytest $n:"; grep -h "^FAILED\|^ERROR\|passed\|failed\|rc=" \
    "$OUT/pytest_$n.log" | cut -c1-300; done ;;
s54d)  # session 54, issue 7: the post norm at the kernel level first (o_proj + the norm's launch against the norm in
  # o_proj's, back to back, Moonlight and Kimi-K2 at one token; seconds of compile), then s54c's engine A/B if time is left
  step post_lin ${LIN_TIMEOUT:-150} python3 scripts/bench_linear.py --presets moonlight-16b-a3b,kimi-k2 --M 1 --post \
    --json "$OUT/linear-post-$day-s54d.json"
  grep -h "norm:\|Error\|error" "$OUT/post_lin.log" | cut -c1-170
  step profile_post ${PROFILE_TIMEOUT:-300} python3 scripts/profile_graphs.py --preset moonlight-16b-a3b --drafter oracle \
    --budget 4 --launches none --ab kdt.kernels.linear.POST_NORM_MAX_M=1 \
    --json "$OUT/profile-graphs-$day-moonlight-b4-post-s54d.json"
  grep -h "==\|step\|forward\|POST\|Error\|error" "$OUT/profile_post.log" | cut -c1-170 | tail -n 12 ;;
s48b|s53d)  # session 48: kdt bench on the final code (after s48a), JSON named by the mode (s53d: session 53's)
  step bench_moonlight ${BENCH_TIMEOUT:-300} python3 -m kdt.cli bench --preset moonlight-16b-a3b --dtype bf16 \
    --compile-jobs 12 --json "$OUT/bench-$day-moonlight-16b-a3b-bf16-$MODE.json" \
    && tail -n 50 "$OUT/bench_moonlight.log" | cut -c1-160 ;;
*) echo "usage: $0 engine|kernels|bench|all-engine|baseline|step|final|drafter|mla|profile|session4|train|drafters|moe|moe-ab|session6|tree|moe-wide|all-tests|train-eval|dense-ab|final8|small-linear|final9|moon9|ab9|drafter9|norm-ab|moe10|final10|moon10|norm-moon10|kv-ab|s11a|s11b|s11c|s11d|s12t|s12a|s12b|s12c|s13a|s13b|s13c|s13d|s14t|s14a|s14b|s15a|s15b|s15c|s16a|s16b|s16c|s17a|s17b|s18a|s18b|s18c|s18d|s19a|s19b|s19c|s19d|s19e|s20a|s20b|s20c|s20d|s21a|s21b|s21c|s22a|s22b|s22c|s23a|s23b|s23c|s23d|s24b|s24c|s24d|s24e|s25a|s25b|s25c|s26a|s26b|s26c|s26d|s26e|s27a|s27b|s27c|s27d|s27e|s28a|s28b|s28c|s29a|s29b|s29c|s29d|s30a|s30b|s30c|s30d|s30e|s31a|s31b|s31c|s31d|s32a|s32b|s32c|s32d|s32e|s33a|s33b|s33c|s34a|s34b|s34c|s34d|s35a|s35b|s35c|s35d|s36a|s36b|s36c|s36d|s36e|s37a|s39a|s39b|s39c|s40a|s40b|s40c|s41a|s41b|s41c|s42a|s42b|s42c|s42d|s42e|s43a|s43b|s43c|s44a|s44b|s44c|s45a|s46a|s46b|s46c|s47a|s47b|s47c|s48a|s48b|s48c|s48d|s48e|s49a|s49b|s50a|s50b|s51a|s52a|s52b|s53a|s53b|s53c|s53d|s54a|s54b|s54c|s54d"; exit 2 ;;
esac
cat "$OUT/gpu.txt"
printf '%s\n' "${summary[@]}"
# the device returns at most 8 files: the logs travel as one archive
( cd "$OUT" && ls ./*.log > /dev/null 2>&1 && tar czf logs.tgz ./*.log && rm -f ./*.log )
