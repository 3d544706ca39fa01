"""Sampler, SamplingParams validation and StopMatcher, against numpy references."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
import pytest

from actors.sampler import Sampler
from actors.sampling_params import SamplingParams
from actors.text_stream import StopMatcher, TextStream

if TYPE_CHECKING:  # at run time imported by the fixture: it pulls in transformers and torch
    from mlx_lm.tokenizer_utils import TokenizerWrapper

VOCAB = 64


def _logits(seed: int = 0, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, vocab).astype(np.float32)


def _draw(params: SamplingParams, logits: np.ndarray, n: int) -> list[int]:
    s = Sampler(params, len(logits))
    x = mx.array(logits)
    return [s.sample(x) for _ in range(n)]


# --- greedy and determinism -------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    for seed in range(5):
        lg = _logits(seed)
        s = Sampler(SamplingParams(temperature=0.0), VOCAB)
        assert s.sample(mx.array(lg)) == int(np.argmax(lg))


def test_greedy_accepts_batch_of_one_and_other_dtypes() -> None:
    lg = _logits(3)
    s = Sampler(SamplingParams(temperature=0.0), VOCAB)
    assert s.sample(mx.array(lg[None, :]).astype(mx.bfloat16)) == int(np.argmax(lg))


def test_wrong_logits_shape_is_named() -> None:
    s = Sampler(SamplingParams(), VOCAB)
    with pytest.raises(ValueError, match=r"logits must have shape \[64\]"):
        s.sample(mx.zeros((VOCAB + 1,)))


def test_same_seed_same_tokens_different_seed_different() -> None:
    flat = np.zeros(VOCAB, dtype=np.float32)
    a = _draw(SamplingParams(seed=1234), flat, 40)
    # Unrelated RNG use in between must not change a seeded run.
    mx.random.seed(99)
    mx.random.uniform(shape=(10,))
    b = _draw(SamplingParams(seed=1234), flat, 40)
    c = _draw(SamplingParams(seed=4321), flat, 40)
    assert a == b
    # 40 draws from 64 equally likely tokens: identical sequences by chance ~ 64**-40.
    assert a != c
    assert len(set(a)) > 10  # the flat distribution is really being sampled


def test_unseeded_sampler_reports_drawn_seed_and_replays() -> None:
    flat = np.zeros(VOCAB, dtype=np.float32)
    s = Sampler(SamplingParams(), VOCAB)
    first = [s.sample(mx.array(flat)) for _ in range(20)]
    replay = _draw(SamplingParams(seed=s.seed), flat, 20)
    assert first == replay


def test_sampling_follows_distribution() -> None:
    # Two tokens with p = 0.8 / 0.2 (everything else ~0); 400 draws.
    lg = np.full(VOCAB, -1e9, dtype=np.float32)
    lg[5], lg[9] = np.log(0.8), np.log(0.2)
    toks = _draw(SamplingParams(seed=7), lg, 400)
    assert set(toks) == {5, 9}
    frac = toks.count(5) / len(toks)
    assert 0.7 < frac < 0.9  # ~5 sigma band around 0.8


# --- filters ---------------------------------------------------------------------------


def test_top_k_one_equals_greedy() -> None:
    for seed in range(5):
        lg = _logits(seed)
        toks = _draw(SamplingParams(top_k=1, seed=seed), lg, 10)
        assert toks == [int(np.argmax(lg))] * 10


def test_tiny_top_p_equals_greedy() -> None:
    for seed in range(5):
        lg = _logits(seed)
        toks = _draw(SamplingParams(top_p=1e-6, seed=seed), lg, 10)
        assert toks == [int(np.argmax(lg))] * 10


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_top_k_keeps_exactly_the_k_largest() -> None:
    lg = _logits(1)
    out = np.array(Sampler(SamplingParams(top_k=5), VOCAB).process(mx.array(lg)))
    kept = set(np.flatnonzero(np.isfinite(out)).tolist())
    assert kept == set(np.argsort(-lg)[:5].tolist())
    np.testing.assert_allclose(out[sorted(kept)], lg[sorted(kept)], rtol=1e-6)


def test_top_p_matches_numpy_nucleus() -> None:
    lg = _logits(2)
    p = 0.6
    out = np.array(Sampler(SamplingParams(top_p=p, temperature=0.7), VOCAB).process(mx.array(lg)))
    probs = _softmax(lg / 0.7)
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    n_keep = int(np.searchsorted(cum, p) + 1)  # smallest prefix with mass >= p
    assert set(np.flatnonzero(np.isfinite(out)).tolist()) == set(order[:n_keep].tolist())
    assert n_keep > 1  # the case is not trivially greedy


def test_min_p_matches_numpy() -> None:
    lg = _logits(4)
    mp = 0.1
    out = np.array(Sampler(SamplingParams(min_p=mp), VOCAB).process(mx.array(lg)))
    probs = _softmax(lg)
    expected = set(np.flatnonzero(probs >= mp * probs.max()).tolist())
    assert set(np.flatnonzero(np.isfinite(out)).tolist()) == expected
    assert 1 < len(expected) < VOCAB
    toks = _draw(SamplingParams(min_p=mp, seed=3), lg, 100)
    assert set(toks) <= expected


def test_temperature_scales_logits() -> None:
    lg = _logits(5)
    out = np.array(Sampler(SamplingParams(temperature=0.5), VOCAB).process(mx.array(lg)))
    np.testing.assert_allclose(out, lg / 0.5, rtol=1e-6)


# --- penalties -------------------------------------------------------------------------


def _reference_penalties(
    lg: np.ndarray, prompt: list[int], generated: list[int], rep: float, freq: float, pres: float
) -> np.ndarray:
    out = lg.astype(np.float32).copy()
    for t in set(prompt) | set(generated):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(generated):
        out[t] -= generated.count(t) * freq + pres
    return out


def test_penalties_match_numpy_reference() -> None:
    lg = _logits(6)
    prompt = [1, 2, 3, 3]
    generated = [3, 7, 7, 7, 10]
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25
    )
    s = Sampler(params, VOCAB, prompt_tokens=prompt)
    for t in generated:
        s.record(t)
    x = mx.array(lg)
    got = np.array(s.apply_penalties(x))
    want = _reference_penalties(lg, prompt, generated, 1.3, 0.5, 0.25)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    untouched = [i for i in range(VOCAB) if i not in {1, 2, 3, 7, 10}]
    np.testing.assert_array_equal(got[untouched], lg[untouched])
    # Presence/frequency act on generated tokens only: prompt-only ids 1, 2 differ from the
    # raw logits by the repetition penalty alone.
    np.testing.assert_allclose(got[[1, 2]], want[[1, 2]], rtol=1e-6)
    np.testing.assert_array_equal(np.array(x), lg)  # the caller's array is not modified


def test_sample_records_its_tokens_for_penalties() -> None:
    # A strong frequency penalty under greedy: the top token gets penalised after being
    # picked, so greedy moves on to the next one.
    lg = np.zeros(VOCAB, dtype=np.float32)
    lg[4], lg[8] = 1.0, 0.5
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=2.0), VOCAB)
    x = mx.array(lg)
    assert [s.sample(x) for _ in range(2)] == [4, 8]
    assert s.num_generated == 2


def test_repetition_penalty_negative_logit_is_multiplied() -> None:
    lg = np.full(VOCAB, -1.0, dtype=np.float32)
    lg[0] = 2.0
    s = Sampler(SamplingParams(repetition_penalty=2.0), VOCAB, prompt_tokens=[0, 1])
    got = np.array(s.apply_penalties(mx.array(lg)))
    assert got[0] == pytest.approx(1.0) and got[1] == pytest.approx(-2.0)
    assert got[2] == pytest.approx(-1.0)


def test_stop_token_ids_and_bad_token_ids() -> None:
    s = Sampler(SamplingParams(stop_token_ids=(3, 5)), VOCAB)
    assert s.is_stop_token(5) and not s.is_stop_token(4)
    with pytest.raises(ValueError, match="token id 64 outside vocab"):
        s.record(VOCAB)


# --- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": 5}, "temperature must be in [0, 2], got 5"),
        ({"temperature": -0.1}, "temperature must be in [0, 2]"),
        ({"temperature": float("nan")}, "temperature must be in [0, 2]"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1 or unset (0 only with prompt logprobs)"),
        ({"stop": ("",)}, "stop must not contain an empty string"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids must be >= 0"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias must be in [-100, 100]"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias token ids must be >= 0"),
        ({"logprobs": 21}, "logprobs must be in [0, 20]"),
        ({"constraint": "json"}, "constraint is a grammar object the server sets"),
    ],
)
def test_validation_names_the_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_defaults_follow_openai() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)
    assert not p.greedy and SamplingParams(temperature=0).greedy


# --- stop strings ----------------------------------------------------------------------


def _stream(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    m = StopMatcher(stops)
    pieces = []
    stopped = False
    for d in deltas:
        out, stopped = m.feed(d)
        pieces.append(out)
        if stopped:
            break
    if not stopped:
        pieces.append(m.flush())
    return "".join(pieces), stopped, pieces


def test_stop_string_split_across_deltas() -> None:
    text, stopped, pieces = _stream(["</end>"], ["Hello wor", "ld</", "en", "d> trailing"])
    assert stopped and text == "Hello world"
    # Nothing that might begin the stop string is emitted early.
    assert all("<" not in p for p in pieces)


def test_false_start_is_released() -> None:
    text, stopped, pieces = _stream(["STOP"], ["a S", "T", "x b", " c"])
    assert not stopped and text == "a STx b c"
    assert pieces[:2] == ["a ", ""]  # "S", then "ST" held back until "x" rules them out


def test_held_text_flushed_at_end() -> None:
    text, stopped, _ = _stream(["###"], ["answer #", "#"])
    assert not stopped and text == "answer ##"


def test_earliest_of_several_stops_wins() -> None:
    text, stopped, _ = _stream(["world", "lo"], ["hello world"])
    assert stopped and text == "hel"
    m = StopMatcher(["xyz", "b"])
    assert m.feed("abxyz") == ("a", True) and m.matched == "b"
    assert m.feed("more") == ("", True) and m.flush() == ""


def test_stop_inside_one_delta_and_no_stops() -> None:
    assert _stream(["\n\n"], ["one\n\ntwo"])[:2] == ("one", True)
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)


def test_stop_overlapping_prefixes() -> None:
    # "aab": after "aa" the matcher must still find "aab" starting one char later.
    text, stopped, _ = _stream(["aab"], ["xa", "a", "ab!"])
    assert stopped and text == "xa"


# --- streaming detokenizer glue ----------------------------------------------------------


@pytest.fixture(scope="module")
def byte_tokenizer() -> TokenizerWrapper:
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # One token per byte (no merges): multi-byte characters always span several tokens.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok))


def _run_stream(
    tokenizer: TokenizerWrapper, text: str, stops: tuple[str, ...] = ()
) -> tuple[list[str], str | None, TextStream]:
    stream = TextStream(tokenizer.detokenizer, stops=stops)
    deltas = []
    reason = None
    for t in tokenizer.encode(text):
        out, reason = stream.add(t)
        deltas.append(out)
        if reason:
            break
    if reason is None:
        deltas.append(stream.finish())
    return deltas, stream.finish_reason, stream


def test_text_stream_whole_characters_only(byte_tokenizer: TokenizerWrapper) -> None:
    text = "héllo 🙂 wörld"
    deltas, reason, stream = _run_stream(byte_tokenizer, text)
    assert reason == "length" and "".join(deltas) == text == stream.text
    assert all("\ufffd" not in d for d in deltas)


def test_text_stream_stop_string_across_multibyte_tokens(byte_tokenizer: TokenizerWrapper) -> None:
    deltas, reason, stream = _run_stream(
        byte_tokenizer, "answer: 42 🙂 END more", stops=("🙂 END",)
    )
    assert reason == "stop" and stream.text == "answer: 42 "
    assert "".join(deltas) == stream.text
    assert stream.add(5) == ("", "stop")  # nothing after the end


def test_text_stream_stop_token_flushes_held_text(byte_tokenizer: TokenizerWrapper) -> None:
    ids = byte_tokenizer.encode("ab#")
    stop_id = byte_tokenizer.encode("!")[0]
    stream = TextStream(byte_tokenizer.detokenizer, stops=["##"], stop_token_ids=[stop_id])
    outs = [stream.add(t) for t in ids]
    assert outs[-1] == ("", None)  # "#" held: it may start "##"
    assert stream.add(stop_id) == ("#", "stop")
    assert stream.text == "ab#" and stream.finish() == ""
