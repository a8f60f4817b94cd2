# The two commands a user needs (README): `make demo` and `make test`. Both set up first (root).
# `make lint` and `make unit` need no root: they build .venv only when it is missing.
PY := .venv/bin/python
.PHONY: setup venv demo test unit lint bench install-service uninstall-service

setup:
	@bash scripts/setup.sh

# .venv without root, for lint and unit tests (no BCC: the eBPF tests need `make setup`)
venv: .venv/.sits-installed

.venv/.sits-installed: pyproject.toml
	@test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages .venv
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

demo: setup
	$(PY) examples/demo.py

# every test on the compiled hot path (setup builds it), then the unit tests again with the
# same modules interpreted (SITS_NATIVE=0: what runs where no compiler is)
test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests
	SITS_NATIVE=0 $(PY) -m pytest -q -p no:cacheprovider tests/unit

unit: venv
	$(PY) -m pytest -q tests/unit

lint: venv
	.venv/bin/ruff check agent exporters analyzers tests bench examples dashboards scripts
	.venv/bin/mypy --strict agent exporters analyzers scripts/build_native.py

bench: setup
	$(PY) bench/overhead.py

# the systemd unit (systemd/sits-trace.service, ExecStart at this checkout's .venv),
# /etc/sits-trace/config.toml if absent, enable and (re)start: docs/systemd.md
install-service: setup
	.venv/bin/sits-trace install-service

uninstall-service:
	.venv/bin/sits-trace uninstall-service
