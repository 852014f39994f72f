# Both targets create .venv on first use (CPU torch 2.13.0 from the machine's disk / PyPI, then moecomp[test]).
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.ready: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

.PHONY: demo test
demo: $(VENV)/.ready
	$(PY) -m moecomp demo

# two workers (pytest-xdist; CI has 2 cores), each taking tests from the other when idle (8m53s here, 9m36s by files)
test: $(VENV)/.ready
	$(PY) -m pytest -q -n 2 --dist worksteal
