# The two set-up commands: `make install` and `make test` (which installs first
# when needed). `make demo` runs the CPU weight-sync demo; `make soak` the
# start/stop lifecycle test with 20 cycles (3 in `make test`); `make test-gpu`
# the GPU-only tests of test/srt/ray/gpu (never collected by `make test`).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fork-installed
SOURCES := $(shell find python patches scripts -type f -not -path '*/__pycache__/*' -not -name '*.pyc')
PYTEST_ARGS ?=

.PHONY: install test test-fast test-gpu soak build demo

install: $(STAMP)

$(STAMP): $(SOURCES)
	./scripts/install.sh

build:
	$(PY) python/fork_build.py --out dist

test: $(STAMP)
	$(PY) -m pytest test/srt/ray $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest test/srt/ray -m "not slow" $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(PY) -m pytest test/srt/ray/gpu $(PYTEST_ARGS)

soak: $(STAMP)
	SGLANG_TEST_LIFECYCLE_CYCLES=20 $(PY) -m pytest \
		"test/srt/ray/test_update_safety.py::test_start_stop_cycles_with_kills_leave_nothing_behind" $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) scripts/demo.py
