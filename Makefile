# jaxserve: `make demo` and `make test` work on a fresh machine; both create .venv first.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv demo test fixtures clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || { python=$$(scripts/find_python.sh) && echo "creating $(VENV) with $$python" && $$python -m venv $(VENV); }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

demo: venv
	$(VENV)/bin/jaxserve generate --prompt "12+34=" --prompt "999+1=" --prompt "505+250=" --prompt "7+8="

# Two workers (one per core of the CI machine); a test file stays in one worker, so its module fixtures
# (engines) are built once, and files whose engines share compiled programs run in one worker, heaviest
# first (tests/compile_groups.py). The 15 slowest tests are listed at the end (the suite's budget is about
# 5 minutes on 2 cores).
test: venv
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15

# Regenerate the Hugging Face reference fixtures (needs PyTorch + transformers; see tests/fixtures/hf/README.md).
fixtures:
	python3.11 -m venv /tmp/venv-fixtures && /tmp/venv-fixtures/bin/pip install torch==2.13.0 transformers safetensors numpy
	/tmp/venv-fixtures/bin/python scripts/make_hf_fixtures.py
	/tmp/venv-fixtures/bin/python scripts/make_chat_template_fixtures.py

clean:
	rm -rf $(VENV) build *.egg-info
