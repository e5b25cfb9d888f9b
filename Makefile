# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= build/demo
DEMO_PORTS ?= --http-port 8000 --grpc-port 8001 --metrics-port 8002
DEMO_GRPC ?= 127.0.0.1:8001
# The default model: trained here on the shapes dataset (see models/shapes-flux/README.md).
MODEL ?= models/shapes-flux
NAME ?= shapes
PROMPT ?= a red circle at the top left
# The video default, served beside it: trained here on moving shapes (see models/shapes-wan/README.md).
VIDEO_MODEL ?= models/shapes-wan
VIDEO_NAME ?= shapes-video
VIDEO_PROMPT ?= a red circle moves to the right
# The world model, played as a realtime session steered by a fixed key sequence (see models/shapes-world/README.md).
WORLD_MODEL ?= models/shapes-world
WORLD_NAME ?= shapes-world
WORLD_SUBJECT ?= a yellow square
WORLD_KEYS ?= --steer 1:right --steer 3:up --steer 5:left --steer 7:down --steer 9:stop

.PHONY: install system-tools test test-fast demo repository clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# HAProxy, Prometheus, Chromium and its driver, PostgreSQL from Debian's packages where they are missing; where they
# cannot be installed, one line says so and the tests that need them skip, naming them.
system-tools:
	@bash tools/system-tools.sh
	@for tool in haproxy prometheus chromium chromedriver; do \
		command -v $$tool >/dev/null 2>&1 && echo "$$tool: $$($$tool --version 2>/dev/null | head -n 1)"; \
	done; ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sed 's/^/postgresql: /'; true

# Two workers (the CI machine's cores); a test module runs whole on one worker, so its repositories are built once
# (the modules that start many processes run as one: tests/conftest.py's MANY_PROCESSES).
# One thread each: two workers fill the two cores, and more threads only contend (torch's OpenMP threads spin while
# they wait for work).
PYTEST_WORKERS ?= 2
PYTEST_THREADS ?= 1
PYTEST_PARALLEL = -n $(PYTEST_WORKERS) --dist loadfile

test: install system-tools
	OMP_NUM_THREADS=$(PYTEST_THREADS) $(BIN)/python -m pytest -ra --durations=15 $(PYTEST_PARALLEL)

# The unit tier: no export, no server (what exports or serves is marked so, and refused here).
test-fast: install
	MACHGEN_TEST_TIER=fast OMP_NUM_THREADS=$(PYTEST_THREADS) $(BIN)/python -m pytest -ra --durations=10 \
		-m "not export and not integration" -n $(PYTEST_WORKERS) --dist load

repository: install
	$(BIN)/machgen-build build $(MODEL) --name $(NAME) --target onnxruntime --out model_repository
	$(BIN)/machgen-build build $(VIDEO_MODEL) --name $(VIDEO_NAME) --target onnxruntime --out model_repository
	$(BIN)/machgen-build build $(WORLD_MODEL) --name $(WORLD_NAME) --target onnxruntime --out model_repository

demo: repository
	@mkdir -p out $(DEMO_DIR)
	@set -e; \
	$(BIN)/machgen serve model_repository $(DEMO_PORTS) > $(DEMO_DIR)/serve.log 2>&1 & server=$$!; \
	trap 'kill -TERM $$server 2>/dev/null; wait $$server' EXIT; \
	for _ in $$(seq 180); do \
		grep -q '^ready' $(DEMO_DIR)/serve.log && break; \
		kill -0 $$server 2>/dev/null || { cat $(DEMO_DIR)/serve.log; exit 1; }; \
		sleep 1; \
	done; \
	grep '^ready' $(DEMO_DIR)/serve.log; \
	$(BIN)/machgen generate --url $(DEMO_GRPC) --model $(NAME) --prompt "$(PROMPT)" --seed 0 --out out/demo.png; \
	$(BIN)/machgen generate --url $(DEMO_GRPC) --model $(VIDEO_NAME) --prompt "$(VIDEO_PROMPT)" --seed 0 \
		--out out/demo.mp4; \
	$(BIN)/machgen session --url $(DEMO_GRPC) --model $(WORLD_NAME) --prompt "$(WORLD_SUBJECT)" --seed 0 \
		--chunks 10 $(WORLD_KEYS) --out out/world.mp4

clean:
	rm -rf build out model_repository/*/ .pytest_cache
