# Two commands do all set-up on a fresh machine:
#   make demo   # set up (first time: builds Horovod, ~7 min) and run the main job
#   make test   # set up and run the test suite
PY := .venv/bin/python

.PHONY: setup demo test bench clean
setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m lightning_straggler.train $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

bench: setup
	$(PY) -m benchmarks.ring_vs_plain $(ARGS)

# benchmarks/results holds committed results: clean removes only what git ignores there
clean:
	rm -rf .venv outputs multirun lightning_logs
	git clean -fdXq benchmarks/results 2>/dev/null || true
