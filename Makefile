# Two commands do all set-up from a fresh clone:
#   make serve   creates .venv, installs the package (runtime only), starts gdn-server (CPU when there is no GPU)
#   make test    creates .venv, installs the package with its test tools, runs the test suite
# Pass server flags with ARGS, e.g. `make serve ARGS="--preset qwen3-next --port 50051"`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch, the version the tests and docker/Dockerfile pin, as its CPU build from PyTorch's own index
# of CPU wheels (~190 MB): on PyPI itself torch for Linux x86_64 is the CUDA 13 build, with several
# GB of CUDA libraries. Only torch comes from that index (--no-deps); its dependencies come from
# your usual one with the package's. A GPU host takes the CUDA build from PyPI instead:
#   make serve TORCH_INDEX=https://pypi.org/simple
# or installs the torch build it needs into .venv itself and passes TORCH_SPEC= (empty).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
ARGS ?= --preset qwen3-next
# two workers, each file's tests on one of them (a file's module-scoped servers are shared by its
# tests); tests/gpu run alone (`python -m pytest tests/gpu`): each GPU server takes most of the GPU
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=

.PHONY: serve test proto bench-kernel clean

# the C module is built by the install: a changed source is built again
$(VENV)/.runtime: pyproject.toml setup.py gdn_server/_wire.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_SPEC),@echo "installing $(TORCH_SPEC) from $(TORCH_INDEX)")
	$(if $(TORCH_SPEC),$(PY) -m pip install -q --no-deps --index-url "$(TORCH_INDEX)" "$(TORCH_SPEC)")
	@echo "installing gdn-serve (editable) and its dependencies; building gdn_server/_wire.c"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.runtime
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

serve: $(VENV)/.runtime
	$(VENV)/bin/gdn-server $(ARGS)

test: $(VENV)/.dev
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# regenerate the committed stubs (tests/test_proto_stubs.py fails when they are stale)
proto: $(VENV)/.dev
	$(PY) -m grpc_tools.protoc -Igdn_client/proto=proto --python_out=. --pyi_out=. --grpc_python_out=. proto/gdn/v1/gdn.proto

bench-kernel: $(VENV)/.runtime
	$(PY) bench/kernel.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
