#!/usr/bin/env bash
# One-shot GPU check for a CUDA machine: the GPU-marked tests, then the GPU benchmark's entries in order of
# what they prove, within BUDGET_S seconds (380 by default, sized for a short slot on one GPU and not yet timed on
# one); raise BUDGET_S and TESTS_S to give it more.
#
#   scripts/gpu_check.sh                              # outputs in $OUT when set, else gpu-check-out/<time>/
#   BUDGET_S=1200 TESTS_S=600 scripts/gpu_check.sh    # 20 minutes, up to 10 of them for the tests
#   BENCH_ONLY=syncs,precision scripts/gpu_check.sh   # fewer benchmark entries
#   PYTHON=/opt/torch/.venv/bin/python3 scripts/gpu_check.sh
#   scripts/gpu_check.sh --summarize pytest-gpu.log [PYTEST_EXIT]   # the test counts of a saved log, no GPU
#
# Which python: $PYTHON if set, else this checkout's .venv/bin/python if it exists and sees a CUDA device, else
# python3. Nothing is installed or downloaded (the GPU machine may reach no package index): that python must have
# torch with CUDA, torchvision, scikit-learn, tqdm, matplotlib, pytest and pytest-timeout installed (checked with
# torch 2.11 on Python 3.12 by reading, not by running). The checkout goes on PYTHONPATH instead of `pip install -e .`. fairscale and
# apex are optional: their tests skip, and the summary says so (install fairscale into that python to run its tests).
#
# Time: the tests get at most TESTS_S (170 s), the benchmark what is left of BUDGET_S (380 s) minus a margin,
# running the entries of BENCH_ONLY in that order; it rewrites bench.json/bench.md after every entry, so a time-out
# keeps what it finished. Outputs (six files):
#   gpu-check.log      this script's whole console: environment, nvidia-smi, test and benchmark output, summary
#   pytest-gpu.log     the GPU-marked tests (pytest -v: one line per test, skip reasons, failures)
#   bench/bench.json   bench/bench.md   bench/bench.png     the benchmark (python -m manual_train.bench)
#   bench-logs.tar.gz  what each benchmark measurement process printed (bench/logs/, packed)
# Exit status: 0 when GPU tests ran and none failed (skips are listed with their reasons) and every benchmark
# entry that ran finished; 1 otherwise (no GPU test selected, or every one skipped, fails too); 2 when no CUDA
# device is visible (checked first, before any test or benchmark).
set -uo pipefail

# summarize_tests LOG RC: one status line (how many GPU tests ran, passed, failed, skipped), then the skips grouped
# by reason and each failure; returns 0 when nothing failed. Reads pytest's -v lines and its -rfEs summary.
summarize_tests() {
    awk -v rc="$2" '
    function count(line, word) { return match(line, "[0-9]+ " word) ? substr(line, RSTART, RLENGTH) + 0 : 0 }
    function add_skip(reason, n) {
        if (!(reason in skipped)) order[++nreasons] = reason
        skipped[reason] += n
    }
    /^=+ .* in [0-9.]+s( \([0-9:]+\))? =+$/ { summary = $0 }
    /^SKIPPED \[[0-9]+\] / {
        n = substr($2, 2, length($2) - 2) + 0
        reason = $0
        sub(/^SKIPPED \[[0-9]+\] [^ ]+: /, "", reason)
        add_skip(reason, n)
        short_skips = 1
    }
    /^(FAILED|ERROR) / { problems[++nproblems] = ($1 == "FAILED" ? "failed: " : "error: ") substr($0, length($1) + 2) }
    /::[^ ]+ PASSED/ { vpassed++ }
    /::[^ ]+ FAILED/ { vfailed++ }
    /::[^ ]+ ERROR/ { verrors++ }
    /::[^ ]+ SKIPPED/ {
        vskipped++
        if (match($0, / SKIPPED \(.*\)/)) vreason[++nvreasons] = substr($0, RSTART + 10, RLENGTH - 11)
    }
    END {
        if (!short_skips) for (i = 1; i <= nvreasons; i++) add_skip(vreason[i], 1)
        status = 0
        if (rc == 124 || rc == 137) {
            printf "tests: STOPPED by the time limit after %d passed, %d failed, %d errors, %d skipped (no summary line)\n", vpassed, vfailed, verrors, vskipped
            status = 1
        } else if (summary == "") {
            printf "tests: FAILED (pytest exit %d, no summary line: see pytest-gpu.log)\n", rc
            status = 1
        } else {
            passed = count(summary, "passed"); failed = count(summary, "failed")
            errors = count(summary, "error"); skips = count(summary, "skipped")
            ran = passed + failed + errors
            if (ran + skips == 0) {  # a GPU machine with no GPU test to run has checked nothing: a failure
                printf "tests: NONE SELECTED: pytest -m gpu selected no GPU-marked test (pytest exit %d): nothing was checked\n", rc
                exit 1
            }
            status = (failed + errors > 0 || rc != 0 || ran == 0) ? 1 : 0
            word = failed + errors > 0 || rc != 0 ? "FAILED" : ran == 0 ? "NONE RAN" : "passed"
            detail = passed " passed" (failed ? ", " failed " failed" : "") (errors ? ", " errors " errors" : "")
            printf "tests: %s: of %d GPU tests %d ran (%s), %d skipped\n", word, ran + skips, ran, detail, skips
        }
        for (i = 1; i <= nreasons; i++) {  # largest group first, ties in order of appearance
            best = 0
            for (j = 1; j <= nreasons; j++)
                if (!(j in shown) && (best == 0 || skipped[order[j]] > skipped[order[best]])) best = j
            shown[best] = 1
            printf "  skipped %d: %s\n", skipped[order[best]], order[best]
        }
        for (i = 1; i <= nproblems; i++) print "  " problems[i]
        exit status
    }' "$1"
}

if [ "${1:-}" = "--summarize" ]; then
    summarize_tests "$2" "${3:-0}"
    exit $?
fi

cd "$(dirname "$0")/.."
REPO=$(pwd)
BUDGET_S=${BUDGET_S:-380}
TESTS_S=${TESTS_S:-170}
# What the benchmark runs, most telling first: host syncs of the real loop (seconds), MFU against the datasheet's
# and a warmed-up measured peak (compiles a GPT: about a minute), CUDA graphs (compiles a small GPT twice: about a
# minute, not yet timed on a GPU) and TF32 (seconds), then the precision, copy and cuDNN entries.
BENCH_ONLY=${BENCH_ONLY:-syncs,gpt_compile_mfu,cuda_graphs,tf32,precision,copies,cudnn_benchmark}
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
for name in ("torchvision", "sklearn", "tqdm", "matplotlib", "pytest", "pytest_timeout", "fairscale", "apex.amp"):
    try:
        __import__(name)
    except ImportError:
        missing.append(name)
print("not importable here (the tests and entries that need them skip or fail):", ", ".join(missing) or "none")
EOF

echo "== [$(elapsed) s] GPU-marked tests (at most $TESTS_S s)"
if "$PY" -c 'import pytest' 2>/dev/null; then
    # --continue-on-collection-errors: a test module that cannot import something must not stop the GPU tests
    # of the other modules (its collection error is counted as an error below).
    PER_TEST=$("$PY" -c 'import pytest_timeout' 2>/dev/null && echo --timeout=120)
    timeout -k 10 "$TESTS_S" "$PY" -m pytest -m gpu -v -rfEs --durations=15 -p no:cacheprovider \
        --continue-on-collection-errors \
        $PER_TEST tests 2>&1 | tee "$OUT_DIR/pytest-gpu.log"
    PYTEST_RC=${PIPESTATUS[0]}
    TEST_SUMMARY=$(summarize_tests "$OUT_DIR/pytest-gpu.log" "$PYTEST_RC")
    TESTS_RC=$?
else
    TEST_SUMMARY="tests: NOT RUN: $PY cannot import pytest (install pytest and pytest-timeout into it)"
    TESTS_RC=1
fi
echo "$TEST_SUMMARY"

BENCH_S=$(( BUDGET_S - $(elapsed) - 10 ))
BENCH_RC=0
if [ "$BENCH_S" -lt 30 ]; then
    echo "== [$(elapsed) s] benchmark skipped: $BENCH_S s left of BUDGET_S=$BUDGET_S"
else
    echo "== [$(elapsed) s] python -m manual_train.bench --suite gpu --quick --only $BENCH_ONLY (at most $BENCH_S s)"
    timeout -k 10 "$BENCH_S" "$PY" -m manual_train.bench --suite gpu --quick --only "$BENCH_ONLY" --out "$OUT_DIR/bench"
    BENCH_RC=$?
    if [ "$BENCH_RC" -eq 124 ] || [ "$BENCH_RC" -eq 137 ]; then
        echo "bench: stopped after $BENCH_S s; the entries it finished are in bench/bench.md:"
        BENCH_RC=0  # the time limit is this script's choice; a failed entry still fails the check
        if [ -f "$OUT_DIR/bench/bench.json" ]; then
            "$PY" - "$OUT_DIR/bench/bench.json" <<'EOF' || BENCH_RC=1
import json, sys
entries = json.load(open(sys.argv[1]))["entries"]
for e in entries:
    print(f"  {e['name']}: {e['status']}")
sys.exit(any(e["status"] != "ok" for e in entries))
EOF
        fi
    fi
    [ -f "$OUT_DIR/bench/bench.md" ] && [ "$BENCH_RC" -ne 0 ] && cat "$OUT_DIR/bench/bench.md"
    if [ -d "$OUT_DIR/bench/logs" ]; then
        tar -czf "$OUT_DIR/bench-logs.tar.gz" -C "$OUT_DIR/bench" logs && rm -rf "$OUT_DIR/bench/logs"
    fi
fi

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=clocks.sm,temperature.gpu,memory.used --format=csv
echo "== [$(elapsed) s] done: bench exit $BENCH_RC; outputs in $OUT_DIR"
echo "$TEST_SUMMARY"
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
