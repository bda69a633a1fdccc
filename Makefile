# Two commands: `make serve` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Torch: PyTorch's CPU wheels unless this machine has an NVIDIA driver (then PyPI's build, which is
# CUDA's on Linux x86_64); an index that cannot be reached is skipped and PyPI serves. On a GPU node
# without the driver tools, `make gpu` installs PyTorch's CUDA wheels (CUDA_INDEX); for another CUDA
# version pass e.g. CUDA_INDEX=https://download.pytorch.org/whl/cu126. A changed spec or index
# reinstalls torch (its stamp names them).
TORCH_SPEC ?= torch==2.13.0
# `make gpu` remembers its index in the venv, so a later `make serve` keeps the CUDA build.
TORCH_INDEX ?= $(or $(shell cat $(VENV)/.torch-index 2>/dev/null),$(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu))
TORCH_STAMP := $(VENV)/.torch-$(shell printf '%s' '$(TORCH_SPEC) $(TORCH_INDEX)' | cksum | cut -d' ' -f1)
CUDA_INDEX ?= https://download.pytorch.org/whl/cu128
ARGS ?=
# pytest workers (pytest-xdist): one per core by default; tests that wait on daemons, disks and the
# interpreted Triton kernels overlap instead of queueing. (A third worker on two cores measured 671 s and
# then 756 s against 761 s with two: within this machine's noise, so not worth the extra contention.)
TEST_WORKERS ?= auto

# The agent CLIs tests/test_agent_clis.py runs against a daemon, pinned (a new release changes what
# they send): Claude Code, Codex and opencode from npm (each ships a native binary), aider from PyPI in
# its own environment (it pins its own openai and litellm; not byte-compiled at install: 26 s instead of
# 57, and a run compiles only what it imports). About 1.9 GB, in .agents/.
AGENTS := .agents
AGENT_NPM ?= @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 opencode-ai@1.18.33
AIDER_SPEC ?= aider-chat==0.86.2
AGENTS_STAMP := $(AGENTS)/.installed-$(shell printf '%s' '$(AGENT_NPM) $(AIDER_SPEC)' | cksum | cut -d' ' -f1)

# DeepSeek-V4.1's numerical oracle (tests/oracles/nemo_v41.py): NVIDIA's nemo-automodel (Apache-2.0) in an
# environment of its own, since it pins transformers 5.18 (.venv has 5.23). Installed without nemo's declared
# dependencies (datasets, megatron-fsdp, mistral-common, torchao, torchdata, quack-kernels, ...: its
# DeepSeek-V4.1 model imports none of them), with exactly what that model's import chain needs, pinned;
# PyTorch's CPU build always (the oracle runs in fp32 on a CPU; +cpu fails rather than fetch a CUDA build).
# Byte-compiled like .venv. About 1.2 GB (torch 0.75 GB), ~35 s.
V41_ORACLE := .venv-v41oracle
V41_ORACLE_SPEC ?= nemo-automodel==0.7.0
V41_ORACLE_DEPS ?= torch==2.13.0+cpu transformers==5.18.0 tokenizers==0.23.3 huggingface_hub==2.5.0 \
  safetensors==0.8.0 numpy==2.4.6 pillow==13.0.0 PyYAML==6.0.4 regex==2026.12.2 packaging==26.4 tqdm==4.70.1 \
  filelock==4.3.2 fsspec==2026.9.0 typing_extensions==4.16.0 sympy==1.14.0 mpmath==1.3.0 networkx==3.6.1 \
  Jinja2==3.1.6 MarkupSafe==3.0.4 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0 anyio==4.16.0 idna==3.21 \
  truststore==0.10.5
V41_ORACLE_STAMP := $(V41_ORACLE)/.installed-$(shell printf '%s' '$(V41_ORACLE_SPEC) $(V41_ORACLE_DEPS)' | cksum | cut -d' ' -f1)

.PHONY: install gpu serve test lint bench clean prometheus agents image-tools v41-oracle

$(TORCH_STAMP):
	@test -x $(PY) || { echo "==> creating $(VENV) (a virtual environment for everything below)"; $(PYTHON) -m venv $(VENV); }
	@$(PY) -m pip install --quiet --upgrade pip
	@if ls $(VENV)/.torch-* >/dev/null 2>&1; then echo "==> TORCH_SPEC or TORCH_INDEX changed: removing the installed torch"; \
	  $(PY) -m pip uninstall --quiet --yes torch; fi
	@echo "==> installing $(TORCH_SPEC)$(if $(TORCH_INDEX), (from $(TORCH_INDEX); PyPI if unreachable)) ..."
	$(PY) -m pip install --progress-bar on --no-compile $(TORCH_SPEC) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) --retries 1 --timeout 15)
	@$(PY) -W ignore -c "import torch; print('==> torch', torch.__version__, '(CUDA ' + str(torch.version.cuda) + ')' if torch.version.cuda else '(CPU build)')"
	@rm -f $(VENV)/.torch-* $(STAMP)
	@touch $@

$(STAMP): pyproject.toml $(TORCH_STAMP)
	@echo "==> installing v4serve and its test tools (transformers as the numerical oracle, the client SDKs) ..."
	$(PY) -m pip install --quiet --no-compile -e '.[test]'
	@# Byte-compiled (torch too) on every core rather than by pip on one (half the time). Compiled it must be:
	@# where Python writes no bytecode itself (PYTHONDONTWRITEBYTECODE) every daemon the tests start
	@# would compile its imports again. Files for other Python versions fail to compile and stay as
	@# they are.
	@echo "==> byte-compiling what was installed, on every core ..."
	@$(PY) -m compileall -qq -j 0 "$$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" || true
	@touch $@

install: $(STAMP)

# The CUDA build of torch from PyTorch's index, then everything else (a GPU node whose driver tools are
# not on PATH; with nvidia-smi, `make install` already takes PyPI's CUDA build). Then `make serve`;
# `make clean` forgets the choice.
gpu:
	@$(MAKE) --no-print-directory install TORCH_INDEX=$(CUDA_INDEX)
	@echo "$(CUDA_INDEX)" > $(VENV)/.torch-index
	@$(PY) -W ignore -c "import torch; print('==> CUDA available:', torch.cuda.is_available())"

# tests/test_prometheus.py runs a real Prometheus: Debian's package, installed when missing and
# installable (apt-get as root); otherwise that test skips, naming why.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian's prometheus package for tests/test_prometheus.py"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
	    || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	         --no-install-recommends prometheus >/dev/null 2>&1; } \
	    || echo "could not install prometheus: tests/test_prometheus.py will skip"; \
	  else echo "prometheus is not installed and apt-get cannot run as root here: tests/test_prometheus.py will skip"; fi; }

# tests/test_image.py builds the Dockerfile's images without a Docker daemon: Debian's buildah (builds
# with --isolation chroot), podman and runc (run the CPU image) and debootstrap (makes the stand-in base
# images), installed when missing and installable (apt-get as root); otherwise that test skips, naming
# the missing tool. Its bases and layer cache are kept in ~/.cache/v4serve-image (about 2.5 GB).
IMAGE_TOOLS := buildah podman runc debootstrap
image-tools:
	@missing=""; for t in $(IMAGE_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "==> installing Debian's$$missing for tests/test_image.py"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(IMAGE_TOOLS) >/dev/null 2>&1 \
	    || { apt-get update -qq >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	         --no-install-recommends $(IMAGE_TOOLS) >/dev/null 2>&1; } \
	    || echo "could not install$$missing: tests/test_image.py will skip"; \
	  else echo "$$missing not installed and apt-get cannot run as root here: tests/test_image.py will skip"; fi; fi

# Without npm (Node.js) the npm CLIs are not installed and their tests skip, naming why; a failed
# install stops here.
$(AGENTS_STAMP):
	@rm -f $(AGENTS)/.installed-*
	@if command -v npm >/dev/null 2>&1; then \
	  echo "==> installing the agent CLIs for tests/test_agent_clis.py: $(AGENT_NPM) ..."; \
	  npm install --prefix $(AGENTS)/npm --no-audit --no-fund --loglevel=error $(AGENT_NPM) >/dev/null || exit 1; \
	else echo "npm (Node.js) is not installed: the Claude Code, Codex and opencode tests will skip"; fi
	@echo "==> installing $(AIDER_SPEC) in $(AGENTS)/aider (its own environment) ..."
	@test -x $(AGENTS)/aider/bin/python || $(PYTHON) -m venv $(AGENTS)/aider
	@$(AGENTS)/aider/bin/python -m pip install -qq --no-compile --disable-pip-version-check $(AIDER_SPEC)
	@touch $@

$(V41_ORACLE_STAMP):
	@rm -f $(V41_ORACLE)/.installed-*
	@echo "==> installing $(V41_ORACLE_SPEC) in $(V41_ORACLE) (the DeepSeek-V4.1 oracle, its own environment) ..."
	@test -x $(V41_ORACLE)/bin/python || $(PYTHON) -m venv $(V41_ORACLE)
	@$(V41_ORACLE)/bin/python -m pip install -qq --no-compile --no-deps --disable-pip-version-check \
	  --extra-index-url https://download.pytorch.org/whl/cpu --retries 1 --timeout 15 \
	  $(V41_ORACLE_SPEC) $(V41_ORACLE_DEPS)
	@$(V41_ORACLE)/bin/python -m compileall -qq -j 0 \
	  "$$($(V41_ORACLE)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" || true
	@touch $@

v41-oracle: $(V41_ORACLE_STAMP)

agents: $(AGENTS_STAMP)

serve: $(STAMP)
	$(VENV)/bin/v4serve serve $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# What the tests need is installed side by side (the agent CLIs beside torch and the packages: a minute or
# more less on a fresh clone than one after the other), then linted, then run.
test:
	@$(MAKE) --no-print-directory -j3 $(STAMP) prometheus agents image-tools v41-oracle
	@$(MAKE) --no-print-directory lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(ARGS)

bench: $(STAMP)
	$(PY) bench/bench_model.py
	$(PY) bench/bench_cache.py
	$(PY) bench/bench_serve.py
	$(PY) bench/bench_store.py
	$(PY) bench/bench_long_context.py
	$(PY) bench/bench_structured.py
	$(PY) bench/bench_load.py --hostile
	$(PY) bench/bench_spec.py
	$(PY) bench/bench_conversations.py
	$(PY) bench/bench_launches.py
	$(PY) bench/bench_kv_fp8.py
	$(PY) bench/bench_weights.py
	$(PY) bench/bench_host.py --gc
	$(PY) bench/bench_pd.py

clean:
	rm -rf $(VENV) $(AGENTS) $(V41_ORACLE) *.egg-info .pytest_cache .ruff_cache
