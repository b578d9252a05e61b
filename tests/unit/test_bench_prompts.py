"""Prompts of exact token counts, with a tokenizer that adds a BOS token and one that does not."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from controller.bench.runner import add_slo_args, run_config
from controller.load.options import add_workload_args, build_specs
from controller.load.prompts import _WORDS as WORDS
from controller.load.prompts import PromptBuilder, TokenizerError, load_tokenizer, tokenizer_path
from controller.load.workload import WorkloadError


def _word_tokenizer(path: Path, bos: bool) -> Path:
    vocab = {"<unk>": 0, "<s>": 1, **{str(i): 2 + i for i in range(10)}}
    for w in sorted(set(WORDS)):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("bos", [False, True])
def test_prompts_have_the_exact_count(tmp_path: Path, bos: bool) -> None:
    tok = load_tokenizer(_word_tokenizer(tmp_path / "tok", bos))
    builder = PromptBuilder(tok, seed=1)
    for index in range(30):
        for n in (2, 3, 17, 256):
            text, count = builder.build(index, n)
            assert count == n and len(tok.encode(text)) == n
    assert builder.build(1, 20)[0] != builder.build(2, 20)[0]  # no shared prompt between requests


def test_tiny_model_prompts(tmp_path: Path) -> None:
    tiny = Path(__file__).resolve().parents[2] / "models" / "tiny"
    if not (tiny / "tokenizer.json").is_file():
        pytest.skip("the tiny model is not built")
    builder = PromptBuilder(load_tokenizer(tiny))
    assert all(builder.build(i, n)[1] == n for i in range(20) for n in (1, 40, 700))


def test_tokenizer_path_errors(tmp_path: Path) -> None:
    assert tokenizer_path(tmp_path, "whatever") == tmp_path
    assert tokenizer_path(None, str(tmp_path)) == tmp_path
    with pytest.raises(TokenizerError, match="pass --tokenizer"):
        tokenizer_path(None, "meta-llama/Llama-3.1-8B")
    with pytest.raises(TokenizerError, match="no such directory"):
        load_tokenizer(tmp_path / "missing")


def _ns(**kw: object) -> argparse.Namespace:
    base = dict(rate=None, duration=None, prompt_tokens=100, output_tokens=50, trace=None, start=0.0,
                time_scale=1.0, token_scale=1.0, sharegpt=False, sharegpt_samples=10, priority_mix=None,
                max_requests=None, seed=0, workload=None, requests=128)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_build_specs_choices(tmp_path: Path) -> None:
    tok = load_tokenizer(_word_tokenizer(tmp_path / "tok", bos=False))
    specs = build_specs(_ns(rate=5.0, duration=10.0, priority_mix="0:0.5,1:0.5", max_requests=20), tok, 120)
    assert len(specs) == 20 and {s.priority for s in specs} == {0, 1}
    assert all((s.prompt_tokens, s.output_tokens) == (70, 50) for s in specs)  # clamped to 120 in all
    with pytest.raises(WorkloadError, match="choose exactly one workload"):
        build_specs(_ns(), tok, 100)
    with pytest.raises(WorkloadError, match="needs --rate R and --duration S"):
        build_specs(_ns(rate=1.0), tok, 100)


def test_the_closed_workload_sends_every_request_at_once_under_the_concurrency_cap() -> None:
    parser = argparse.ArgumentParser()
    add_workload_args(parser)
    add_slo_args(parser)
    args = parser.parse_args(
        ["--workload", "closed", "--requests", "5", "--output-tokens", "16", "--concurrency", "2"]
    )
    specs = build_specs(args, None, 2048)  # type: ignore[arg-type]  # closed needs no tokenizer
    assert [(s.arrival_s, s.prompt_tokens, s.output_tokens) for s in specs] == [(0.0, 128, 16)] * 5
    assert run_config(args, None).concurrency == 2  # type: ignore[arg-type]
