# The two commands a user needs (README): `make demo` and `make test`. Both set up first.
PY := .venv/bin/python
.PHONY: setup demo test unit lint bench

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

unit: setup
	$(PY) -m pytest -q tests/unit

lint: setup
	.venv/bin/ruff check agent exporters analyzers tests bench examples
	.venv/bin/mypy agent exporters analyzers

bench: setup
	$(PY) bench/overhead.py
