# kdt: `make run` (the main job on the bundled fixture) and `make test` each set up what they need.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
FIXTURE ?= fixtures/model_tiny.h5
CODE_MODEL ?= fixtures/model_code.h5
STAMP   := $(VENV)/.kdt-installed

.PHONY: setup run verify generate test test-gpu lint bench gen-ref clean

setup: $(STAMP)  ## create .venv and install kdt with its test extra

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)  ## the main job: golden checks of the bundled fixture, then code from the demo model
	$(BIN)/kdt verify $(FIXTURE)
	$(BIN)/kdt generate --model $(CODE_MODEL) --prompt "def " --max-new-tokens 200

verify: $(STAMP)
	$(BIN)/kdt verify $(FIXTURE)

generate: $(STAMP)
	$(BIN)/kdt generate --model $(CODE_MODEL) --prompt "import " --max-new-tokens 200

# Kernel tests run in the CUDA simulator on small shapes; tests/test_compile_ptx.py also compiles
# every kernel for sm_90 (H200) in a subprocess with the simulator off.
test: $(STAMP)  ## all tests that need no GPU (what CI runs)
	NUMBA_ENABLE_CUDASIM=1 OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest -q

test-gpu: $(STAMP)  ## the gpu-marked tests at real shapes, on a CUDA machine
	$(BIN)/python -m pytest -q -m gpu

lint: $(STAMP)
	$(BIN)/ruff check kdt tests

bench: $(STAMP)
	$(BIN)/kdt bench --preset tiny

gen-ref: $(STAMP)  ## regenerate the golden fixture (only when the reference itself changes)
	$(BIN)/kdt gen-ref --out $(FIXTURE)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
