#!/usr/bin/env bash
# The GPU runs of the committed results, one plan per device call (run from the repo root).
#   bash bench/gpu_run.sh smoke|full|rest|e2e|e2e-tokenizer|itl|serving-tokenizer|serving-batch|peers|kernels|gemm|tp-tiles|verify-tiles|skinny-prefetch|fp8-goals|fp8-skinny|knockout  -> results under $OUT/res (tarred to $OUT/res.tgz), logs in $OUT
#   bash bench/gpu_run.sh tests-decode|tests-overlap|tests-tp|tests-attention-rest|frontend|compile-path  -> GPU test logs in $OUT (each plan fits one 10-minute call)
#   bash bench/gpu_run.sh warm-profile  -> capture's cold / warm start-up, each under cProfile, in $OUT/prof
#   bash bench/gpu_run.sh host-profile  -> the host step at batch 64 and a cProfile of one generate, in $OUT/prof
#   bash bench/gpu_run.sh host-check  -> the engine's GPU parity tests, host-profile and warm-profile (profiles in $OUT/prof.tgz)
#   bash bench/gpu_run.sh soak-start, then at once (the machine stays warm 30 s) soak-finish (THEN="host tests": then
#     host-check's parts with the call's time left)  -> issue 43's
#     10-minute soak, longer than one call: the first starts `bench soak` in a session of its own (setsid
#     outlives the call) and watches it; the second waits for it and brings back soak.json and the logs.
#     Carry .whl and bench/.tokenizer: .whl holds the wheels the image lacks, at the versions of the
#     CPU venv (`.venv/bin/pip list`): fastapi, starlette, pydantic, pydantic_core, annotated-types,
#     typing-inspection, uvicorn, opentelemetry-api and annotated-doc (fastapi 0.165 imports them),
#     anyio, click, h11, idna, sniffio, typing_extensions, httpx, httpcore, certifi, prometheus_client
#     and uvloop, httptools (uvicorn picks them up when present, as the serve extra installs them)
#     (`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d .whl ...`).
#     SOAK_S (default 600) shortens it for a diagnostic run.
# Each suite runs under its own `timeout`, so one that hangs or overruns loses only its own rows.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
R=/tmp/bench_res/res
mkdir -p "$R"
LOG=$OUT/log.txt
gpu_tests() {  # gpu_tests NAME SECONDS PYTEST-ARGS...: one pytest run under its own timeout, its log in $OUT
  local name=$1 limit=$2; shift 2
  local start=$(date +%s)
  echo "=== pytest $* (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"
  timeout "$limit" python3 -m pytest -q "$@" >"$OUT/gpu-tests-$name.log" 2>&1
  echo "=== rc=$? in $(( $(date +%s) - start ))s: $(tail -1 "$OUT/gpu-tests-$name.log")" | tee -a "$LOG"
}
suite() {  # suite SECONDS ARGS...
  local limit=$1; shift
  local start=$(date +%s)
  echo "=== $* (limit ${limit}s) $(date -u +%T)" | tee -a "$LOG"
  timeout "$limit" python3 -m bench "$@" --out "$R" >>"$LOG" 2>&1
  echo "=== rc=$? in $(( $(date +%s) - start ))s" | tee -a "$LOG"
  tar czf "$OUT/res.tgz" -C /tmp/bench_res res  # after every suite: a call cut short still returns what ran
}
tokenizer_check() {  # the suites with a tokenizer fail at once without it (rc 2, a message saying how to make it)
  if [ -f bench/.tokenizer/tokenizer.json ]; then
    echo "=== tokenizer: $(cat bench/.tokenizer/bench_tokenizer.json 2>/dev/null | tr -d '\n' | cut -c1-300)" | tee -a "$LOG"
  else
    echo "=== NO bench/.tokenizer: run 'python -m bench tokenizer' on the CPU machine and carry bench/.tokenizer" | tee -a "$LOG"
  fi
}
server_wheels() {  # the server's packages the image lacks (fastapi, uvicorn, ...), from the carried .whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "carry .whl with the server's wheels (see the header)" | tee -a "$LOG"; exit 1; }
  export PYTHONPATH=.:/tmp/site
}
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem --format=csv | tee -a "$LOG"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$LOG"
python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>&1 | tail -1 | tee -a "$LOG"
case "${1:-smoke}" in
  smoke)
    tokenizer_check  # e2e and serving run with bench/.tokenizer (issue 38)
    suite 60 floor --model gemma-3-1b
    suite 170 decode --model gemma-3-1b --batches 1,8 --contexts 512 --peers all
    suite 200 prefill --model gemma-3-1b --tokens 64,256
    suite 100 serving --model gemma-3-1b --requests 16
    suite 150 capture --model gemma-3-1b
    ;;
  full)
    suite 30 floor --model llama-3.2-3b
    suite 270 decode --model llama-3.2-3b --time-budget 250
    suite 300 prefill --model llama-3.2-3b
    suite 75 decode --model qwen3-4b --batches 1,64 --contexts 512 --peers none
    suite 60 decode --model gemma-3-1b --batches 1,64 --contexts 512 --peers none
    ;;
  e2e)  # what a user sees through LLM.generate; each run ~3-4 min on an H100 (cold compile cache)
    tokenizer_check  # e2e and serving run with bench/.tokenizer (issue 38)
    suite 280 e2e --model llama-3.2-3b --time-budget 200
    suite 280 e2e --model qwen3-4b --time-budget 200
    ;;
  e2e-tokenizer)  # issue 38, what users run: the engine holds the Gemma 3 tokenizer, plain / tokenizer / + 2 stop
    # strings at batch 1/16/64, and the host time per step with a null forward. Needs bench/.tokenizer (written on
    # the CPU by `python -m bench tokenizer`, ~32 MiB: carry it); ~2 min a model for e2e, ~1 min for host
    tokenizer_check
    suite 120 host --model gemma-3-1b
    suite 200 e2e --model gemma-3-1b --peers none
    suite 230 e2e --model llama-3.2-3b --peers none
    ;;
  itl)  # issue 38's ITL goal alone (e2e-tokenizer without its host rows), then issue 42's capture split; ~9.5 min
    tokenizer_check
    suite 200 e2e --model gemma-3-1b --peers none
    suite 230 e2e --model llama-3.2-3b --peers none
    timeout 140 python3 -m bench.capture_split > "$OUT/capture-split.txt" 2>&1
    echo "=== capture_split rc=$?: $(tail -c 600 "$OUT/capture-split.txt")" | tee -a "$LOG"
    ;;
  serving-tokenizer)  # issue 38: the server holds the tokenizer, half the requests carry 2 stop strings; the
    # in-process row of each configuration is the reference (goal: HTTP within 5%); needs bench/.tokenizer
    tokenizer_check
    server_wheels
    suite 280 serving --model gemma-3-1b --requests 64 --configs decode,prefill
    suite 280 serving --model llama-3.2-3b --requests 64 --configs decode,prefill
    ;;
  peers)  # the decode suite again with transformers eager measured through generate(); then gemma's e2e
    tokenizer_check  # e2e and serving run with bench/.tokenizer (issue 38)
    suite 330 decode --model llama-3.2-3b --time-budget 290
    suite 250 e2e --model gemma-3-1b --time-budget 180
    ;;
  kernels)  # kernels per decode layer by kind (census), ~1.5-2 min a model (compile + captures)
    suite 180 kernels --model llama-3.2-3b
    suite 180 kernels --model qwen3-4b
    suite 150 kernels --model gemma-3-1b
    ;;
  gemm)  # every decode matmul shape: cuBLAS variants vs the Triton GEMV sweep, ~2-3 min a model
    suite 240 gemm --model llama-3.2-3b  # the first model also compiles the Triton configs
    suite 170 gemm --model qwen3-4b
    suite 170 gemm --model gemma-3-1b
    ;;
  tp-tiles)  # issue 41 on ONE GPU: a tensor-parallel rank's decode matmuls have no GEMV / skinny entries (its shapes are
    # the split ones), so they run cuBLAS without the GEMV + rotary and gated-GEMV fusions. Sweep one rank's batch-1
    # decode graph (MODEL, default qwen3-4b; TP, default 2), then time its 8- and 32-row shapes; ~9.5 min
    suite 430 gemv_graph --model "${MODEL:-qwen3-4b}" --tp-size "${TP:-2}" --time-budget 330
    suite 130 gemm --model "${MODEL:-qwen3-4b}" --tp-size "${TP:-2}" --batches 8,32
    ;;
  verify-tiles)  # issue 40 on one GPU: the 2-8-row table's choices (skinny tiles, cuBLASLt, cuBLAS) re-picked by what
    # they cost the whole 5-row decode graph (a verify step of 1 + 4 tokens runs that bucket; the entries were
    # timed alone), then the verify step itself at batch 1; ~9 min
    suite 400 gemv_graph --model llama-3.2-3b --batches 5 --time-budget 300
    BENCH_SPEC_PROFILE=$OUT/prof suite 120 spec --model llama-3.2-3b --batches 1 --ks 4 --variants rejected
    ;;
  skinny-prefetch)  # A/B of the skinny GEMM's L2 prefetch before the PDL wait (INFER_GRAPHS_SKINNY_PREFETCH, off by
    # default): its GPU tests, then the verify step at batch 1 (k = 4, every step rejected) off / 4 tiles / off / 4
    # tiles, and decode at batch 8 / 32 off / 4 tiles, each in its own results folder; ~8.5 min
    gpu_tests skinny 120 tests/test_triton_skinny.py
    base=$R
    for run in 0-a 4-a 0-b 4-b; do
      R=$base/prefetch$run; mkdir -p "$R"
      INFER_GRAPHS_SKINNY_PREFETCH=${run%-*} suite 100 spec --model llama-3.2-3b --batches 1 --ks 4 --variants rejected
    done
    for tiles in 0 4; do
      R=$base/prefetch$tiles-decode; mkdir -p "$R"
      INFER_GRAPHS_SKINNY_PREFETCH=$tiles suite 70 decode --model llama-3.2-3b --batches 8,32 --contexts 512 --peers none
    done
    R=$base
    ;;
  fp8-goals)  # issue 45's unmeasured goals on one GPU: qwen3-4b's FP8 GEMV tiles in its batch-1 graph (only llama's are
    # tuned), then decode at batch 1 / 16 / 64 and the 512-token prefill, FP8 next to bf16, for both models; ~9.5 min
    suite 230 gemv_graph --model qwen3-4b --quantization fp8 --time-budget 150
    suite 130 decode --model llama-3.2-3b --batches 1,16,64 --contexts 512 --peers none --quantization fp8
    suite 130 decode --model qwen3-4b --batches 1,16,64 --contexts 512 --peers none --quantization fp8
    suite 100 prefill --model llama-3.2-3b --tokens 512 --quantization fp8
    ;;
  fp8-skinny)  # issue 45: the FP8 skinny GEMM still runs the bf16 tables' tiles (FP8 batch 16 only 3% under bf16);
    # re-pick its bucket-16 tiles in the batch-16 decode graph, FP8 weights (BATCH= for another bucket); ~7.5 min
    suite 420 gemv_graph --model llama-3.2-3b --batches "${BATCH:-16}" --quantization fp8 --time-budget 320
    ;;
  knockout)  # what each kernel kind costs the batch-1 decode step: 6 engine start-ups a model, ~2.5-3 min
    suite 280 knockout --model llama-3.2-3b
    suite 280 knockout --model gemma-3-1b
    ;;
  tests-decode)  # the decode path's GPU tests, ~4 min on a fresh H100 (Triton compiles included)
    gpu_tests attention-decode 200 tests/test_triton_attention.py -k "decode or merge"
    gpu_tests fused-ops 150 tests/test_add_rms_norm.py tests/test_qk_norm_rope.py tests/test_decode_gemv_gpu.py \
      tests/test_triton_gemv.py
    gpu_tests engine 200 -m gpu tests/test_engine_gpu.py
    ;;
  compile-path)  # 2026-12-07's compile-path changes, none yet run on a GPU: FULL steps on the pieces only (no layered
    # / unsplit), a traced engine calling its graph without Dynamo, pieces without Inductor's asserts, the norm / rotary /
    # GEMV / skinny / KV-store kernels through the launch cache; then prefill's host_us_per_layer and compiled vs eager; ~9.5 min
    gpu_tests launches 150 tests/test_triton_launch.py tests/test_add_rms_norm.py tests/test_qk_norm_rope.py \
      tests/test_qkv_rope.py tests/test_triton_gemv.py tests/test_triton_skinny.py tests/test_decode_gemv_gpu.py
    gpu_tests engine 240 -m gpu tests/test_engine_gpu.py tests/test_engine_overlap.py tests/test_warm_start.py \
      -k "identical or full_mixed or async or warm_start"
    suite 170 prefill --model llama-3.2-3b --tokens 64,128,512
    ;;
  validate)  # one call when device time is scarce: compile-path's GPU tests, then spec-profile's timeline at batch 1; ~9.5 min
    gpu_tests launches 150 tests/test_triton_launch.py tests/test_add_rms_norm.py tests/test_qk_norm_rope.py \
      tests/test_qkv_rope.py tests/test_triton_gemv.py tests/test_triton_skinny.py tests/test_decode_gemv_gpu.py
    gpu_tests engine 240 -m gpu tests/test_engine_gpu.py tests/test_engine_overlap.py tests/test_warm_start.py \
      -k "identical or full_mixed or async or warm_start"
    BENCH_SPEC_PROFILE=$OUT/prof suite 150 spec --model llama-3.2-3b --batches 1 --ks 4 --variants rejected
    ;;
  measure)  # validate's other half: prefill's host per layer (compiled vs eager), speculative decoding's and the
    # memory GPU tests; ~6.5 min
    suite 170 prefill --model llama-3.2-3b --tokens 64,128,512
    gpu_tests spec 200 -m gpu tests/test_spec_decode_gpu.py tests/test_memory_gpu.py
    ;;
  spec-check)  # issue 40 after the batch-1 verify graph of 1 + k rows: bench spec at batch 1 (k = 1, 4; every step a
    # verify step, with its timeline), then speculative decoding's GPU tests on llama; ~6.5 min
    BENCH_SPEC_PROFILE=$OUT/prof suite 120 spec --model llama-3.2-3b --batches 1 --ks 1,4 --variants rejected,ngram
    gpu_tests spec 200 -m gpu tests/test_spec_decode_gpu.py -k "one_request or prompt_lookup or llama"
    ;;
  host-chains)  # issues 39 / 40: where the host time of a verify step and of a prefill step goes on the GPU host:
    # the verify step's timeline and an unprofiled replay timing of every decode / verify graph
    # ($OUT/prof/graph-launch-*.txt), a prefill step per engine row under the profiler, then the GPU tests of
    # 2026-12-08's staging change and rotary + K/V store fusion, and the ones still owed; ~9.5 min
    BENCH_SPEC_PROFILE=$OUT/prof suite 120 spec --model llama-3.2-3b --batches 1 --ks 4 --variants rejected
    BENCH_PREFILL_PROFILE=$OUT/prof suite 200 prefill --model llama-3.2-3b --tokens 128,512
    gpu_tests fused 150 tests/test_qk_norm_rope.py tests/test_attention_rotary.py tests/test_step_upload.py tests/test_argmax_keys.py \
      tests/test_triton_skinny.py
    gpu_tests rest 200 -m gpu tests/test_memory_gpu.py tests/test_spec_decode_gpu.py
    ;;
  spec-profile)  # issue 40: the verify step's exposed host work at batch 1 (none and every-step-rejected k = 4 under
    # torch.profiler, $OUT/prof/spec-*.txt and the traces), then speculative decoding's and the memory GPU tests; ~5 min
    BENCH_SPEC_PROFILE=$OUT/prof suite 200 spec --model llama-3.2-3b --batches 1,8 --ks 4 --variants rejected
    gpu_tests spec 200 -m gpu tests/test_spec_decode_gpu.py tests/test_memory_gpu.py
    ;;
  tests-tp)  # 2 GPUs (nvidia-h100-x2 / h200-x2): tensor parallelism with both graph kinds, three TP engines in
    # one process (each close must leave the NCCL group), and the graph release after close; ~2 min. The
    # fifty-engine memory test needs one GPU only (tests-overlap's machine), not two at twice the cost.
    gpu_tests tp 300 -m gpu tests/test_tp_gpu.py tests/test_engine_lifecycle_gpu.py -k "not fifty"
    ;;
  tests-overlap)  # the overlapped loop, the sampler and the argmax on the GPU, then engine parity and the
    # fifty-engine memory test; ~6 min
    gpu_tests overlap 200 -m gpu tests/test_engine_overlap.py tests/test_staging.py tests/test_triton_argmax.py
    gpu_tests engine 230 -m gpu tests/test_engine_gpu.py tests/test_sampling_controls.py
    gpu_tests lifecycle 150 -m gpu tests/test_engine_lifecycle_gpu.py -k fifty
    ;;
  tests-attention-rest)  # the prefill and dense attention tests: one compile per random shape, the slow part
    gpu_tests attention-rest 560 tests/test_triton_attention.py -k "not decode and not merge"
    ;;
  frontend)  # issue 38: host time per step with the front end in its process vs inline (null forward,
    # batch 64, tokenizer + stop strings), the GPU test of the process on a GPU engine, then
    # speculative decoding's GPU tests; ~5.5 min
    tokenizer_check
    suite 100 host --model gemma-3-1b --frontends process,inline --variants stop
    gpu_tests frontend 70 -o faulthandler_timeout=60 -m gpu tests/test_text_process.py tests/test_tokenizer_load.py
    suite 80 host --model llama-3.2-3b --frontends process,inline --variants stop
    gpu_tests spec 100 -o faulthandler_timeout=90 -m gpu tests/test_spec_decode_gpu.py
    ;;
  warm-profile)  # issue 42: llama-3.2-3b's cold and warm start-up in fresh processes, each under cProfile
    # ($OUT/prof/startup-{cold,warm}.txt: top functions by cumulative time); ~2.5 min
    BENCH_CAPTURE_PROFILE=$OUT/prof suite 300 capture --model llama-3.2-3b
    ;;
  host-profile)  # issue 38: the host step at batch 64 (null forward; plain, and tokenizer + 2 stop strings in the front end's
    # process) and one more generate of each under cProfile ($OUT/prof/host-*.txt: the step thread's functions by own time); ~3.5 min
    tokenizer_check
    BENCH_HOST_PROFILE=$OUT/prof suite 140 host --model gemma-3-1b --frontends process --variants plain,stop
    BENCH_HOST_PROFILE=$OUT/prof suite 120 host --model llama-3.2-3b --frontends process --variants plain,stop
    ;;
  host-check)  # after a change to the host loop: host-profile and warm-profile, then the engine's GPU parity
    # tests (greedy identical with graphs off, decode graphs, prefill graphs, FULL mixed; the gemma window
    # against transformers); their profiles in one file ($OUT/prof.tgz: a call brings back 8 files at most); ~10 min
    # PARTS (default "tests host capture"; "host-gemma": gemma's stop row alone; "misc": the memory-share and FP8
    # real-weights GPU tests, a capture's time split) and TESTS_K pick what a short budget allows
    tokenizer_check
    parts=" ${PARTS:-tests host capture} "
    if [[ $parts == *" host "* ]]; then
      BENCH_HOST_PROFILE=$OUT/prof suite 130 host --model gemma-3-1b --frontends process --variants plain,stop
      BENCH_HOST_PROFILE=$OUT/prof suite 110 host --model llama-3.2-3b --frontends process --variants plain,stop
    fi
    [[ $parts == *" host-gemma "* ]] && BENCH_HOST_PROFILE=$OUT/prof suite 130 host --model gemma-3-1b --frontends process --variants stop
    [[ $parts == *" capture "* ]] && BENCH_CAPTURE_PROFILE=$OUT/prof suite 180 capture --model llama-3.2-3b
    if [[ $parts == *" misc "* ]]; then  # gpu_memory_utilization, FP8 on real weights; where a capture's time goes
      gpu_tests misc 200 -m gpu tests/test_memory_gpu.py tests/test_fp8_gpu.py -k "caps_the_device or real_default"
      timeout 150 python3 -m bench.capture_split \
        > "$OUT/capture-split.txt" 2>&1
    fi
    # the tests last: a pytest cut by its limit is the suspect for the slowed host of the suite after it
    # (llama's rows in bench/results/h100-2026-12-07/host-check/); the first test's cold compiles take ~75 s
    [[ $parts == *" tests "* ]] && gpu_tests engine 300 -m gpu tests/test_engine_gpu.py -k "${TESTS_K:-identical or full_mixed or window}"
    rm -f "$OUT"/prof/*.prof; [ -d "$OUT/prof" ] && tar czf "$OUT/prof.tgz" -C "$OUT" prof && rm -rf "$OUT/prof"
    ;;
  serving-batch)  # issue 38: the server's ITL at batch 1 / 16 / 64 next to LLM.generate's, tokenizer + stop strings
    # (SERVERS: process, the default, serve's; thread: serve --no-engine-process, whose rows are "/engine_thread")
    tokenizer_check
    server_wheels
    # (MODEL: gemma-3-1b, the default, or llama-3.2-3b; the in-process rows carry the decode graph's replay)
    suite "${SERVING_S:-560}" serving --model "${MODEL:-gemma-3-1b}" --configs prefill --workloads batch_1,batch_16,batch_64 --servers "${SERVERS:-process}"
    ;;
  soak-start)
    server_wheels
    rm -rf /tmp/soakrepo /tmp/soak; mkdir -p /tmp/soak; cp -a . /tmp/soakrepo  # a later call's copy may replace this tree
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > /tmp/soak/gpu.txt
    (cd /tmp/soakrepo && PYTHONPATH=/tmp/soakrepo:/tmp/site setsid nohup python3 -m bench soak --model "${SOAK_MODEL:-llama-3.2-3b}" \
      --duration "${SOAK_S:-600}" --out /tmp/soak/soak.json > /tmp/soak/log.txt 2>&1 < /dev/null &)
    setsid nohup nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 15 > /tmp/soak/smi.csv 2>&1 < /dev/null &
    start=$(date +%s)
    while [ $(( $(date +%s) - start )) -lt "${WATCH_S:-580}" ] && sleep 10; do pgrep -f "bench soak" > /dev/null || break; done
    cp /tmp/soak/log.txt /tmp/soak/gpu.txt "$OUT"/; tail -20 /tmp/soak/log.txt
    exit 0
    ;;
  soak-finish)
    start=$(date +%s)
    while pgrep -f "bench soak" > /dev/null && [ $(( $(date +%s) - start )) -lt "${WATCH_S:-580}" ]; do sleep 5; done
    pkill -f "nvidia-smi --query-gpu"
    cp /tmp/soak/* "$OUT"/ 2>/dev/null
    server_log=$(ls -t /tmp/bench-soak-*.log 2>/dev/null | head -1)
    [ -n "$server_log" ] && tail -c 2000000 "$server_log" > "$OUT/server-log.txt"
    tail -60 /tmp/soak/log.txt
    # THEN (host-check's PARTS, e.g. "host tests"): on the same warm machine once the soak is over, if at
    # least THEN_MIN_S (default 280) of the call's 600 s remain: one machine start instead of two
    left=$(( 590 - ($(date +%s) - start) ))
    if [ -n "${THEN:-}" ] && ! pgrep -f "bench soak" > /dev/null && [ "$left" -ge "${THEN_MIN_S:-280}" ]; then
      echo "=== soak over; host-check PARTS=\"$THEN\" with ${left}s left" | tee -a "$LOG"
      PARTS="$THEN" timeout "$left" bash "$0" host-check
    fi
    exit 0
    ;;
  rest)
    tokenizer_check  # e2e and serving run with bench/.tokenizer (issue 38)
    bash bench/notebooks/run_gpu.sh 140 >>"$LOG" 2>&1
    suite 170 capture --model llama-3.2-3b
    suite 170 serving --model llama-3.2-3b --requests 64
    ;;
esac
tar czf "$OUT/res.tgz" -C /tmp/bench_res res
ls -la "$R" | tail -40
grep -h "^| \(full_graph\|piecewise\|hf_\|ours_\|[0-9]\)" "$R"/*.md 2>/dev/null | head -80
