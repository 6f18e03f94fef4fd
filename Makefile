# make demo : create .venv with Python >= 3.12, install, run the main example on real data
# make test : create .venv, install, run the test suite (all of it: what CI runs; ~8.5-23 min cold on 2 cores, with the machine's speed: 20:09 in stop 50's clean-clone CI run, 738 tests, and 20:13-22:44 in stop 49's, on slow days; 17:32 in stop 42's clean-clone CI run, 687 tests, on a slow day (the quick subset alone 1:40 and the stop-41 tree's 4:44 in the same hour); 18:29 in stop 39's clean-clone CI run, 673 tests; 16:02 and 17:58 in stop 38's, 668 tests, on a slow day where the stop-37 tree took 14:53 in the same hour; 9:52-10:00 at stop 37)
# make test-fast: the same without the tests marked slow (pytest -m "not slow"): ~2 min cold on 2 cores (stop 54: 1:45-1:50, 402 tests, the stop-53 tree 1:41-1:52 alternating in the same hour, an Intel Xeon; stop 53: 2:10-2:21, 391 tests, the stop-52 tree 2:04-2:26 alternating in the same hour; stop 52: 1:47-2:08, 380 tests, the stop-51 tree 2:00-2:21 alternating in the same hour; stop 51: 2:12-2:19, 380 tests, the stop-50 tree 2:38-2:46 in the same hour; stop 50: 2:02-2:20, 381 tests, the stop-49 tree 1:46 in the same hour; stop 42: 1:46, 347 tests, after the tests over ~1.5 s were marked slow; the stop-41 tree 3:45, 461 tests, that morning; stop 39: 3:41, 453 tests, the stop-38 tree 3:20 in the same hour; stop 38: 3:14, 449 tests, the stop-37 tree 3:08 in the same hour; 2:17-2:21 at stop 37)
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
