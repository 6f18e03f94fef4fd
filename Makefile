# make demo : create .venv with Python >= 3.12, install, run the main example on real data
# make test : create .venv, install, run the test suite (all of it: what CI runs)
# make test-fast: the same without the tests marked slow (pytest -m "not slow"), under 2 minutes
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

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) bench/bench_blr.py

clean:
	rm -rf $(VENV)
