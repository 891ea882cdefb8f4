# make demo   create .venv, install the package alone (no test extras), run the main job
# make test   create .venv, install with the test extras, run the whole suite
# make bench  the CPU benchmark (quick)
# make test-isa  the parity tests under each instruction set a user's CPU may have (native, AVX2, the lowest)
# make stress    the repetition tests (a race under CPU load), not part of `make test`
# make mutants   every mutant of tests/mutants/ against the tests that must kill it; writes docs/mutants.md and
#                docs/bug-gallery.md (about 30 minutes on 2 cores)
# make mutants-operators  a seeded sample of cosmic-ray's operator mutants over the library, each against its module's
#                fast tests; writes docs/mutants-operators.md and .json (about 40 minutes on 2 cores)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: demo test test-isa stress mutants mutants-operators bench clean

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
test: $(VENV)/.installed
	$(PY) -m pytest -q; rc=$$?; \
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

mutants: $(VENV)/.installed
	$(PY) tests/run_mutants.py

$(VENV)/.installed-mutants: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[test,zero,bench,mutants]'
	touch $@

mutants-operators: $(VENV)/.installed-mutants
	$(PY) tests/operator_mutants.py --jobs 2

bench: $(VENV)/.installed
	$(PY) -m manual_train.bench --suite cpu --quick

clean:
	rm -rf $(VENV) runs gpu-check-out bench-out .pytest_cache
