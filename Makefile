# make demo : create .venv with Python >= 3.12, install, run the main example on real data
# make test : create .venv, install, run the test suite (all of it: what CI runs; ~8.5-10 min cold on 2 cores, with the machine's load: 10:00 in this stop's clean-clone CI run, 665 tests, where the last stop's tree took 9:57 in the same hour and 8:23-8:59 at that stop)
# make test-fast: the same without the tests marked slow (pytest -m "not slow"): ~2-2.5 min cold on 2 cores (this stop 2:21, the last stop's tree 2:17 in the same hour and 2:03-2:08 at that stop; 448 tests)
# make bench: run the benchmarks (ratios against NumPyro's Adam measured in the same run)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml
	@interp=$$(bash scripts/find-python.sh) || exit 1; \
	echo "using $$interp"; \
	[ -x $(PY) ] || $$interp -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,demo]'
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/logistic_regression.py

# two pytest-xdist workers, each test file kept on one worker (module fixtures computed once);
# the suite is compile-bound, so two cores run it in ~0.7 of the time of one process
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

test-fast: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m "not slow"

bench: $(STAMP)
	$(PY) bench/bench_blr.py

clean:
	rm -rf $(VENV)
