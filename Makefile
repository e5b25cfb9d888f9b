# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR ?= build/demo
DEMO_PORTS ?= --http-port 8000 --grpc-port 8001 --metrics-port 8002
DEMO_GRPC ?= 127.0.0.1:8001

.PHONY: install test demo repository clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(BIN)/python -m pytest -ra

# The default model: the tiny Flux until a trained model replaces it.
repository: install
	$(BIN)/machgen-build tiny flux $(DEMO_DIR)/tiny-flux
	$(BIN)/machgen-build build $(DEMO_DIR)/tiny-flux --name flux --target onnxruntime --out model_repository

demo: repository
	@mkdir -p out
	@set -e; \
	$(BIN)/machgen serve model_repository $(DEMO_PORTS) > $(DEMO_DIR)/serve.log 2>&1 & server=$$!; \
	trap 'kill -TERM $$server 2>/dev/null; wait $$server' EXIT; \
	for _ in $$(seq 180); do \
		grep -q '^ready' $(DEMO_DIR)/serve.log && break; \
		kill -0 $$server 2>/dev/null || { cat $(DEMO_DIR)/serve.log; exit 1; }; \
		sleep 1; \
	done; \
	grep '^ready' $(DEMO_DIR)/serve.log; \
	$(BIN)/machgen generate --url $(DEMO_GRPC) --model flux --prompt "a red cat" --seed 0 --out out/demo.png

clean:
	rm -rf build out model_repository/*/ .pytest_cache
