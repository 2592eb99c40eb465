.PHONY: setup serve test lint bench
setup:
	./scripts/setup.sh
serve:
	./scripts/serve.sh $(ARGS)
test:
	./scripts/test.sh $(ARGS)
lint:
	./scripts/setup.sh && .venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy
