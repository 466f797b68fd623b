# Set-up and entry points for a CPU machine (kernels run under Triton's interpreter).
#   make demo   set up (once) and run the main job (TorchRec A/B: fused vs Triton) on a small CPU default
#   make test   set up (once) and run the full test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: setup demo test aot clean

setup: $(STAMP)

$(STAMP): requirements-cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	$(PY) -m pip install -q --no-deps torchrec==1.9.2
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: setup
	$(PY) -m torchrec_triton_tbe.torchrec_demo

test: setup
	$(PY) -m pytest -q tests

aot: setup
	TRITON_INTERPRET=0 $(PY) -m torchrec_triton_tbe.aot

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
