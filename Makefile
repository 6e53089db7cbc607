# The two commands of the README: `make run` and `make test`. Both set up .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run generate test test-quantized test-slow lint bench-serve bench-serving bench-peers bench-http bench-batch bench-tp bench bench-scheduler bench-transport bench-routing bench-lora bench-key-limits bench-kernels bench-structured bench-families bench-speculation bench-quant bench-quant-quality bench-quant-llamacpp gpu-check clean lock

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip==25.3
	# torch first, from the local CPU build: any other torch would download gigabytes
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,bench,otel]'
	# TGI's own client pins an old huggingface_hub, instructor an old jiter and rich: they go in
	# without their dependencies (the tests use them against the pinned ones)
	$(PY) -m pip install --quiet --no-deps text-generation==0.7.0 instructor==1.17.0 \
		docstring-parser==0.17.0
	touch $(STAMP)

# The service, embedded (SQLite, batcher in-process) unless DATABASE_URL / REDIS_URL are set;
# the demo model unless MODEL_DIR is. Listens on http://127.0.0.1:3000 (HOSTNAME, PORT).
run: $(STAMP)
	MODEL_DIR=$${MODEL_DIR:-$$($(PY) -m tgq.devtools.demo)} \
	DATABASE_URL=$${DATABASE_URL:-sqlite+aiosqlite:///.cache/tgq.db} AUTO_MIGRATE=$${AUTO_MIGRATE:-true} \
	HOSTNAME=$${TGQ_HOSTNAME:-127.0.0.1} $(PY) -m tgq.api

generate: $(STAMP)
	$(PY) -m tgq.cli.generate --demo --prompt "The Python language" --max-new-tokens 24

# Two workers, a test file each at a time (its module fixtures stay on one worker): most tests
# wait on the processes they start, so two cores run two files at once. The C++ kernels build
# (or load, when built) beside the lint, which keeps one core: the tests start with them built.
test: $(STAMP)
	$(PY) -c 'from tgq.kernels import cpu_ops; cpu_ops.is_available()' & kernels=$$!; \
	$(MAKE) --no-print-directory lint || { kill $$kernels; exit 1; }; \
	wait $$kernels
	$(PY) -m pytest -q -n 2 --dist loadfile

# The parity and scheduling tests with every engine `--quantize`d, against transformers on the
# dequantized weights (tests/quantized_mode.py); QUANTIZE=fp8 for FP8.
QUANTIZE ?= int8
test-quantized: $(STAMP)
	TGQ_TEST_QUANTIZE=$(QUANTIZE) $(PY) -m pytest -q -n 2 --dist loadfile \
		tests/gpu_worker/test_parity.py tests/batcher/test_e2e.py \
		tests/gpu_worker/test_tensor_parallel.py

# The opt-in reliability rounds (pytest's `slow` marker): long fault-injection runs.
test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m bench.bench_engine

bench-serve: $(STAMP)
	$(PY) -m bench.bench_serve

bench-serving: $(STAMP)
	$(PY) -m bench.bench_serving

bench-peers: $(STAMP)
	$(PY) -m bench.bench_peers

bench-http: $(STAMP)
	$(PY) -m bench.bench_http

bench-batch: $(STAMP)
	$(PY) -m bench.bench_batch

bench-tp: $(STAMP)
	$(PY) -m bench.bench_tp

bench-scheduler: $(STAMP)
	$(PY) -m bench.bench_scheduler

bench-transport: $(STAMP)
	$(PY) -m bench.bench_transport

bench-routing: $(STAMP)
	$(PY) -m bench.bench_routing

bench-lora: $(STAMP)
	$(PY) -m bench.bench_lora

bench-key-limits: $(STAMP)
	$(PY) -m bench.bench_key_limits

bench-kernels: $(STAMP)
	$(PY) -m bench.bench_cpu_ops

bench-structured: $(STAMP)
	$(PY) -m bench.bench_structured

bench-speculation: $(STAMP)
	$(PY) -m bench.bench_speculation

bench-families: $(STAMP)
	$(PY) -m bench.bench_families

bench-quant: $(STAMP)
	$(PY) -m bench.bench_quant

bench-quant-quality: $(STAMP)
	$(PY) -m bench.bench_quant_quality

# Needs llama.cpp's llama-batched-bench and the medium model as GGUF (docs/performance.md):
# make bench-quant-llamacpp BATCHED_BENCH=/path/llama-batched-bench GGUF_DIR=/path/with/ggufs
bench-quant-llamacpp: $(STAMP)
	$(PY) -m bench.bench_quant_llamacpp --batched-bench $(BATCHED_BENCH) --gguf-dir $(GGUF_DIR)

gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache

lock:
	rm -rf /tmp/tgq-lock && $(PYTHON) -m venv /tmp/tgq-lock
	/tmp/tgq-lock/bin/pip install --quiet torch==2.13.0
	/tmp/tgq-lock/bin/pip install --quiet -e '.[dev,bench,otel]'
	/tmp/tgq-lock/bin/pip freeze --exclude-editable | grep -v '^torch==' > constraints.body
	{ head -2 constraints.txt; cat constraints.body; echo torch==2.13.0; } > constraints.new
	mv constraints.new constraints.txt && rm constraints.body
