#!/usr/bin/env bash
# One device-tool call's worth of GPU work, by stage (each stage bounded by its own timeout; logs and JSON to $OUT).
#   benchmarks/run_gpu.sh explore   generate(): Qwen3 12-layer B=1,32, engine options, profile; then the GPU tests
#   benchmarks/run_gpu.sh bench     benchmarks/bench_generate.py on all models (table, JSON, plot)
#   benchmarks/run_gpu.sh tests     pytest -m gpu (every GPU test)
#   benchmarks/run_gpu.sh mixtral   every GPU test, then Mixtral's rows;  compiled: the remaining rows
#   benchmarks/run_gpu.sh layer     benchmarks/bench_moe.py --quick (the layer grid, JSON + log)
#   benchmarks/run_gpu.sh layer_fp8 benchmarks/bench_moe.py --dtype fp8 --quick (the FP8 grid, JSON + log + plot)
#   benchmarks/run_gpu.sh tune      python -m moecomp tune (PRESETS, TOKENS; writes the package table, copied to $OUT)
#   benchmarks/run_gpu.sh tune4     python -m moecomp tune --quant4 both (the 4-bit presets; resumable, table to $OUT)
#   benchmarks/run_gpu.sh diag      benchmarks/diag_kernels.py (DIAG_ARGS; default: the TMA part, gemm1 and gemm2)
#   benchmarks/run_gpu.sh nan       the GPU tests of the op and the reliability suite, then the routing kernel timed
#                                   against the version in .ab/routing_old.py (carried; e.g. git show HEAD~:...)
#   benchmarks/run_gpu.sh next      STEP=1|2|3: the next session's plan (every GPU test; FP8 generate at full depth;
#                                   the dense FP8 linear at prefill sizes)
#   benchmarks/run_gpu.sh fp8tma    the FP8 TMA GEMMs' GPU tests, then `tune --fp8 prequant` at T = 1024, 8192
#   benchmarks/run_gpu.sh warmup    benchmarks/bench_warmup.py: the one-liner's warm-up in fresh processes (issue 20)
#   benchmarks/run_gpu.sh sanitize  benchmarks/nan_routing_probe.py and the graph-replay NaN test under
#                                   compute-sanitizer memcheck (with .ab/routing_old.py too, to show the probe fails)
#   benchmarks/run_gpu.sh mixfp8    issue 39: Mixtral FP8's token disagreement: op tests, tiny generate, 8 layers table on/off
#   benchmarks/run_gpu.sh heur      issue 39: moecomp's layer grid with this GPU's table, then without it
#   benchmarks/run_gpu.sh s19       STEP=0|1|2|2a|2b|2c|3: the next session's calls (0: the Gluon probe; 2c: skinny tiles) (tests named, Mixtral FP8 by block, fused A/B)
#   benchmarks/run_gpu.sh s20       STEP=1|2|3|4: the session after 2026-12-08's (new GPU tests and diags, generate A/B, FP8
#                                   retune with the Gluon candidate, H200 step)
#   benchmarks/run_gpu.sh e2e80     issue 39: generate() at full depth on an 80 GB GPU: Qwen3-30B-A3B bf16 and FP8,
#                                   Mixtral-8x7B FP8 (built in FP8), B=1,8,32, one process each, under 540 s in all
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export MOECOMP_COMMIT=${MOECOMP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
quiet() { grep -v -i "warn\|^\s*$\|torch._dynamo\|^  " ; }
case "${1:-explore}" in
tests+explore)
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.log" \
      | grep -v "^DEBUG" | tail -12
  "$0" explore ;;
explore)
  timeout ${EXPLORE_TIMEOUT:-330} python3 benchmarks/bench_generate.py ${EXPLORE_ARGS:---models qwen3 --batches 1,32 \
      --paths hf,optimize_hf,one_liner,one_liner_compiled --profile hf:1,one_liner:1,one_liner:32} \
      --budget-s 280 --out-json "$OUT/explore.json" 2>&1 | tee "$OUT/explore.log" | quiet | tail -60
  [ -n "${EXPLORE_ONLY:-}" ] || timeout 240 python3 -m pytest -q -p no:cacheprovider \
      tests/generate/test_generate_gpu.py 2>&1 | tee "$OUT/tests_generate.log" | tail -25 ;;
bench)
  timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/bench_generate.py ${BENCH_ARGS:-} 2>&1 \
      | tee "$OUT/bench.log" | quiet | tail -80 ;;
final)  # generate GPU tests, then the benchmark: every model without the compiled rows, then qwen3's compiled rows
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/generate/test_generate_gpu.py 2>&1 \
      | tee "$OUT/tests_generate.log" | grep -v "^DEBUG" | tail -6
  timeout 320 python3 benchmarks/bench_generate.py --budget-s 285 --compiled-models none \
      --variants ${VARIANTS:-qwen3:1=one_liner_eager_prefill+one_liner_sdpa,qwen3:32=one_liner_align64+one_liner_sdpa,qwen2:1=one_liner_no_overlap+one_liner_no_fse,qwen2:32=one_liner_no_overlap,deepseek:1=one_liner_no_overlap} \
      --profile hf:1,one_liner:1,one_liner:32 --out-json "$OUT/bench_main.json" 2>&1 \
      | tee "$OUT/bench_main.log" | grep -v "^DEBUG" | quiet | grep -v "^|" | tail -70
  timeout ${COMPILED_TIMEOUT:-110} python3 benchmarks/bench_generate.py --models qwen3 --batches 1 \
      --paths hf,optimize_static,hf_static,hf_static_moecomp --budget-s 75 --out-json "$OUT/bench_compiled.json" \
      2>&1 | tee "$OUT/bench_compiled.log" | grep -v "^DEBUG" | quiet | grep -v "^|" | tail -12 ;;
rest)  # the models the final stage's budget left out, and transformers' rows measured without routing hooks
  timeout 330 python3 benchmarks/bench_generate.py --budget-s 270 --compiled-models none ${REST_ARGS:-} \
      --out-json "$OUT/bench_rest.json" 2>&1 | tee "$OUT/bench_rest.log" | grep -v "^DEBUG" | quiet \
      | grep -v "^|" | tail -40 ;;
mixtral)  # every GPU test, then Mixtral at every batch size (the rows the earlier calls' budget left out)
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/tests.log" \
      | grep -v "^DEBUG" | tail -8
  timeout 330 python3 benchmarks/bench_generate.py --budget-s 300 --models mixtral --compiled-models none \
      --paths hf,experts_impl,optimize_hf,one_liner --out-json "$OUT/bench_mixtral.json" 2>&1 \
      | tee "$OUT/bench_mixtral.log" | grep -v "^DEBUG" | quiet | grep -v "^|" | tail -30 ;;
compiled)  # Qwen1.5-MoE / DeepSeek-V3 at batch 8 and 128, then transformers' compiled rows past batch 1
  timeout 215 python3 benchmarks/bench_generate.py --budget-s 190 --models qwen2,deepseek --batches 8,128 \
      --paths hf,optimize_hf,one_liner --compiled-models none --out-json "$OUT/bench_rest2.json" 2>&1 \
      | tee "$OUT/bench_rest2.log" | grep -v "^DEBUG" | quiet | grep -v "^|" | tail -20
  timeout 270 python3 benchmarks/bench_generate.py --budget-s 230 --models qwen3 --batches 32,8 \
      --compiled-batches 8,32 --paths hf,hf_static,hf_static_moecomp,optimize_static,one_liner \
      --out-json "$OUT/bench_compiled2.json" 2>&1 | tee "$OUT/bench_compiled2.log" | grep -v "^DEBUG" | quiet \
      | grep -v "^|" | tail -20
  timeout 60 python3 benchmarks/diag_tokens.py --models mixtral --layers 8 --prompt 512 --batch 4 2>&1 \
      | grep -v "^DEBUG\|Warn" > "$OUT/diag_mixtral8.log"; grep -A3 "argmax\|block_rel" "$OUT/diag_mixtral8.log" ;;
tests)  # every GPU test: TEST_WORKERS xdist workers share the GPU (Triton's compiles are CPU-bound; 430 s serial at
        # 9bf6c19; at 8b52347 on an H100: 8 workers reached 94% in 440 s, 12 ran out of memory in 35 tests), then the
        # tests marked `exclusive` (they fill the device memory) alone; failures named
  peaks=$(python3 -c "import tempfile, os; print(os.path.join(tempfile.gettempdir(), 'moecomp-gpu-tests.peaks'))")
  rm -f "$peaks"
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -rfE --durations=8 -m "gpu and not exclusive" -n ${TEST_WORKERS:-8} \
      -p no:cacheprovider ${TEST_PATHS:-tests} 2>&1 | grep -v "^DEBUG" | tee "$OUT/tests.log" | tail -30
  timeout ${EXCL_TIMEOUT:-90} python3 -m pytest -q -rfE -m "gpu and exclusive" -p no:cacheprovider tests 2>&1 \
      | grep -v "^DEBUG" | tee "$OUT/tests-exclusive.log" | tail -4
  [ -f "$peaks" ] && sort -rn "$peaks" > "$OUT/tests-peaks.log" && echo "== GPU tests over 2 GiB (of $(wc -l < "$OUT/tests-peaks.log")):" \
      && head -12 "$OUT/tests-peaks.log" && grep UNMARKED "$OUT/tests-peaks.log" | head -8 ;;
layer)  # the layer benchmark: every family, every T, every peer in the same run (vLLM's kernel from the copy in
        # .peers/, carried: cp -r ../shared/peers/vllm_fused_moe .peers/), ROUTING=real|uniform|zipf|one-hot,
        # LAYER_ARGS: more bench_moe.py options (e.g. --breakdown mixtral:8192)
  peer=(); [ -d .peers/vllm_fused_moe ] && peer=(--vllm-peer .peers/vllm_fused_moe)
  timeout ${LAYER_TIMEOUT:-560} python3 benchmarks/bench_moe.py --quick --budget-s ${LAYER_BUDGET:-470} "${peer[@]}" \
      --routing ${ROUTING:-real} ${LAYER_ARGS:-} --out-json "$OUT/layer-${ROUTING:-real}.json" 2>&1 | grep -v "^DEBUG" \
      | tee "$OUT/layer-${ROUTING:-real}.log" | quiet | tail -60 ;;
layer_fp8)  # issue 19: the FP8 layer benchmark (--dtype fp8): every family, every T; moecomp's op on FP8 block-quantized
            # experts (the kernel table's mode, w8a8 and w8a16 forced), moecomp bf16, vLLM's fp8 block path (the copy
            # in .peers/, carried as for `layer`), torch._scaled_grouped_mm; HF peers n/a. ~4-6 min on an H200: the
            # budget stops new cells at LAYER_BUDGET s (default 400) so the table prints inside an 8-minute call
  peer=(); [ -d .peers/vllm_fused_moe ] && peer=(--vllm-peer .peers/vllm_fused_moe)
  timeout ${LAYER_TIMEOUT:-470} python3 benchmarks/bench_moe.py --dtype fp8 --quick --budget-s ${LAYER_BUDGET:-400} \
      "${peer[@]}" --routing ${ROUTING:-real} ${LAYER_ARGS:-} --out-json "$OUT/layer-fp8-${ROUTING:-real}.json" 2>&1 \
      | grep -v "^DEBUG" | tee "$OUT/layer-fp8-${ROUTING:-real}.log" | quiet | tail -${LAYER_TAIL:-70}
  python3 benchmarks/report.py "$OUT/layer-fp8-${ROUTING:-real}.json" --plot-fp8 "$OUT/layer-fp8-${ROUTING:-real}.png" \
      > /dev/null 2>> "$OUT/layer-fp8-${ROUTING:-real}.log" || true ;;
diag)  # kernel-level diagnostics (routing sweep, PDL placement, router GEMV, per-kernel split, TMA tiles), JSON to $OUT
  timeout ${DIAG_TIMEOUT:-400} python3 benchmarks/diag_kernels.py ${DIAG_ARGS:---parts tma} \
      --out-json "$OUT/diag.json" 2>&1 | grep -v "^DEBUG" | tee "$OUT/diag.log" | grep "^\[" | tail -60 ;;
nan)  # issue 25: GPU tests that run the routing kernel, and the routing kernel against the previous version
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -rfE --durations=5 -m gpu -p no:cacheprovider tests/reliability \
      tests/ops/test_gpu.py tests/kernels 2>&1 | grep -v "^DEBUG" | tee "$OUT/tests-nan.log" | tail -15
  [ -f .ab/routing_old.py ] && timeout 200 python3 benchmarks/diag_kernels.py --parts route_ab \
      --route-ab .ab/routing_old.py --out-json "$OUT/diag-route-ab.json" 2>&1 | grep -v "^DEBUG" \
      | tee "$OUT/diag-route-ab.log" | grep "^\[" | tail -30 ;;
sanitize)  # memcheck: the probe with this routing kernel, then with the old one; the graph-replay NaN test
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  echo "compute-sanitizer: ${cs:-not found}"
  for r in "" ${ROUTING_OLD:-.ab/routing_old.py}; do
    echo "== probe ${r:-(this tree)}"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SAN_TIMEOUT:-150} "$cs" --tool memcheck --print-limit 5 --error-exitcode 3 \
        python3 benchmarks/nan_routing_probe.py ${r:+--routing $r} 2>&1 | grep -v "^DEBUG" \
        | tee -a "$OUT/sanitize.log" | grep -E "^\[probe\]|ERROR SUMMARY|Invalid|out of bounds" | head -30
    echo "rc ${PIPESTATUS[0]}"
  done
  timeout ${SAN_TEST_TIMEOUT:-200} "$cs" --tool memcheck --error-exitcode 3 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/reliability/test_nonfinite_routing.py -k "graph_replay and sqrtsoftplus" 2>&1 | grep -v "^DEBUG" \
      | tee -a "$OUT/sanitize.log" | grep -E "passed|failed|ERROR SUMMARY" | tail -5 ;;
fp8tests)  # issue 19: the FP8 GPU tests (op, kernels, fp8_linear; the real-format checkpoint round trip and generate),
          # then a bf16 regression subset of the op's GPU tests (the kernels gained constexpr FP8 branches)
  timeout ${FP8_TEST_TIMEOUT:-200} python3 -m pytest -q -rfE --durations=10 -m gpu -p no:cacheprovider \
      tests/ops/test_fp8_gpu.py ${FP8_TEST_K:+-k "$FP8_TEST_K"} 2>&1 | grep -v "^DEBUG" | tee "$OUT/tests-fp8-op.log" \
      | tail -25
  timeout ${HF_TEST_TIMEOUT:-100} python3 -m pytest -q -rfE -s -m gpu -p no:cacheprovider tests/hf/test_fp8_gpu.py \
      2>&1 | grep -v "^DEBUG" | tee "$OUT/tests-fp8-hf.log" | grep -E "on CUDA|passed|failed|Error" | tail -15
  timeout ${BF16_TEST_TIMEOUT:-70} python3 -m pytest -q -rfE -m gpu -p no:cacheprovider tests/ops/test_gpu.py \
      -k "real_layer_sizes or graph" 2>&1 | grep -v "^DEBUG" | tee "$OUT/tests-bf16-subset.log" | tail -6 ;;
fp8gen)  # issue 19: generate() with FP8 weights against the same model in bf16 (benchmarks/bench_generate_fp8.py)
  timeout ${GEN_TIMEOUT:-240} python3 benchmarks/bench_generate_fp8.py ${GEN_ARGS:---models qwen3,deepseek \
      --batches 1,32} --budget-s ${GEN_BUDGET:-200} --out-json "$OUT/generate-fp8.json" 2>&1 | grep -v "^DEBUG" \
      | tee "$OUT/generate-fp8.log" | grep -E "^\[|^\||error" | tail -24 ;;
fp8tune)  # issue 19: the speed candidates' GPU tests, then `tune --fp8 both` (w8a8 / w8a16 with their candidates per
         # bucket; resumable: a second call goes on where the budget stopped the first), table copied to $OUT
  timeout ${FP8_TEST_TIMEOUT:-170} python3 -m pytest -q -rfE --durations=5 -m gpu -p no:cacheprovider \
      tests/ops/test_fp8_gpu.py -k "${FP8_TEST_K:-candidates or prequant or quantize_act}" 2>&1 | grep -v "^DEBUG" \
      | tee "$OUT/tests-fp8-candidates.log" | tail -12
  timeout ${TUNE_TIMEOUT:-450} python3 -m moecomp tune --fp8 ${FP8_CHOICE:-both} -v --rep ${TUNE_REP:-10} --budget-s ${TUNE_BUDGET:-360} \
      --presets ${PRESETS:-all} ${TOKENS:+--tokens $TOKENS} --copy-to "$OUT" 2>&1 | tee "$OUT/tune-fp8.log" \
      | grep -v "^DEBUG" | grep "T=\|tune\]" | grep -v "^\s*\(decode \)\?T=" | tail -${TUNE_TAIL:-60} ;;
fp8next)  # issue 19, next session: the rest of `tune --fp8 both` (resumes: the 8 entries in the table are skipped),
          # then the FP8 grid and generate (Qwen3 B=1,8,32 with the kernel profile at B=1, DeepSeek-V3 B=1,8,32, both
          # with the fp8 tokens checked against the dequantized reference); three calls' worth: STEP=tune|grid|gen
  case "${STEP:-tune}" in
  tune) FP8_CHOICE=${FP8_CHOICE:-lean} TUNE_BUDGET=${TUNE_BUDGET:-400} "$0" fp8tune ;;
  grid) "$0" layer_fp8 ;;
  gen) GEN_ARGS="${GEN_ARGS:---models qwen3,deepseek --batches 1,8,32 --profile 1 --ref-batches 1}" \
       GEN_BUDGET=${GEN_BUDGET:-420} GEN_TIMEOUT=${GEN_TIMEOUT:-540} "$0" fp8gen ;;
  esac ;;
fp8tma)  # issue 19: the FP8 TMA GEMMs (kernels/grouped_gemm_tma_fp8.py): their GPU tests, then `tune --fp8 prequant
        # --restart` at the many-token buckets (TMA tiles among the candidates), table copied to $OUT
  timeout ${FP8_TEST_TIMEOUT:-170} python3 -m pytest -q -rfE -s --durations=5 -m gpu -p no:cacheprovider \
      tests/ops/test_fp8_tma_gpu.py 2>&1 | grep -v "^DEBUG" | tee "$OUT/tests-fp8-tma.log" \
      | grep -E "passed|failed|rror|: \{" | tail -24
  "$0" fp8tmatune ;;
fp8tmatune)  # `tune --fp8 prequant --restart` (T = 1024, 8192 by default; the TMA tiles among the candidates)
  timeout ${TUNE_TIMEOUT:-420} python3 -m moecomp tune --fp8 prequant --restart -v --rep ${TUNE_REP:-10} \
      --budget-s ${TUNE_BUDGET:-340} --presets ${PRESETS:-qwen3_30b_a3b,deepseek_v3,mixtral_8x7b,olmoe_1b_7b,qwen15_moe_a27b} \
      --tokens ${TOKENS:-1024,8192} --copy-to "$OUT" 2>&1 | tee "$OUT/tune-fp8-tma.log" | grep -v "^DEBUG" \
      | grep "T=\|tune\]" | grep -v "^\s*\(decode \)\?T=" | tail -${TUNE_TAIL:-40} ;;
fp8grid)  # issue 19: the FP8 TMA tune again (the "@2" tiles joined: two programs per SM), then the FP8 grid on the table
          # it wrote (vLLM's kernel from .peers/, carried)
  TUNE_TIMEOUT=${TUNE_TIMEOUT:-200} TUNE_BUDGET=${TUNE_BUDGET:-150} TUNE_TAIL=12 "$0" fp8tmatune
  LAYER_TIMEOUT=${LAYER_TIMEOUT:-350} LAYER_BUDGET=${LAYER_BUDGET:-290} LAYER_TAIL=40 "$0" layer_fp8 ;;
warmup)  # issues 20 / 41: the one-liner's warm-up in fresh processes: cold, warm (Inductor's / Triton's on-disk caches),
         # artifacts (fresh on-disk caches + the moecomp artifact cache the cold run saved: a warm start elsewhere)
         # (benchmarks/bench_warmup.py; Qwen3-30B-A3B at its 48 layers, Qwen1.5-MoE at its 24, B = 1 then 32)
  timeout ${WARMUP_TIMEOUT:-540} python3 benchmarks/bench_warmup.py --models ${WARMUP_MODELS:-qwen3=48,qwen2=24} \
      --batches ${WARMUP_BATCHES:-1,32} --timeout-s ${WARMUP_CHILD_S:-200} --out-json "$OUT/warmup.json" 2>&1 \
      | grep -v "^DEBUG" | tee "$OUT/warmup.log" | grep "^\[warmup\]\|^|" ;;
final13)  # the thirteenth session's last call: every GPU test at the final commit, then Qwen3-30B-A3B's warm-up (48
          # layers, B=1, fresh processes) after optimize stopped checking every later layer's experts on the way
  TEST_TIMEOUT=${TEST_TIMEOUT:-400} EXCL_TIMEOUT=${EXCL_TIMEOUT:-80} "$0" tests
  WARMUP_MODELS=qwen3=48 WARMUP_BATCHES=1 WARMUP_TIMEOUT=${WARMUP_TIMEOUT:-100} WARMUP_CHILD_S=90 "$0" warmup ;;
issue20)  # issue 20, next session: the generate GPU tests (eager-step-free replays, warmup, the memory-state capture,
          # the shared compiled layer), then Qwen3 (12 layers) and Qwen1.5-MoE (24 layers) at B=1,32: one-liner and
          # transformers, TTFT, warm-up of the first and second call, a kernel profile of one step at B=1
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -rfE -p no:cacheprovider tests/generate/test_generate_gpu.py \
      2>&1 | grep -v "^DEBUG" | tee "$OUT/tests-generate.log" | tail -12
  timeout ${GEN_TIMEOUT:-360} python3 benchmarks/bench_generate.py ${GEN_ARGS:---models qwen3,qwen2 --layers qwen3=12 \
      --batches 1,32 --paths hf,one_liner --profile one_liner:1} --budget-s ${GEN_BUDGET:-320} \
      --out-json "$OUT/generate-issue20.json" 2>&1 | tee "$OUT/generate-issue20.log" | quiet | tail -40 ;;
skinny)  # issues 19 / 20: the skinny linear (kernels/skinny.py, M <= 4) against cuBLAS bf16 and fp8_linear's dot form
        # with a tile sweep; its GPU tests; then Qwen3 B=1 FP8 generate with it (default) and without (MOECOMP_SKINNY=0)
  timeout ${SKINNY_TIMEOUT:-260} python3 benchmarks/diag_skinny.py --rows ${SKINNY_ROWS:-1,2,4} \
      --sweep-budget-s ${SWEEP_BUDGET:-150} --out-json "$OUT/diag-skinny.json" 2>&1 | grep -v "^DEBUG" \
      | tee "$OUT/diag-skinny.log" | grep "^|\|skipped"
  timeout 60 python3 -m pytest -q -rfE -p no:cacheprovider tests/kernels/test_skinny.py 2>&1 | tail -3
  for g in 1 0; do MOECOMP_SKINNY=$g timeout 150 python3 benchmarks/bench_generate_fp8.py --models qwen3 \
      --batches 1 --ref-batches "" --budget-s 120 --out-json "$OUT/generate-fp8-skinny$g.json" 2>&1 | grep "fp8 decode"
  done ;;
wrap)  # the tenth session's last call: the GPU tests of what joined (the skinny linear in fp8_linear and in the decode
      # steps, sparsemixer / hash routing branches of the routing kernel, latent projections) and of the paths they
      # touch (routing on non-finite rows, generate), then Qwen3 (12 layers) B=1 one-liner with its step profile
  timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -rfE --durations=6 -m gpu -n 4 -p no:cacheprovider \
      tests/kernels/test_skinny.py tests/ops/test_sparsemixer.py tests/ops/test_latent.py tests/ops/test_hash_routing.py \
      tests/reliability/test_nonfinite_routing.py tests/generate/test_generate_gpu.py tests/hf/test_fp8_gpu.py 2>&1 \
      | grep -v "^DEBUG" | tee "$OUT/tests-wrap.log" | tail -16
  timeout ${GEN_TIMEOUT:-120} python3 benchmarks/bench_generate.py --models qwen3 --layers qwen3=12 --batches 1 \
      --paths one_liner --profile one_liner:1 --budget-s ${GEN_BUDGET:-95} --out-json "$OUT/generate-b1.json" 2>&1 \
      | tee "$OUT/generate-b1.log" | quiet | tail -24 ;;
next)  # the twelfth session's first calls (STEP=1|2): 1 = every GPU test at the final commit (the down-combine's
       # zero-expert slot as a nested constexpr branch, 5d5128d; 9 DeepSeek-sized tests ran out of memory in 4 workers
       # of a subset at 5d5128d and passed alone); 2 = FP8 generate at Qwen3's full depth, B=1 profiled and 8 (the
       # rows to beat: 2.976 / 8.931 ms/step, bf16 3.202 / 9.259), then the prefill's host profile
  case "${STEP:-1}" in
  1) "$0" tests ;;
  2) GEN_BATCHES=1,8 GEN_BUDGET=300 GEN_TIMEOUT=380 "$0" s11
     timeout 180 python3 benchmarks/diag_prefill_host.py --layers 6 --top 30 > "$OUT/prefill-host.txt" 2>&1
     grep "=====" "$OUT/prefill-host.txt" ;;
  3) "$0" fp8lin ;;
  esac ;;
fp8lin)  # issue 19, prefill: the dense FP8 linear at M = 64 / 512 / 2048 against cuBLAS bf16, with prequant and a
         # tile sweep (benchmarks/diag_fp8_linear.py); the winners go into tuning.fp8_linear_config
  timeout ${FP8LIN_TIMEOUT:-420} python3 benchmarks/diag_fp8_linear.py --rows ${FP8LIN_ROWS:-64,512,2048} \
      --budget-s ${FP8LIN_BUDGET:-360} --out-json "$OUT/diag-fp8-linear.json" 2>&1 | grep -v "^DEBUG" \
      | tee "$OUT/diag-fp8-linear.log" | grep "^|\|FAILED\|rror" ;;
s11)  # the eleventh session's first call: the GPU tests the tenth session did not run on the GPU (the skinny op's
     # opcheck with autograd, the refactored replay tests, the spellings recogniser), then FP8 generate on Qwen3-30B-A3B
     # at its full depth (48 layers: the bf16 lm_head no longer weighs a fifth of the step), B = 1 (profiled) and 8
  [ -n "${GEN_BATCHES:-}" ] || timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -rfE --durations=4 -m gpu -n 4 -p no:cacheprovider \
      tests/kernels/test_skinny.py tests/kernels/test_fp8_gemm.py tests/ops/test_latent.py tests/ops/test_sparsemixer.py \
      tests/ops/test_zero_experts.py tests/passes/test_per_expert_spellings.py tests/passes/test_detect_latent.py \
      tests/passes/test_detect_weight_on_input.py tests/passes/test_detect_zero_experts.py 2>&1 | grep -v "^DEBUG" \
      | tee "$OUT/tests-s11.log" | tail -12
  GEN_ARGS="--models qwen3 --layers qwen3=${QWEN3_LAYERS:-48} --batches ${GEN_BATCHES:-1,8} --profile 1 --ref-batches 0" \
      GEN_BUDGET=${GEN_BUDGET:-330} GEN_TIMEOUT=${GEN_TIMEOUT:-420} "$0" fp8gen ;;
e2e80)  # issue 39 item 5: end-to-end generate() at full depth on one 80 GB GPU, one process per row group, each under
        # its own timeout and budget (a killed step keeps the rows it finished: the JSON is rewritten after each row):
        # (a) Qwen3-30B-A3B bf16, 48 layers (61 GB), transformers' generate timed at every B;
        # (b) Qwen3-30B-A3B FP8, built in FP8 (31 GB), bf16 rows from (a), transformers' loop on the plain dequantized
        #     forward at B=1 (its own FP8 forward needs hub kernels);
        # (c) Mixtral-8x7B FP8 at 32 layers, built in FP8 (47 GB; bf16 would be 93 GB), the same peer, then moecomp bf16
        #     at 16 layers, B=1 (budget allowing);
        # (d) with the time left (E2E_STATIC_MIN s at least): transformers' static cache + torch.compile on (a), B=1.
        # 8 files: e2e80-{qwen3-bf16,qwen3-fp8,mixtral-fp8,qwen3-hfstatic}.{json,log}
        # CPU dry run of the stage's logic: E2E_DEV="--device cpu --tiny" E2E_QWEN3_LAYERS=2 E2E_MIXTRAL_LAYERS=2
        # E2E_MIXTRAL_BF16_LAYERS=1 E2E_BATCHES=1,2 E2E_STATIC_MIN=100000 OUT=/tmp/e2e benchmarks/run_gpu.sh e2e80
  E2E_TOTAL=${E2E_TOTAL:-540} QL=${E2E_QWEN3_LAYERS:-48} ML=${E2E_MIXTRAL_LAYERS:-32}
  com="--batches ${E2E_BATCHES:-1,8,32} --prompt ${E2E_PROMPT:-512} --new ${E2E_NEW:-32} --peer-new ${E2E_PEER_NEW:-16}"
  com="$com ${E2E_DEV:-}"
  e2e() {  # NAME TIMEOUT BUDGET ARGS...: one bench_generate_fp8.py process
    local n=$1 t=$2 bud=$3; shift 3
    echo "== e2e80 $n: timeout ${t} s, budget ${bud} s (${SECONDS} s in)"
    timeout "$t" python3 benchmarks/bench_generate_fp8.py $com --budget-s "$bud" "$@" --out-json "$OUT/e2e80-$n.json" \
        2>&1 | grep -v "^DEBUG" | tee "$OUT/e2e80-$n.log" | grep -E "^\[|^#|rror"  # (the tables: at the end)
    echo "== e2e80 $n: rc ${PIPESTATUS[0]} (${SECONDS} s in)"
  }
  e2e qwen3-bf16 ${E2E_A_TIMEOUT:-170} ${E2E_A_BUDGET:-135} --models qwen3 --layers qwen3=$QL --build bf16 --formats bf16
  e2e qwen3-fp8 ${E2E_B_TIMEOUT:-140} ${E2E_B_BUDGET:-110} --models qwen3 --layers qwen3=$QL --build fp8 \
      --peer-batches 1 --bf16-json "$OUT/e2e80-qwen3-bf16.json"
  e2e mixtral-fp8 ${E2E_C_TIMEOUT:-200} ${E2E_C_BUDGET:-165} --models mixtral --layers mixtral=$ML --build fp8 \
      --peer-batches 1 --bf16-layers mixtral=${E2E_MIXTRAL_BF16_LAYERS:-16} --bf16-batches ${E2E_MIXTRAL_BF16_BATCHES:-1}
  left=$(( E2E_TOTAL - SECONDS - 5 ))
  if [ "$left" -ge "${E2E_STATIC_MIN:-90}" ]; then
    echo "== e2e80 qwen3-hfstatic: transformers' static cache + compile, 48 layers, B=1: timeout ${left} s"
    timeout "$left" python3 benchmarks/bench_generate.py --models qwen3 --layers qwen3=$QL --batches 1 --paths hf_static \
        --compiled-models qwen3 --compiled-batches 1 --prompt ${E2E_PROMPT:-512} --new ${E2E_NEW:-32} ${E2E_DEV:-} \
        --budget-s $((left - 20)) --out-json "$OUT/e2e80-qwen3-hfstatic.json" 2>&1 | grep -v "^DEBUG" \
        | tee "$OUT/e2e80-qwen3-hfstatic.log" | grep -E "hf_static|skipping cudagraphs|rror" | tail -8
  else
    echo "== e2e80: ${left} s left, under E2E_STATIC_MIN=${E2E_STATIC_MIN:-90}: no static cache + compile row"
  fi
  python3 benchmarks/bench_generate_fp8.py --table "$OUT"/e2e80-qwen3-bf16.json "$OUT"/e2e80-qwen3-fp8.json \
      "$OUT"/e2e80-mixtral-fp8.json 2>&1 | grep "^|"
  echo "== e2e80 done in ${SECONDS} s" ;;
heur)  # issue 39: moecomp alone on the layer grid (30 cells) with this GPU's table, then with it ignored (MOECOMP_TABLE
       # modes: HEUR_MODES, default "on off"; "loo" also ignores every entry of the cell's own shape), same machine
  for m in ${HEUR_MODES:-on off}; do
    timeout $(( ${HEUR_BUDGET:-85} + 40 )) python3 benchmarks/bench_moe.py --quick --budget-s ${HEUR_BUDGET:-85} \
        --peers moecomp --table $m --out-json "$OUT/layer-table$m.json" 2>&1 | grep -v "^DEBUG" > "$OUT/layer-table$m.log"
    echo "== table $m (${SECONDS} s in): $(tail -1 "$OUT/layer-table$m.log" | cut -c1-200)"
  done ;;
mixfp8)  # issue 39: Mixtral-8x7B FP8's 0/16 tokens at 32 layers (H100, 2f8b014): the op at real sizes (T = 1..1024),
         # the tiny model's generate against its reference, then 8 layers with the reference's logit gaps, with this
         # GPU's table and without it (a tuned entry at fault shows as a difference between the two)
  timeout ${MIX_TEST_TIMEOUT:-240} python3 -m pytest -q -rfE -p no:cacheprovider -k mixtral \
      tests/ops/test_fp8_gpu.py tests/hf/test_fp8_gpu.py 2>&1 | grep -v "^DEBUG" | tee "$OUT/mixfp8-tests.log" | tail -8
  for m in on off; do
    MOECOMP_TABLE=$m timeout ${MIX_TIMEOUT:-120} python3 benchmarks/bench_generate_fp8.py --models mixtral \
        --layers mixtral=${MIX_LAYERS:-8} --build fp8 --batches 1 --peers '' --prompt 512 --new 32 --budget-s 90 \
        --out-json "$OUT/mixfp8-table$m.json" 2>&1 | grep -v "^DEBUG" | tee "$OUT/mixfp8-table$m.log" \
        | grep -E "one-liner|reference|rror"
  done ;;
s18a)  # 2026-12-07 fourth session, first call: the GPU tests new since the last GPU run (routes, sinks, warm cache,
       # fused decode, skinny group, generate), the fused decode launches' diagnostics, then Qwen3 (12
       # layers) generate() with the fused launches on / off and the prefill uncaptured, TTFT and launches per layer
  timeout ${S18_TEST_TIMEOUT:-230} python3 -m pytest -q -rfE --durations=6 -n 4 -p no:cacheprovider \
      tests/generate/test_generate_gpu.py tests/generate/test_sinks_gpu.py tests/ops/test_routes_gpu.py \
      tests/generate/test_warm_cache_gpu.py tests/generate/test_fused_decode_gpu.py \
      tests/kernels/test_skinny_group.py tests/generate/test_routed_experts_gpu.py tests/generate/test_prefill_graph_gpu.py \
      2>&1 | grep -v "^DEBUG" | tee "$OUT/tests-s18.log" | tail -16
  timeout ${S18_DIAG_TIMEOUT:-80} python3 benchmarks/diag_fused_decode.py --out-json "$OUT/diag-fused.json" 2>&1 \
      | grep -v "^DEBUG" | tee "$OUT/diag-fused.log" | grep "^|" | tail -40
  timeout ${S18_GEN_TIMEOUT:-230} python3 benchmarks/bench_generate.py --models qwen3 --layers qwen3=12 --batches 1,32 \
      --paths hf,one_liner --variants qwen3:1=one_liner_fused+one_liner_fuse_linears+one_liner_no_prefill_graph,qwen3:32=one_liner_fused \
      --profile one_liner:1,one_liner_fused:1 --budget-s ${S18_GEN_BUDGET:-200} --out-json "$OUT/generate-fused.json" \
      2>&1 | tee "$OUT/generate-fused.log" | quiet | grep "^|\|rror" | tail -40 ;;
s19)  # the next session's calls (STEP=1|2|3), each under 9 minutes; logs and JSON to $OUT
       # 1: the GPU tests new since the last full run, verbose (three failed unnamed at 73ca285: -v names them), then
       #    Mixtral FP8 at 8 layers block by block (benchmarks/diag_fp8_blocks.py: against the w8a8 and w8a16
       #    references) and generate() with the kernel forced to w8a8 (the reference's own math)
       # 2: the new kernels' GPU tests and diagnostics (RMSNorm prologue: tests/kernels/test_skinny_norm_gpu.py and
       #    diag_fused_decode --parts norm; the 4-bit mma form: tests/ops/test_quant4_mma_gpu.py, diag_w4_mma.py), then
       #    the fused decode launches A/B, interleaved on fresh engines (--repeat 3), B=1, Qwen3 12 layers
       # 2b: the compressed-tensors GPU test; DeepSeek-V3 T=8192 FP8 (the H100 table's one missing entry)
       # 3 (H200): the GPU tests of tests/ops + tests/kernels, the heuristic check, routing record / replay costs
  case "${STEP:-1}" in
  1)
    timeout ${S19_TEST_TIMEOUT:-200} python3 -m pytest -v -rfE -n 8 -p no:cacheprovider \
        tests/generate/test_generate_gpu.py tests/generate/test_sinks_gpu.py tests/ops/test_routes_gpu.py \
        tests/generate/test_warm_cache_gpu.py tests/generate/test_fused_decode_gpu.py \
        tests/kernels/test_skinny_group.py tests/generate/test_routed_experts_gpu.py \
        tests/generate/test_prefill_graph_gpu.py > "$OUT/tests-s19.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/tests-s19.log" | grep -v "^\[gw" | cut -c1-250 | tail -14
    timeout 120 python3 benchmarks/diag_fp8_blocks.py --model mixtral --layers 8 --prompt 512 \
        --out-json "$OUT/diag-fp8-blocks.json" 2>&1 | grep -v "^DEBUG" | tee "$OUT/diag-fp8-blocks.log" | grep "^\[diag\]"
    MOECOMP_FP8_MODE=w8a8 timeout 110 python3 benchmarks/bench_generate_fp8.py --models mixtral --layers mixtral=8 \
        --build fp8 --batches 1 --peers '' --prompt 512 --new 32 --budget-s 90 --out-json "$OUT/mixfp8-w8a8.json" 2>&1 \
        | grep -v "^DEBUG" | tee "$OUT/mixfp8-w8a8.log" | grep -E "one-liner|reference|rror" ;;
  0)  # seconds: does this Triton's Gluon take the FP8 gemm2 / gemm1 (kernels/gluon_fp8*.py): right on tiny cases?
    timeout 60 python3 benchmarks/probe_gluon.py 2>&1 | grep -v "^DEBUG" | tee "$OUT/probe-gluon.log" | tail -20 ;;
  2)
    timeout 200 python3 -m pytest -v -rfE -n 4 -p no:cacheprovider tests/kernels/test_skinny_norm_gpu.py \
        tests/ops/test_quant4_mma_gpu.py tests/ops/test_quant4_mma_load_gpu.py tests/ops/test_fp8_gluon_gpu.py \
        tests/ops/test_attention_one_launch_gpu.py > "$OUT/tests-norm-w4mma.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/tests-norm-w4mma.log" | grep -v "^\[gw" | cut -c1-250 | tail -8
    timeout 60 python3 benchmarks/diag_fused_decode.py --parts norm --rows 1,2,4 --out-json "$OUT/diag-norm.json" 2>&1 \
        | grep -v "^DEBUG" | tee "$OUT/diag-norm.log" | grep "^|" | tail -14
    timeout 90 python3 benchmarks/diag_fused_decode.py --parts attention --out-json "$OUT/diag-attn1.json" 2>&1 \
        | grep -v "^DEBUG" | tee "$OUT/diag-attn1.log" | grep "^|" | tail -14
    timeout 100 python3 benchmarks/diag_w4_mma.py --decode --out-json "$OUT/diag-w4mma-decode.json" 2>&1 \
        | grep -v "^DEBUG" | tee "$OUT/diag-w4mma-decode.log" | tail -16
    timeout 90 python3 benchmarks/diag_w4_mma.py --tokens 16,64,128 --out-json "$OUT/diag-w4mma.json" 2>&1 \
        | grep -v "^DEBUG" | tee "$OUT/diag-w4mma.log" | tail -12 ;;
  2a)  # the fused decode launches A/B (interleaved, fresh engines), then the Gluon FP8 gemm2 against the TMA kernel
    timeout 150 python3 benchmarks/diag_fp8_gluon.py --out-json "$OUT/diag-fp8-gluon.json" 2>&1 | grep -v "^DEBUG" \
        | tee "$OUT/diag-fp8-gluon.log" | tail -24
    timeout 260 python3 benchmarks/bench_generate.py --models qwen3 --layers qwen3=12 --batches 1 --paths one_liner \
        --variants qwen3:1=one_liner_fuse_norm+one_liner_attn1+one_liner_fuse_linears --repeat 3 --budget-s 230 \
        --out-json "$OUT/generate-fused-ab.json" 2>&1 | tee "$OUT/generate-fused-ab.log" | quiet | grep "^|" | tail -12 ;;
  2b)
    timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/hf/test_compressed_gpu.py 2>&1 \
        | grep -v "^DEBUG" | tee "$OUT/tests-compressed.log" | tail -5
    timeout 90 python3 -m moecomp tune --fp8 lean -v --rep 10 --budget-s 40 --presets deepseek_v3 --tokens 8192 \
        --copy-to "$OUT" 2>&1 | tee "$OUT/tune-fp8-ds8192.log" | grep "/1 \|rror" | cut -c1-220 ;;
  2c)  # the skinny projections' tiles on this GPU (tuned on the H200 only; 62% of the copy rate on the H100's Qwen3
       # step): heuristic vs a swept best at 1 and 2 rows, Qwen3 / DeepSeek-V3 / gpt-oss-120b shapes
    timeout 240 python3 benchmarks/diag_skinny.py --rows 1,2 --sweep-budget-s 180 --out-json "$OUT/diag-skinny.json" \
        2>&1 | grep -v "^DEBUG" | tee "$OUT/diag-skinny.log" | grep "^|" | tail -32 ;;
  3)
    TEST_PATHS="tests/ops tests/kernels" TEST_WORKERS=12 TEST_TIMEOUT=250 EXCL_TIMEOUT=30 "$0" tests
    timeout 100 python3 benchmarks/bench_routes.py --presets qwen3_30b_a3b --tokens 1,64 --generate 12 --batches 1,32 \
        --out "$OUT/bench_routes.json" 2>&1 | tee "$OUT/bench_routes.log" | grep "^|" | tail -12
    HEUR_BUDGET=60 "$0" heur ;;
  esac ;;
s20)  # the session after 2026-12-08's (STEP=1|2|3|4), each under 9 minutes; logs and JSON to $OUT
       # 1 (H100): the GPU tests of what was merged without a GPU (GEMV on the mma layout, o_proj + add + norm,
       #    q / k norm + rotary + cache, the default norm fold in the decode step), then the new fused parts' diag and
       #    the 4-bit layout question (weights held as mma against packed, every T)
       # 2 (H100): generate() A/B on fresh engines, interleaved (--repeat 3), Qwen3 12 layers B=1: the default (norm
       #    fold on) against the fold off, o_proj fold and q / k rope fold
       # 3 (H100): the FP8 table retuned at T = 1024 / 8192 with the Gluon candidate (tune --fp8 lean --restart)
       # 4 (H200): s19's step 3 (tests/ops + tests/kernels, routing costs, the heuristic check)
  case "${STEP:-1}" in
  1)
    timeout ${S20_TEST_TIMEOUT:-250} python3 -m pytest -v -rfE -n 4 -p no:cacheprovider \
        tests/ops/test_quant4_gemv_mma_gpu.py tests/ops/test_quant4_mma_load_gpu.py tests/kernels/test_linear_add_norm_gpu.py \
        tests/kernels/test_qk_rope.py tests/generate/test_fused_decode_gpu.py tests/generate/test_generate_gpu.py \
        > "$OUT/tests-s20.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/tests-s20.log" | grep -v "^\[gw" | cut -c1-250 | tail -14
    timeout 90 python3 benchmarks/diag_fused_decode.py --parts oproj,qkrope --rows 1,2,4 --batches 1,8,32 \
        --out-json "$OUT/diag-oproj-qkrope.json" 2>&1 | grep -v "^DEBUG" | tee "$OUT/diag-oproj-qkrope.log" | grep "^|"
    timeout 130 python3 benchmarks/diag_w4_mma.py --tokens 1,4,16,64,128 --paths "w4,w4 held mma,bf16" \
        --out-json "$OUT/diag-w4-held.json" 2>&1 | grep -v "^DEBUG" | tee "$OUT/diag-w4-held.log" | tail -10 ;;
  2)
    timeout 500 python3 benchmarks/bench_generate.py --models qwen3 --layers qwen3=12 --batches 1 --paths one_liner \
        --variants qwen3:1=one_liner_no_fuse_norm+one_liner_fuse_oproj+one_liner_fuse_qkrope --repeat 3 --budget-s 440 \
        --profile one_liner:1 --out-json "$OUT/generate-s20-ab.json" 2>&1 | tee "$OUT/generate-s20-ab.log" | quiet \
        | grep "^|" | tail -14 ;;
  3)
    mkdir -p "$OUT/fp8"; OUT="$OUT/fp8" TOKENS=1024,8192 TUNE_ARGS="--fp8 lean" TUNE_TIMEOUT=540 TUNE_BUDGET=450 \
        TUNE_TAIL=40 "$0" tune ;;
  4)
    STEP=3 "$0" s19 ;;
  esac ;;
tune)  # retune the kernel table (every preset and bucket by default) and keep a copy of it under $OUT
  timeout ${TUNE_TIMEOUT:-560} python3 -m moecomp tune --restart -v --rep ${TUNE_REP:-10} --budget-s ${TUNE_BUDGET:-480} \
      --presets ${PRESETS:-all} ${TOKENS:+--tokens $TOKENS} ${TUNE_ARGS:-} --copy-to "$OUT" 2>&1 | tee "$OUT/tune.log" \
      | grep -v "^DEBUG" | grep "T=\|tune\]" | tail -${TUNE_TAIL:-80} ;;
tune4)  # issue 39: the 4-bit experts' tables (`tune --quant4 both`: K-step forms, aligned tiles, GEMV / DIRECT decode
       # tiles and the decode limit per bucket) on gpt-oss-120b, Qwen3-30B-A3B int4 and gpt-oss-20b, in that order;
       # resumable (the next call goes on where the budget stopped), the table and its .meta.json copied to $OUT.
       # Bounded for one 9-minute call: no entry starts after TUNE_BUDGET s, the timeout leaves the last one ~110 s
  timeout ${TUNE_TIMEOUT:-510} python3 -m moecomp tune --quant4 ${Q4_CHOICE:-both} -v --rep ${TUNE_REP:-10} \
      --budget-s ${TUNE_BUDGET:-400} --presets ${PRESETS:-gpt_oss_120b,qwen3_30b_a3b_int4,gpt_oss_20b} \
      ${TOKENS:+--tokens $TOKENS} --copy-to "$OUT" 2>&1 | tee "$OUT/tune-quant4.log" | grep -v "^DEBUG" \
      | grep "T=\|tune\]" | grep -v "^\[tune\] \(decode \)\?T=" | tail -${TUNE_TAIL:-50} ;;
esac
