#!/usr/bin/env bash
# The prepared GPU check (issue 39.4): the first command a session with a GPU runs, in under 9 minutes on one
# H100 or H200. See benchmarks/gpu/README.md.
#
#   bash benchmarks/gpu/wheels.sh         # here, once: the wheels the GPU machine lacks, into .whl/
#   bash benchmarks/gpu/check.sh          # there (device tool: carry [".whl"], timeout_s 560)
#   DRY=1 bash benchmarks/gpu/check.sh    # a dry run on a CPU: tiny shapes, two test files
#
# Steps, each under its own time limit so that one failing or running long leaves the others' results:
#   A. the test suite on the GPU (pytest -n 16, cohort from source)      TESTS_S  (default 240 s)
#   B. the decode benchmark (benchmarks/gpu/decode.py)                   DECODE_S (default 100 s)
#   C. cohort vs TRL on a GRPO step (benchmarks/gpu/grpo_vs_trl.py)     GRPO_S   (default 230 s)
# run in the order A, C, B (ORDER: decode last, its last engine the first thing cut)
# and no step starts past TOTAL_S (default 525 s) from the start. Writes six files under $OUT (./gpu-check-out when
# unset; the device tool brings back at most 8): gpu-check.json (everything), gpu-check.md (the tables, printed at
# the end), setup.log, pytest.log, decode.log, grpo.log. The parts they are made from stay in $PARTS.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-check-out}
PARTS=${PARTS:-/tmp/gpu-check/parts}
mkdir -p "$OUT"
rm -rf "$PARTS" && mkdir -p "$PARTS"
START=$SECONDS
DRY=${DRY:-0}
TOTAL_S=${TOTAL_S:-525}
# From the parts' times on an H200 (benchmarks/gpu/README.md, "Time budget"): the suite took 241 s; decode at the
# 0.5b shape in bf16 (captured, HF static, eager) about 90 s; the four GRPO processes about 215 s without --profile.
# Together they fill the 525 s only when the suite ends early: the decode step runs last and its last engine (cohort
# eager, whose ~33 ms a step is known) is the first thing cut.
TESTS_S=${TESTS_S:-240}
GRPO_S=${GRPO_S:-230}
DECODE_S=${DECODE_S:-100}
RESERVE_S=15  # the report and the interrupted step's wind-down (timeout -k) after the last limit
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export TRANSFORMERS_VERBOSITY=error

# The machine's torch differs from the one cohort pins, so cohort runs from source; the wheels carried in .whl/
# (TRL, datasets and what they need, pyzmq) go to /tmp/site, ahead of the machine's own packages.
if [[ "$DRY" != 1 ]] && compgen -G ".whl/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >>"$OUT/setup.log" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "installing .whl/ failed: see setup.log" | tee -a "$OUT/setup.log"
  fi
fi
export PYTHONPATH=$ROOT/src:$ROOT/tests:$ROOT${PYTHONPATH:+:$PYTHONPATH}

if [[ "$DRY" == 1 ]]; then
  DEVICE=cpu
  BENCH_FLAGS=(--device cpu --tiny)
  PYTEST_ARGS=(-n 2 tests/runtime/test_seeds.py tests/test_errors.py)
else
  DEVICE=cuda
  BENCH_FLAGS=(--device cuda)
  PYTEST_ARGS=(-n 16 --timeout 300 tests)  # the demo test ran past 120 s on an H200 shared by 16 workers
fi

# The card, the versions, and whether what the tests and TRL import is there.
python3 - "$PARTS/env.json" "$DEVICE" <<'EOF' 2>>"$OUT/setup.log"
import importlib, json, platform, subprocess, sys
out, device = sys.argv[1], sys.argv[2]
env = {"python": platform.python_version()}
try:
    env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
except OSError:
    env["commit"] = "?"
import torch, transformers
env.update(torch=torch.__version__, transformers=transformers.__version__, cuda=torch.version.cuda)
env["device"] = torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else "cpu"
imports = {}
for name in ("trl", "datasets", "zmq", "peft", "accelerate", "pyarrow", "fsspec", "huggingface_hub", "pytest_timeout", "xdist", "cohort"):
    try:
        mod = importlib.import_module(name)
        imports[name] = "ok"
        env[f"{name}_version"] = getattr(mod, "__version__", "?")
    except Exception as e:  # a missing wheel shows here, before the steps that need it
        imports[name] = f"{type(e).__name__}: {e}"[:300]
env["trl"] = env.get("trl_version", "missing")
env["imports"] = imports
json.dump(env, open(out, "w"), indent=1)
print(json.dumps(env))
EOF
nvidia-smi >>"$OUT/setup.log" 2>&1 || true

STEPS="{}"
record() {  # record NAME STATUS SECONDS: adds a step's outcome to steps.json
  STEPS=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d[sys.argv[2]]={"status":sys.argv[3],"seconds":int(sys.argv[4])}; print(json.dumps(d))' "$STEPS" "$1" "$2" "$3")
  echo "$STEPS" >"$PARTS/steps.json"
}

run_step() {  # run_step NAME LIMIT_S COMMAND...: runs COMMAND under the step's limit, cut to the time left
  local name=$1 limit=$2 left t0 rc
  shift 2
  left=$((TOTAL_S - (SECONDS - START) - RESERVE_S))
  ((limit > left)) && limit=$left
  if ((limit < 20)); then
    echo "== $name: skipped (the check's time is spent)"
    record "$name" skipped 0
    return
  fi
  echo "== $name (up to ${limit} s)"
  t0=$SECONDS
  # SIGINT first: pytest then ends its session and the benchmarks keep what they measured; SIGKILL 10 s later.
  LIMIT=$limit timeout -s INT -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124 | 137) status=timeout ;;
    *) status="exit $rc" ;;
  esac
  record "$name" "$status" $((SECONDS - t0))
  echo "   $status after $((SECONDS - t0)) s; last lines of $name.log:"
  tail -n 4 "$OUT/$name.log" | cut -c1-300 | sed 's/^/   /'
}

# A. The test suite (each outcome logged as it comes by benchmarks/gpu/pytest_record.py: kept if cut short).
# PYTEST_FIRST: test paths collected (and so started) first, e.g. the ones a previous run saw fail. By default the
# files that took longest on an H200 (2026-11-28, 16 workers: 50-120 s each), so that the suite's tail is not one
# of them started last.
export GPU_CHECK_TESTLOG=$PARTS/tests.jsonl
SLOWEST="tests/commands/test_demo.py tests/commands/test_pipeline.py tests/serve/test_serve_episodes.py
  tests/test_ablation_script.py tests/serve/test_serve_async.py tests/episodes/test_tool_task_example.py
  tests/runtime/test_distributed.py tests/runtime/test_collectives.py tests/test_cli_e2e.py
  tests/commands/test_doctor.py"
[[ "$DRY" == 1 ]] && SLOWEST=""  # the dry run's two small files only
FIRST=()
for path in ${PYTEST_FIRST-$SLOWEST}; do  # a path that is not there would stop the whole suite before its first test
  if [[ -e "${path%%::*}" ]]; then FIRST+=("$path"); else echo "PYTEST_FIRST: no $path here; left out" >&2; fi
done
step_pytest() {
  run_step pytest "$TESTS_S" \
    python3 -m pytest -q -p no:cacheprovider -p benchmarks.gpu.pytest_record "${FIRST[@]}" "${PYTEST_ARGS[@]}"
}

# C. cohort vs TRL on a GRPO step, both precisions, each framework in its own process.
step_grpo() {
  run_step grpo "$GRPO_S" bash -c \
    'exec python3 benchmarks/gpu/grpo_vs_trl.py "$@" --budget-s $((LIMIT - 10)) --out "'"$PARTS"'/grpo.json"' _ \
    "${BENCH_FLAGS[@]}" --workdir /tmp/gpu-check/grpo ${GRPO_FLAGS:-}
}

# B. Decode: ms per decode step, cohort's captured step vs transformers' compiled static-cache generate vs cohort eager,
# in bf16 (what the issue compares; DECODE_FLAGS, given after these, adds precisions, engines or shapes).
DECODE_DEFAULTS=(--precisions bf16 --engines captured,hf-static,eager)
step_decode() {
  run_step decode "$DECODE_S" bash -c \
    'exec python3 benchmarks/gpu/decode.py "$@" --budget-s $((LIMIT - 25)) --out "'"$PARTS"'/decode.json"' _ \
    "${BENCH_FLAGS[@]}" "${DECODE_DEFAULTS[@]}" ${DECODE_FLAGS:-}
}

# ORDER: the steps to run, in order (default all three: the suite, then the comparison with TRL, then decode).
for step in ${ORDER:-pytest grpo decode}; do
  case $step in
    pytest | decode | grpo) "step_$step" ;;
    *) echo "ORDER names an unknown step '$step' (pytest, decode, grpo)" >&2 ;;
  esac
done

python3 benchmarks/gpu/report.py "$PARTS" "$OUT"
echo "total $((SECONDS - START)) s; results in $OUT/gpu-check.json and $OUT/gpu-check.md"
