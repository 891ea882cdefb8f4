# make demo   create .venv, install, run the main job
# make test   create .venv, install with the test extras, run the whole suite
# make bench  the CPU benchmark (quick)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: setup.cfg setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,zero,bench]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/torchrun --nproc_per_node=4 launch/ddp.py

# pytest exits 5 when it collected no tests: that is a broken suite, not a pass.
test: $(VENV)/.installed
	$(PY) -m pytest -q; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

bench: $(VENV)/.installed
	$(PY) -m manual_train.bench --suite cpu --quick

clean:
	rm -rf $(VENV) runs gpu-check-out bench-out .pytest_cache
