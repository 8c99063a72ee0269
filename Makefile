# kdt: `make run` (the main job on the bundled fixture) and `make test` each set up what they need.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
FIXTURE ?= fixtures/model_tiny.h5
CODE_MODEL ?= fixtures/model_code.h5
STAMP   := $(VENV)/.kdt-installed

.PHONY: setup run verify generate test test-gpu lint bench gen-ref train-demo clean

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
# every kernel for sm_90 (H200) in subprocesses with the simulator off. The simulator runs a Python thread
# per CUDA thread under one GIL, so the tests spread over a worker per core (pytest-xdist; worksteal: an idle
# worker takes queued tests from a busy one); the slowest are listed at the end.
test: $(STAMP)  ## all tests that need no GPU (what CI runs)
	NUMBA_ENABLE_CUDASIM=1 OPENBLAS_NUM_THREADS=1 $(BIN)/python -m pytest -q -n auto --dist worksteal --durations=20

test-gpu: $(STAMP)  ## the gpu-marked tests at real shapes, on a CUDA machine
	$(BIN)/python -m pytest -q -m gpu

lint: $(STAMP)
	$(BIN)/ruff check kdt tests

bench: $(STAMP)
	$(BIN)/kdt bench --preset tiny

gen-ref: $(STAMP)  ## regenerate the golden fixture (only when the reference itself changes)
	$(BIN)/kdt gen-ref --out $(FIXTURE)

# The recipe of the committed demo model (on the H200): the target (session 5), its drafter (session 8), the
# drafter trained further on fresh continuations (sessions 12-14: --resume, seeds 1-3), cut to its first two
# layers and trained further (sessions 21-22: --resume --layers 2, seeds 6-7), and its acceptance table on
# kdt's CUDA engine. Needs a CUDA GPU and the train extra; GPU training is
# not bitwise repeatable, so the numbers come out close to, not equal to, docs/PERF.md's.
train-demo: $(STAMP)  ## retrain fixtures/model_code.h5 (target + drafter) on a GPU, ~45 minutes
	$(BIN)/pip install -q -e '.[train]'
	$(BIN)/python scripts/train_target.py --device cuda --steps 5458 --minutes 0 --batch 64 --warmup 100 \
		--fixture $(CODE_MODEL)
	$(BIN)/kdt train-drafter $(CODE_MODEL) --device cuda --steps 2489 --minutes 0 --layers 3 --intermediate 1024 \
		--sequences 65536 --batch 256 --anchors 16 --eval-prompts 0
	$(BIN)/kdt train-drafter $(CODE_MODEL) --resume --device cuda --steps 3885 --minutes 0 --sequences 65536 \
		--batch 256 --anchors 16 --seed 1 --lr 0.001 --eval-prompts 0
	$(BIN)/kdt train-drafter $(CODE_MODEL) --resume --device cuda --steps 3893 --minutes 0 --sequences 65536 \
		--batch 256 --anchors 16 --seed 2 --lr 0.0007 --eval-prompts 0
	$(BIN)/kdt train-drafter $(CODE_MODEL) --resume --device cuda --steps 3561 --minutes 0 --sequences 65536 \
		--batch 256 --anchors 16 --seed 3 --lr 0.0005 --eval-prompts 0
	$(BIN)/kdt train-drafter $(CODE_MODEL) --resume --layers 2 --device cuda --steps 4898 --minutes 0 \
		--sequences 65536 --batch 256 --anchors 16 --seed 6 --lr 0.001 --eval-prompts 0
	$(BIN)/kdt train-drafter $(CODE_MODEL) --resume --device cuda --steps 5720 --minutes 0 --sequences 65536 \
		--batch 256 --anchors 16 --seed 7 --lr 0.0005 --backend cuda --dtype bf16 --budgets 16,31,64,256 --repeats 3

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
