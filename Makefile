# Two commands do all the set-up on a fresh machine (see README.md):
#   make run    install everything, build the models if missing, run the daemon on config.toml
#   make test   install everything, build the models if missing, install chromium (the status page's
#               browser test) if missing, run lint, types and all tests
# The `fleet` extra brings vllm-router, which the fleet's integration test runs in front of two daemons.
# The models: models/smollm2 (the real instruct model config.toml serves, converted from a PyPI wheel)
# and models/tiny (the random-weight model of the fast tests).
#
# Outside a machine whose pip already finds a `+cpu` torch, point pip at PyTorch's CPU wheels:
#   make run PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# On a GPU host: make run EXTRAS=gpu CONFIG=/etc/vllm-autopilot/config.toml

PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= cpu,test,models,fleet
CONFIG ?= config.toml
MODELS ?= models
PYTEST_ARGS ?=
export PIP_EXTRA_INDEX_URL

comma := ,
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: run test install model lint browser house clean

run: install model
	$(BIN)/vllm-autopilot serve --config $(CONFIG)

test: install model lint browser
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The status page's browser test (tests/integration/test_status_browser.py) drives Debian's chromium
# headless; where apt-get cannot install it (no root, no network) that one test skips and says why.
browser:
	command -v chromium >/dev/null 2>&1 || { apt-get update && apt-get install -y --no-install-recommends chromium; } \
	  || echo "chromium not installed: the status page's browser test will be skipped"

lint: install
	$(BIN)/ruff check controller policies tests tools
	$(BIN)/ruff format --check controller policies tests tools
	$(BIN)/mypy
	$(BIN)/python tools/house.py --check

# The shape of the house: import circles (imports inside functions count), the largest modules, the
# `# fmt: skip` lines (ARCHITECTURE.md's rules); it prints, it never fails.
house:
	$(PYTHON) tools/house.py

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[$(EXTRAS)]'
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load beside a CPU torch,
	# and transformers imports torchvision when present, which breaks `import vllm`; vLLM does not
	# need them to serve text models.
	case "$(EXTRAS)" in *cpu*) $(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec ;; esac
	touch $@

model: install
	$(BIN)/vllm-autopilot make-model tiny $(MODELS)/tiny --if-missing
	# the conversion's packages come with the `models` extra (a GPU host serves its own model)
	case "$(EXTRAS)" in *models*) $(BIN)/vllm-autopilot make-model smollm2 $(MODELS)/smollm2 --if-missing ;; esac

clean:
	rm -rf $(VENV) $(MODELS)/tiny $(MODELS)/smollm2
