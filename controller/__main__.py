"""``python -m controller``. vLLM on the CPU starts its EngineCore with ``spawn``: keep the guard."""

import sys

from controller.cli import main

if __name__ == "__main__":
    sys.exit(main())
