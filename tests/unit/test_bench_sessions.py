"""The shared-prefix workload: system prompts shared by sessions whose turns re-send their history."""

from __future__ import annotations

import argparse
import itertools
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from controller.load.options import build_specs
from controller.load.prompts import _WORDS as WORDS
from controller.load.prompts import PromptBuilder, load_tokenizer
from controller.load.sessions import SharedPrefix, shared_prefix, within
from controller.load.workload import RequestSpec, WorkloadError

SHAPE = SharedPrefix(
    system_prompts=3, system_tokens=200, turns=4, user_tokens=40, output_tokens=60, think_s=2.0
)


def sessions(specs: list[RequestSpec]) -> list[list[RequestSpec]]:
    """The specs grouped by session: a turn's first user segment names its session."""
    by_first: dict[int, list[RequestSpec]] = {}
    for s in specs:
        by_first.setdefault(s.segments[1][0], []).append(s)
    return [sorted(turns, key=lambda s: len(s.segments)) for turns in by_first.values()]


def test_every_prompt_opens_with_one_of_the_shared_system_prompts() -> None:
    specs = shared_prefix(2.0, 60.0, SHAPE, seed=3)
    firsts = Counter(s.segments[0] for s in specs)
    assert set(firsts) == {(0, 200), (1, 200), (2, 200)}
    assert all(s.prompt_tokens == sum(n for _, n in s.segments) for s in specs)


def test_each_turn_re_sends_the_previous_prompt_and_its_answer() -> None:
    specs = shared_prefix(2.0, 60.0, SHAPE, seed=3)
    groups = sessions(specs)
    assert all(len(turns) == 4 for turns in groups)
    for turns in groups:
        for before, after in itertools.pairwise(turns):
            # prompt k+1 = prompt k + (answer k, its length) + a new user text
            assert after.segments[: len(before.segments)] == before.segments
            answer = after.segments[len(before.segments)]
            assert answer[1] == before.output_tokens
            assert after.prompt_tokens == before.prompt_tokens + before.output_tokens + after.segments[-1][1]
            assert after.arrival_s >= before.arrival_s


def test_the_load_runs_at_about_the_rate_in_arrival_order() -> None:
    specs = shared_prefix(2.0, 600.0, SHAPE, seed=1)
    starts = [s for s in specs if len(s.segments) == 2]  # first turns
    assert len(starts) * SHAPE.turns == len(specs)
    assert 0.85 < len(starts) / 600.0 / (2.0 / SHAPE.turns) < 1.15
    assert [s.index for s in specs] == list(range(len(specs)))
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    assert all(20 <= s.segments[-1][1] <= 60 and 30 <= s.output_tokens <= 90 for s in specs)


def test_the_same_seed_gives_the_same_workload_and_another_a_different_one() -> None:
    assert shared_prefix(2.0, 60.0, SHAPE, seed=5) == shared_prefix(2.0, 60.0, SHAPE, seed=5)
    assert shared_prefix(2.0, 60.0, SHAPE, seed=5) != shared_prefix(2.0, 60.0, SHAPE, seed=6)


def test_a_bad_shape_is_refused_with_the_options_to_fix() -> None:
    with pytest.raises(WorkloadError, match="--turns 0"):
        shared_prefix(1.0, 10.0, SharedPrefix(turns=0))


def test_segments_are_cut_to_a_clamped_prompt() -> None:
    assert within(((0, 100), (5, 30), (6, 20)), 120) == ((0, 100), (5, 20))
    assert within(((0, 100),), 300) == ((0, 100),)


def _args(**kw: object) -> argparse.Namespace:
    base = dict(rate=2.0, duration=30.0, prompt_tokens=100, output_tokens=60, trace=None, start=0.0,
                time_scale=1.0, token_scale=1.0, sharegpt=False, sharegpt_samples=10, priority_mix=None,
                max_requests=None, seed=0, workload="shared-prefix", requests=128, system_prompts=3,
                system_tokens=200, turns=4, user_tokens=40, think_s=2.0)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_bench_options_choose_the_shared_prefix_workload_with_its_rate() -> None:
    specs = build_specs(_args(), None, 4096)  # type: ignore[arg-type]  # needs no tokenizer
    assert specs == shared_prefix(2.0, 30.0, SHAPE)
    with pytest.raises(WorkloadError, match="needs --rate R"):
        build_specs(_args(rate=None), None, 4096)  # type: ignore[arg-type]


def _word_tokenizer(path: Path) -> Path:
    vocab = {"<unk>": 0, **{str(i): 1 + i for i in range(10)}}
    for w in sorted(set(WORDS)):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(True)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_the_client_sends_the_same_text_for_the_same_segments(tmp_path: Path) -> None:
    tok = load_tokenizer(_word_tokenizer(tmp_path / "tok"))
    builder = PromptBuilder(tok, seed=1)
    a = RequestSpec(0, 0.0, 250, 8, segments=((0, 200), (10, 50)))
    b = RequestSpec(1, 0.0, 250, 8, segments=((0, 200), (12, 50)))
    later = RequestSpec(2, 0.0, 330, 8, segments=((0, 200), (10, 50), (11, 80)))
    text_a, count_a = builder.for_spec(a)
    text_b, _ = builder.for_spec(b)
    system = builder.build(1 << 40, 200)[0]
    assert text_a.startswith(system + "\n") and text_b.startswith(system + "\n")
    assert text_a != text_b
    assert builder.for_spec(later)[0].startswith(text_a + "\n")  # the history is re-sent as it was
    assert count_a == 250
    plain = RequestSpec(3, 0.0, 40, 8)
    assert builder.for_spec(plain) == builder.build(3, 40)
