# The two set-up commands: `make install` and `make test` (which installs first
# when needed). `make demo` runs the CPU weight-sync demo.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fork-installed
SOURCES := $(shell find python patches scripts -type f -not -path '*/__pycache__/*' -not -name '*.pyc')
PYTEST_ARGS ?=

.PHONY: install test test-fast build demo

install: $(STAMP)

$(STAMP): $(SOURCES)
	./scripts/install.sh

build:
	$(PY) python/fork_build.py --out dist

test: $(STAMP)
	$(PY) -m pytest test/srt/ray $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest test/srt/ray -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) scripts/demo.py
