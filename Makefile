# Two commands do all set-up on a fresh machine: `make serve` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
SPIN := $(VENV)/bin/spin
# CPU build of torch, installed before anything that depends on torch (else pip pulls CUDA builds).
TORCH ?= torch==2.13.0

.PHONY: setup demo serve redis tools test test-busy train report proto clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

## The main job: the whole system on this machine (verifier, drafters, router, redis-server).
serve: setup
	$(SPIN) serve

## No services: the target streaming held-out prompts, with per-drafter acceptance.
demo: setup
	$(SPIN) demo

## The service tests start their own redis-server on a loopback port (Debian package).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis:
	@command -v redis-server >/dev/null || $(SUDO) apt-get install -y -q redis-server \
		|| ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q redis-server)

## helm, promtool and the dashboard/CRD type checkers for the deployment tests, into build/tools.
tools:
	scripts/deploy-tools.sh

## Every check, the test files spread over TEST_WORKERS processes (0: one process): all but the
## timing-sensitive ones, then those on a busy machine (test-busy).
## pytest's exit code 5 (no tests collected) is a failure too.
TEST_WORKERS ?= 2
test: setup redis tools
	@$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not timing" --durations=25; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: no tests were collected" >&2; exit 1; fi; exit $$rc
	@$(MAKE) --no-print-directory test-busy

## The tests marked `timing` (deadlines, latency bounds) while two other processes keep every
## core busy: a test that passes only on an idle CPU fails here.
test-busy: setup redis tools
	@$(PY) -c 'while True: pass' & b1=$$!; $(PY) -c 'while True: pass' & b2=$$!; \
	trap 'kill $$b1 $$b2' EXIT; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m timing; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-busy: no tests were collected" >&2; exit 1; fi; exit $$rc

## Rebuild the demo family from scratch (corpus, tokenizer, models): about 90 minutes on 2 cores.
train: setup
	$(SPIN) zoo train --force

## Re-measure the acceptance table and write it into models/demo/README.md.
report: setup
	$(SPIN) zoo report --prompts 48 --json build/zoo-report.json --readme models/demo/README.md

## Regenerate the Python code of proto/spin/v1 into services/spin/v1 (committed; the tests check drift).
proto: setup
	$(PY) -m grpc_tools.protoc -Iproto --python_out=services --pyi_out=services \
		--grpc_python_out=services proto/spin/v1/*.proto

clean:
	rm -rf $(VENV) build .pytest_cache
