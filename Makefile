# Both targets create .venv on first use (CPU torch 2.13.0 from the machine's disk / PyPI, then moecomp[test]).
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.ready: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: demo test test-oldest compile-t36
demo: $(VENV)/.ready
	$(PY) -m moecomp demo

# two workers (pytest-xdist; CI has 2 cores), each taking tests from the other when idle (8m53s here, 9m36s by files)
test: $(VENV)/.ready
	$(PY) -m pytest -q -n 2 --dist worksteal

# The oldest supported transformers (README): the HF family tests and the cheap version-sensitive ones (experts
# interface, implementation switch, FP8 / MXFP4 loading, Inkling, the router probe; their compile and peak-memory
# tests left to `make test`) on transformers 5.17. The side venv holds only transformers 5.17 and what it wants in other versions than .venv has;
# everything else, torch 2.13.0 included, comes from .venv through a site dir (a second torch install took 3 minutes
# here). About 3 minutes in all on 2 cores.
OLDEST := .venv-oldest
$(OLDEST)/.ready: $(VENV)/.ready
	$(PY) -m venv --clear $(OLDEST)
	$(PY) -c 'import site; print(f"import site; site.addsitedir({site.getsitepackages()[0]!r})")' \
		> "$$($(OLDEST)/bin/python -c 'import site; print(site.getsitepackages()[0])')/moecomp_main_venv.pth"
	$(OLDEST)/bin/python -m pip install -q transformers==5.17.0
	touch $@

test-oldest: $(OLDEST)/.ready
	$(OLDEST)/bin/python -c 'import transformers, torch; print("transformers", transformers.__version__, "torch", torch.__version__)'
	$(OLDEST)/bin/python -m pytest -q -n 2 --dist worksteal -k "not compile_backend and not peak_memory" \
		tests/hf/test_families.py tests/hf/test_experts_interface.py tests/hf/test_impl_switch.py \
		tests/hf/test_mxfp4.py tests/hf/test_fp8.py tests/hf/test_inkling.py tests/hf/test_router_probe.py

# The GPU machine's Triton (3.6): the offline sm_90 compile tests (Gluon FP8 GEMMs, the decode kernels) with a
# Triton 3.6 venv, $(T36) (default /work/venv_t36: triton 3.6.0 over .venv's packages), where it exists. Not in CI.
T36 ?= /work/venv_t36
compile-t36:
	@if [ -x "$(T36)/bin/python" ]; then \
		PYTHONPATH=$(CURDIR) $(T36)/bin/python -m pytest -q -p no:cacheprovider -n 0 \
			tests/kernels/test_gluon_fp8_compile.py tests/kernels/test_gluon_fp8_gemm1_compile.py \
			tests/kernels/test_gluon_fp8_launch_offline.py tests/kernels/test_sm90_compile*.py; \
	else echo "no Triton 3.6 venv at $(T36) (set T36=...): skipped"; fi
