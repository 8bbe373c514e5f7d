# The two entry points of the README: each does all set-up itself (idempotent, cached).
.PHONY: setup demo test test-large lint crds train-demo

setup:
	scripts/setup.sh

demo: setup
	.venv/bin/python scripts/demo.py

test: setup lint
	.venv/bin/python -m pytest

test-large: setup
	.venv/bin/python -m pytest -m large

lint: setup
	.venv/bin/ruff check

train-demo: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m lorajob_trainer.demo --out out/train-demo

crds:
	.venv/bin/python -m lorajob_operator.crd
	.venv/bin/python -m lorajob_operator.policy_crd
