# make demo   create .venv, install the package alone (no test extras), run the main job
# make test   create .venv, install with the test extras, run the whole suite
# make bench  the CPU benchmark (quick)
# make test-isa  the parity tests under each instruction set a user's CPU may have (native, AVX2, the lowest)
# make stress    the repetition tests (a race under CPU load), not part of `make test`
# make test-slurm  preemption under a local one-node Slurm (tests/test_slurm.py; needs slurm-wlm and munge, and root)
# make site     the lessons as a static site in site-out/ (open site-out/index.html; no server needed)
# make mutants   every mutant of tests/mutants/ against the tests that must kill it; writes docs/mutants.md and
#                docs/bug-gallery.md (about 30 minutes on 2 cores)
# make mutants-flags  one generated mutant per flag (its value ignored) against the tests that name it; writes
#                docs/mutants-flags.md (the flags' kill matrix) and the scores table of docs/mutants.md
# make mutants-operators  a seeded sample of cosmic-ray's operator mutants over the library, each against its module's
#                fast tests; writes docs/mutants-operators.md and .json (about 40 minutes on 2 cores)
# make mutants-all    all three sets: the catalogue, the flag mutants, the operator mutants
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: demo test test-isa stress mutants mutants-flags mutants-operators mutants-all bench site clean test-slurm

$(VENV)/.installed: setup.cfg setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,zero,bench]'
	touch $@

# The demo needs the package alone (torch, torchvision, scikit-learn, tqdm): its own stamp, so that `make demo`
# installs no pytest, fairscale or matplotlib; `make test` later adds them through .installed.
$(VENV)/.installed-demo: setup.cfg setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $@

demo: $(VENV)/.installed-demo
	$(VENV)/bin/torchrun --nproc_per_node=4 launch/ddp.py

# pytest exits 5 when it collected no tests: that is a broken suite, not a pass.
# TEST_WORKERS: pytest-xdist workers. Every process of the suite computes with one thread, so one pytest process
# leaves the second core idle whenever it trains alone: on a quiet 2-core Xeon (2026-12-06, same tree) 2 workers took
# 750 s where one took 979 s, and 3 took 805 s where 2 took 721 s. 2 workers on 2 to 5 cores (measured on 2 only),
# one per 2 cores from 6 up (many tests run 2 processes, a job's ranks), none on one core. --dist loadfile keeps a
# file's tests, and so its module-scoped set-ups, on one worker: nothing is computed twice. --no-loadscope-reorder:
# the files go out in conftest's order, the dearest first (xdist's own order is by number of tests, which sent a 90 s
# file last). TEST_ARGS: more pytest options, e.g. `make test TEST_ARGS=--cost-report=costs.md` (where the time goes,
# per file: tests/costs.py).
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; n = os.cpu_count() or 1; print(max(2, n // 2) if n >= 2 else 0)")
test: $(VENV)/.installed
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(TEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The tests that compare a technique with the baseline (or a resume with the uninterrupted run), run once per
# instruction set: the kernels, and so the fp32 rounding, differ between CPU kinds; these variables make this CPU
# compute with a lower kind's kernels (they must be set before torch loads: one pytest process per level).
# ISA_LEVELS=avx2 runs one level. On a CPU without AVX-512 the avx2 level is its native one.
PARITY_TESTS ?= tests/test_accumulation.py tests/test_data_parallel.py tests/test_model_parallel.py tests/test_hybrid.py \
	tests/test_ddp_cli.py tests/test_ddp_parity.py tests/test_ddp_torchrun.py tests/test_ddp_knobs.py \
	tests/test_zero_cli.py tests/test_zero_parity.py tests/test_pipeline.py tests/test_tensor_parallel.py \
	tests/test_world_size.py tests/test_levers.py tests/test_precision.py tests/test_checkpoint.py
ISA_LEVELS ?= native avx2 default
ISA_native  :=
ISA_avx2    := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
ISA_default := ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2
test-isa: $(VENV)/.installed
	@for level in $(ISA_LEVELS); do \
	  case $$level in native) vars="$(ISA_native)";; avx2) vars="$(ISA_avx2)";; default) vars="$(ISA_default)";; \
	    *) echo "make test-isa: unknown level $$level (native, avx2, default)" >&2; exit 2;; esac; \
	  echo "== test-isa: $$level: $${vars:-(this CPU's own kernels)}"; \
	  env $$vars $(PY) -c "import torch; print('   ATen runs', torch.backends.cpu.get_cpu_capability())" || exit 1; \
	  env $$vars $(PY) -m pytest -q -p no:cacheprovider $(PARITY_TESTS) || exit 1; \
	done

# 16 short 2-rank torchrun jobs (10 DDP, 3 FSDP2, 3 hybrid ddp-mp), two at a time beside 4 CPU-burning processes:
# every one must exit 0 (the gloo teardown abort of tests/test_teardown.py; a race, so it is repeated).
stress: $(VENV)/.installed
	$(PY) -m pytest -q -rA -p no:cacheprovider -m stress

# launch/slurm_train.sbatch as shipped, on a one-node cluster this machine runs for the tests (tests/local_slurm.py):
# time-limit and preemption notices, notices during set-up and a resume's load, requeues in a row, two agents over
# c10d; each job ends bit for bit where an uninterrupted run ends. Minutes, so not part of `make test` (there, without
# Slurm or as a non-root user, pytest skips them and says what is missing); here, asked for, they fail instead of skipping.
test-slurm: $(VENV)/.installed
	RUN_SLURM_TESTS=1 $(PY) -m pytest -q -rs -p no:cacheprovider -m slurm tests/test_slurm.py

mutants: $(VENV)/.installed
	$(PY) tests/run_mutants.py

# The site needs no torch and no install of the package (it runs from the tree): setup.cfg's `site` extra alone, read
# from setup.cfg (one list of its packages).
$(VENV)/.installed-site: setup.cfg setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $$($(PY) -c "import configparser; c = configparser.ConfigParser(); c.read('setup.cfg'); print(c['options.extras_require']['site'])")
	touch $@

site: $(VENV)/.installed-site
	PYTHONPATH=. $(PY) -m manual_train.docs --html site-out

$(VENV)/.installed-mutants: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test,zero,bench,mutants]'
	touch $@

mutants-operators: $(VENV)/.installed-mutants
	$(PY) tests/operator_mutants.py --jobs 2

mutants-flags: $(VENV)/.installed
	$(PY) tests/flag_mutants.py

# Each set runs even when an earlier one had a survivor; the target fails if any set did.
mutants-all: $(VENV)/.installed
	rc=0; for t in mutants mutants-flags mutants-operators; do $(MAKE) --no-print-directory $$t || rc=1; done; exit $$rc

bench: $(VENV)/.installed
	$(PY) -m manual_train.bench --suite cpu --quick

clean:
	rm -rf $(VENV) runs gpu-check-out bench-out site-out .pytest_cache
