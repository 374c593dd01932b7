# raypai: `make test` and `make demo` do the whole set-up from a bare machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# torch first, pinned to the CPU wheel, so nothing resolves a CUDA build; the constraint file
# also binds pip's isolated build environments (deepspeed builds from an sdist that imports torch).
export PIP_CONSTRAINT := $(CURDIR)/.ci/constraints.txt
export DS_ACCELERATOR ?= cpu
export MLFLOW_DISABLE_TELEMETRY := true
export DO_NOT_TRACK := true
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: install test demo demo-stop bench clean

$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest tests -q --durations=25

# A persistent local Ray head (so the deployed endpoint outlives the pipeline driver), on free
# ports recorded in $RAYPAI_HOME/runtime.json; a second `make demo` reuses it. demo-stop stops that
# head only, never another Ray on this machine (`ray stop` would stop them all).
demo: $(STAMP)
	$(BIN)/raypai ray start --num-cpus 8
	$(BIN)/python -m raypai.pipelines.tinychat $(DEMO_ARGS)

demo-stop:
	$(BIN)/raypai ray stop

bench: $(STAMP)
	$(BIN)/pip install -q -e ".[dev,bench]"
	for f in benchmarks/*.py; do $(BIN)/python $$f || exit 1; done

clean:
	rm -rf $(VENV) .raypai mlruns build *.egg-info
