#!/usr/bin/env bash
# GPU check for the H200 (run through the device tool from the repo root):
#   [TESTS_LIMIT=seconds] [TESTS="tests --ignore=tests/test_x.py"] bash scripts/gpu_check.sh [tests|bench|all]
# Builds the extension, runs the whole test suite on CUDA (GPU tests included)
# and the benchmarks, and prints a short summary. Logs go to $OUT when set.
set -uo pipefail
stage=${1:-all}
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

# Compile caches (inductor's and Triton's) can travel between device calls, which otherwise spend most of their time
# compiling: GPU_CACHE names the directory of a previous call's compile_cache.tgz* files (copied into the carried
# tree), and with SAVE_COMPILE_CACHE=1 this call's caches come back in $out as compile_cache.tgz, split into 15 MB
# parts (they count against the device tool's 8 returned files, beside the logs). Every H200 call has the same
# torch, triton and GPU, so the caches hit.
cache=/tmp/specdec_compile_cache
mkdir -p "$cache"
if [[ -n ${GPU_CACHE:-} ]] && compgen -G "$GPU_CACHE/compile_cache.tgz*" >/dev/null; then
  cat "$GPU_CACHE"/compile_cache.tgz* | tar xzf - -C "$cache" && echo "compile cache: restored from $GPU_CACHE"
fi
export TORCHINDUCTOR_CACHE_DIR=$cache/inductor TRITON_CACHE_DIR=$cache/triton
save_cache() {
  tar czf - -C "$cache" . | split -b 15m -d - "$out/compile_cache.tgz." && echo "compile cache: saved to $out"
}
[[ ${SAVE_COMPILE_CACHE:-0} == 1 ]] && trap save_cache EXIT

python3 -c 'import torch, triton; print("torch", torch.__version__, "| triton", triton.__version__, "|", torch.cuda.get_device_name())'
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }

summary=()
if [[ $stage == tests || $stage == all ]]; then
  # -p no:cacheprovider: the tree may be read-only for caches; xdist spreads the CPU-heavy tests. -v logs each
  # result with its name as it comes; TESTS_LIMIT (seconds, 0: none) stops pytest early enough for the lines below
  # to name the failures so far when the device call's own limit is near. TESTS (default: tests) names the paths
  # and options pytest gets: the whole suite takes longer on the GPU machine than one device call may run.
  # shellcheck disable=SC2086  # TESTS is split into pytest's arguments on purpose
  timeout "${TESTS_LIMIT:-0}" python3 -m pytest -v -p no:cacheprovider -n 8 --tb=line -rfE ${TESTS:-tests} \
      >"$out/tests.log" 2>&1
  rc=$?
  grep -E "^\[gw[0-9]+\] .* (FAILED|ERROR) " "$out/tests.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | head -40
  tail -5 "$out/tests.log"
  summary+=("tests (${TESTS:-tests}, CUDA included): rc=$rc, $(tail -1 "$out/tests.log")")
fi
if [[ $stage == bench || $stage == all ]]; then
  # Every benchmark this tree has (bench_model.py and bench_generate.py come with the models and generator work).
  for bench in scripts/bench_ops.py scripts/bench_vocab.py scripts/bench_propose.py scripts/bench_model.py \
      scripts/bench_prefill.py scripts/bench_generate.py; do
    [[ -f $bench ]] || continue
    name=$(basename "$bench" .py)
    limit=300
    [[ $name == bench_vocab ]] && limit=600  # the samplers' and the verifiers' tables together
    timeout $limit python3 "$bench" ${BENCH_ARGS:-} >"$out/$name.md" 2>&1
    rc=$?
    cat "$out/$name.md"
    summary+=("$name: rc=$rc")
  done
fi
echo
echo "== summary =="
printf '%s\n' "${summary[@]}"
