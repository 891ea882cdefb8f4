#!/usr/bin/env bash
# One-shot GPU check: the GPU-marked tests, then the quick GPU benchmark, in under 8 minutes on one H200.
#
#   scripts/gpu_check.sh                          # outputs in gpu-check-out/<time>/ (or in $OUT when set)
#   PYTHON=/opt/torch/.venv/bin/python3 scripts/gpu_check.sh
#
# Which python: $PYTHON if set, else this checkout's .venv/bin/python if it exists and sees a CUDA device,
# else python3. Nothing is installed or downloaded (a lent GPU machine reaches no package index): that
# python must already have torch with CUDA, torchvision, scikit-learn, tqdm, matplotlib and pytest, as a
# GPU machine's PyTorch image does. The checkout goes on PYTHONPATH instead of `pip install -e .`.
#
# Time: the tests get at most TESTS_S (150 s), the benchmark what is left of BUDGET_S (480 s) minus a
# margin. The benchmark rewrites bench.json/bench.md after every entry, so a time-out keeps what it
# finished. Outputs (six files, so they also fit the device tool's limit of eight):
#   gpu-check.log      this script's whole console: environment, nvidia-smi, test and benchmark output
#   pytest-gpu.log     the GPU-marked tests
#   bench/bench.json   bench/bench.md   bench/bench.png     the benchmark (python -m manual_train.bench)
#   bench-logs.tar.gz  what each benchmark measurement process printed (bench/logs/, packed)
# Exit status: 0 when the tests passed (or none applied) and every benchmark entry ran; 1 otherwise;
# 2 when no CUDA device is visible.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
BUDGET_S=${BUDGET_S:-480}
TESTS_S=${TESTS_S:-150}
OUT_DIR=${OUT:-gpu-check-out/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
exec > >(tee -a "$OUT_DIR/gpu-check.log") 2>&1
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    PY=.venv/bin/python
else
    PY=python3
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

echo "== gpu_check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), checkout $(git rev-parse --short HEAD 2>/dev/null || echo '?'), outputs in $OUT_DIR"
if ! "$PY" - <<'EOF'
import sys
try:
    import torch
except ImportError:
    print(f"error: {sys.executable} cannot import torch; set PYTHON to a python that has it", file=sys.stderr)
    sys.exit(2)
print(f"python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    print("error: no CUDA device is visible to this python (torch.cuda.is_available() is False); "
          "gpu_check needs one", file=sys.stderr)
    sys.exit(2)
p = torch.cuda.get_device_properties(0)
print(f"device 0 of {torch.cuda.device_count()}: {p.name}, capability {p.major}.{p.minor}, "
      f"{p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
EOF
then
    exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv
"$PY" - <<'EOF'
missing = []
for name in ("torchvision", "sklearn", "tqdm", "matplotlib", "pytest", "pytest_timeout", "fairscale",
             "pytorch_lightning"):
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
print("not importable here (tests and entries that need them are skipped or fail):", ", ".join(missing) or "none")
EOF

echo "== [$(elapsed) s] GPU-marked tests (at most $TESTS_S s)"
# --continue-on-collection-errors: a test module that cannot import an optional package (fairscale, say)
# must not stop the GPU tests of the other modules from running.
PER_TEST=$("$PY" -c 'import pytest_timeout' 2>/dev/null && echo --timeout=120)
timeout -k 10 "$TESTS_S" "$PY" -m pytest -m gpu -q -rA -p no:cacheprovider --continue-on-collection-errors \
    $PER_TEST tests 2>&1 | tee "$OUT_DIR/pytest-gpu.log"
TESTS_RC=${PIPESTATUS[0]}
case $TESTS_RC in
    0) echo "tests: passed" ;;
    5) echo "tests: none selected (no GPU-marked tests apply)"; TESTS_RC=0 ;;
    124|137) echo "tests: stopped after $TESTS_S s (time limit)" ;;
    *) echo "tests: FAILED (pytest exit $TESTS_RC)" ;;
esac

BENCH_S=$(( BUDGET_S - $(elapsed) - 20 ))
echo "== [$(elapsed) s] python -m manual_train.bench --suite gpu --quick (at most $BENCH_S s)"
timeout -k 10 "$BENCH_S" "$PY" -m manual_train.bench --suite gpu --quick --out "$OUT_DIR/bench"
BENCH_RC=$?
[ "$BENCH_RC" -eq 124 ] || [ "$BENCH_RC" -eq 137 ] && echo "bench: stopped after $BENCH_S s; finished entries are in bench/bench.md"
[ -f "$OUT_DIR/bench/bench.md" ] && [ "$BENCH_RC" -ne 0 ] && cat "$OUT_DIR/bench/bench.md"
if [ -d "$OUT_DIR/bench/logs" ]; then
    tar -czf "$OUT_DIR/bench-logs.tar.gz" -C "$OUT_DIR/bench" logs && rm -rf "$OUT_DIR/bench/logs"
fi

echo "== [$(elapsed) s] done: tests exit $TESTS_RC, bench exit $BENCH_RC; outputs in $OUT_DIR"
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
