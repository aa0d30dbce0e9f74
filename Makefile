# Two commands do all the set-up: `make run` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?= default
PROMPT ?= The capital of France is
MAX_TOKENS ?= 32
# torch is installed first, pinned, from pip's default index (on Linux x86_64 that is the CUDA build)
# or from TORCH_INDEX (the CPU build: https://download.pytorch.org/whl/cpu). A venv that already has
# torch keeps it, so a CPU build installed by hand beforehand stays.
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install run test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: setup.cfg pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH_PIN)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

run: install
	$(BIN)/python -m engine generate --model "$(MODEL)" --prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS)

# pytest exits 5 when it collected no tests: a CI run that ran nothing must fail.
# -rfE: a summary line for each failure and error; the skips (the GPU tests on a CPU machine) are one count.
test: install
	$(BIN)/python -m pytest -q -rfE; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; exit $$rc

clean:
	rm -rf $(VENV) *.egg-info
