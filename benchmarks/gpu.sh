#!/usr/bin/env bash
# The GPU recipe (docs/gpu.md): what to run on a GPU machine, one subcommand per step, each
# writing what it measured under $OUT. Run from the repository root.
#
#   bash benchmarks/gpu.sh carry                 # on a machine with internet, once: fill .carry
#                                                # (git-ignored) for a GPU machine without it
#   bash benchmarks/gpu.sh speed [--smoke]       # ≤ 6 min: the environment, then gpu_speed.py
#                                                # (the primary convolution) and the steps and
#                                                # peers (device_report.py --only)
#   bash benchmarks/gpu.sh report [FLAGS]        # benchmarks/device_report.py, every row
#   bash benchmarks/gpu.sh suite                 # the test suite (alone, never beside a leg)
#   bash benchmarks/gpu.sh leg NAME RUN_FLAGS…   # start a training leg (setsid: outlives the shell)
#   bash benchmarks/gpu.sh wait NAME [SECONDS]   # wait up to SECONDS (default 0) for it to end,
#                                                # then its log, results and metrics → $OUT/NAME
#   bash benchmarks/gpu.sh export NAME [FLAGS…]  # a finished leg's validation-selected model,
#                                                # float16, and its measured test error → $OUT/NAME
#   bash benchmarks/gpu.sh segment NAME          # a finished MultiMNIST leg's figure 5 and IoU, from
#                                                # its member of lowest validation error → $OUT/NAME
#
# $OUT: where the results go (default /tmp/capsjax_gpu_out); legs train under $CAPSJAX_LEGS.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.carry
LEGS=${CAPSJAX_LEGS:-/tmp/capsjax_legs}   # (another folder: the suite's rehearsal)
OUT=${OUT:-/tmp/capsjax_gpu_out}
mkdir -p "$OUT"
# Wheels the GPU image lacks (ml-collections; TFDS and its dependencies for the suite's
# data tests); its own jax, flax, optax, orbax, chex and torch are used as they are.
WHEELS=(ml-collections==1.1.0 tensorflow-datasets==4.9.10 array_record==0.8.6 dm-tree==0.1.10
        immutabledict==4.3.1 simple-parsing==0.1.9 docstring_parser==0.18.0 tensorflow-metadata==1.21.0
        googleapis-common-protos==1.76.0 termcolor==3.3.0 toml==0.10.2 importlib_resources==7.1.0)

# Whether every module named is installed: found, not imported (importing TFDS alone takes a second).
found() {
  python3 -c 'import importlib.util, sys
def found(name):
  try:
    return importlib.util.find_spec(name) is not None
  except ImportError:   # a parent package that cannot be imported
    return False
sys.exit(0 if all(map(found, sys.argv[1:])) else 1)' "$@"
}

environment() {
  export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
  if ! found ml_collections tensorflow_datasets; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$CARRY"/whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  # capsjax from the checkout, installed editable (offline, with the image's setuptools):
  # the repository's experiments/ is the package capsjax.experiments only through setup.cfg's
  # package_dir, so a plain PYTHONPATH=$PWD would not find the experiments.
  if ! found capsjax.experiments; then
    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
      || { echo "error: pip install -e . (offline) failed: capsjax.experiments is not importable" >&2; exit 2; }
  fi
  export CAPSJAX_MNIST_DIR=${CAPSJAX_MNIST_DIR:-$PWD/$CARRY/mnist}
}

# What the first seconds print: a wrong environment shows before anything long starts.
check_environment() {
  python3 - <<'PY'
import importlib.metadata, jax
versions = {p: importlib.metadata.version(p) for p in ('jax', 'jaxlib', 'flax', 'optax', 'ml-collections')}
import capsjax.experiments  # the checkout, installed
print(f'environment: {jax.devices()[0].device_kind} ({jax.default_backend()}), {versions}', flush=True)
PY
  [ -d "$CAPSJAX_MNIST_DIR" ] && echo "environment: MNIST at $CAPSJAX_MNIST_DIR" \
    || echo "environment: no MNIST at $CAPSJAX_MNIST_DIR (carry .carry)"
}

case "${1:-}" in
  speed)
    shift
    environment
    check_environment
    # The primary convolution alone (its own budget), then the whole steps in each
    # formulation, the 3-seed vmapped step and the peer's torch.compile rows (theirs).
    # In priority order (device_report.plan): the table's own variant (space_to_depth
    # bfloat16 unrolled on a GPU), the peer's torch.compile rows, then the rest.
    conv=(--budget_s 140)
    steps=(--budget_s 200 --only 'capsjax (patches|space_to_depth) (float32|bfloat16) unrolled|capsjax mnist_seeds|peer compile')
    if [ "${1:-}" = --smoke ]; then   # the CPU rehearsal (tests/test_gpu_readiness.py): the same
      conv=(--smoke)                  # commands, small; every cell of the report's smoke
      steps=(--smoke --budget_s 400)
    fi
    python3 benchmarks/gpu_speed.py --out "$OUT/speed" "${conv[@]}" 2>&1 | tee "$OUT/speed.log"
    python3 benchmarks/device_report.py --out "$OUT/speed_steps" "${steps[@]}" 2>&1 | tee -a "$OUT/speed.log"
    # The HLO texts and the autotuning results as one archive beside the five reports (a
    # machine one copies results back from by file count: eight files in all).
    extras=(hlo)
    [ -d "$OUT/speed/autotune" ] && extras+=(autotune)
    tar -C "$OUT/speed" -czf "$OUT/speed/extras.tar.gz" "${extras[@]}" && (cd "$OUT/speed" && rm -rf "${extras[@]}")
    ;;
  carry)
    mkdir -p "$CARRY/mnist" "$CARRY/whl"
    cp "${CAPSJAX_MNIST_DIR:-../shared/data/mnist}"/*-ubyte* "$CARRY/mnist/"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$CARRY/whl" "${WHEELS[@]}"
    python3 -m pip wheel -q --no-deps promise==2.3 -w "$CARRY/whl"   # TFDS needs it; an sdist only
    du -sh "$CARRY"
    ;;
  report)
    shift
    environment
    python3 benchmarks/device_report.py --out "$OUT/report" "$@" \
      2>&1 | tee "$OUT/report.log"
    ;;
  suite)
    environment
    # Not there: Chromium (the explorer's browser test) and TensorFlow (TFDS preparation).
    workers=()
    if python3 -c "import xdist" 2>/dev/null; then workers=(-n 8); fi
    set -o pipefail
    # -v into the log: each outcome is written with its test's name as it happens, so a
    # suite cut short by a time limit still says which tests failed; it prints only those.
    python3 -m pytest -v -rfE -p no:cacheprovider "${workers[@]}" --durations=15 \
      --ignore=tests/test_explorer_browser.py --ignore=tests/test_tfds.py tests > "$OUT/suite.log" 2>&1 \
      || status=$?
    grep -E '(FAILED|ERROR) |^=+ .*(passed|failed|error)' "$OUT/suite.log" | sort -u | tail -n 60 || true
    exit "${status:-0}"
    ;;
  leg)
    name=${2:?a leg name}
    shift 2
    environment
    mkdir -p "$LEGS"
    setsid nohup python3 run.py --workdir="$LEGS/$name" --config.data_dir="$CAPSJAX_MNIST_DIR" "$@" \
      > "$LEGS/$name.log" 2>&1 < /dev/null &
    echo "leg $name started (pid $!): $LEGS/$name.log"
    ;;
  wait)
    name=${2:?a leg name}
    [ -f "$LEGS/$name.log" ] || { echo "error: no leg $name on this machine (a leg lives on the machine that started it)" >&2; exit 2; }
    deadline=$(( $(date +%s) + ${3:-0} ))
    running() { pgrep -f -- "--workdir=$LEGS/$name" >/dev/null; }
    while running && [ "$(date +%s)" -lt "$deadline" ]; do
      sleep "${CAPSJAX_LEG_POLL_S:-20}"
      tail -n 1 "$LEGS/$name.log"
    done
    mkdir -p "$OUT/$name"
    tail -n 5 "$LEGS/$name.log"
    if running; then state=running; else state=stopped; fi
    for file in results.json metrics.jsonl table.md config.json; do
      [ -f "$LEGS/$name/$file" ] && cp "$LEGS/$name/$file" "$OUT/$name/"
    done
    cp "$LEGS/$name.log" "$OUT/$name/run.log"
    echo "leg $name: $state$([ -f "$LEGS/$name/results.json" ] && echo ', finished: results.json')"
    ;;
  export)
    name=${2:?a leg name}
    shift 2
    [ -d "$LEGS/$name" ] || { echo "error: no leg $name on this machine (a leg lives on the machine that started it)" >&2; exit 2; }
    environment
    mkdir -p "$OUT/$name"
    # params.npz, test_sample.npz, config.json (each < 16 MiB: they come back) and the log.
    python3 -m capsjax.app.export --workdir="$LEGS/$name" --out="$OUT/$name/shipped" --evaluate "$@" \
      2>&1 | tee "$OUT/$name/export.log"
    ;;
  segment)
    name=${2:?a leg name}
    [ -d "$LEGS/$name" ] || { echo "error: no leg $name on this machine (a leg lives on the machine that started it)" >&2; exit 2; }
    environment
    mkdir -p "$OUT/$name"
    # The member of lowest final validation error (results.json; none: the last member, or a single run).
    member=$(python3 -c 'import json, sys
errors = json.load(open(sys.argv[1])).get("validation_error")
print(min(range(len(errors)), key=errors.__getitem__) if isinstance(errors, list) and errors else "")' \
      "$LEGS/$name/results.json" 2>/dev/null || true)
    python3 -m capsjax.app.programs.segmentation --workdir="$LEGS/$name" ${member:+--member=$member} \
      2>&1 | tee "$OUT/$name/segmentation.log"
    for file in segmentation.json multimnist_reconstructions.png; do
      [ -f "$LEGS/$name/$file" ] && cp "$LEGS/$name/$file" "$OUT/$name/"
    done
    ;;
  *)
    sed -n '2,20p' "$0"
    exit 2
    ;;
esac
