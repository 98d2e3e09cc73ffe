# nemospec: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO   := build/demo
MODE   ?= eagle3
EMBEDDED ?= wide

.PHONY: setup test demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/venv_install.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@# by uv with pip's configuration (about half pip's time here), or by pip where uv cannot do it
	$(PYTHON) scripts/venv_install.py $(VENV) --quiet -e '.[dev]'
	@# transformers may pull torchvision/torchaudio, which break beside the CPU torch wheel
	-$(BIN)/pip uninstall --quiet -y torchvision torchaudio 2>/dev/null
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=15

demo: setup
	MODE=$(MODE) EMBEDDED=$(EMBEDDED) $(BIN)/python -m nemospec.demo --workdir $(DEMO)

clean:
	rm -rf $(VENV) build .pytest_cache
