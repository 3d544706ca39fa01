"""Every config key with a value it must refuse: one ConfigError naming the key, the value
and (for numbers) the whole range, from a dict, a TOML file and `--set` alike; and the
CLI turns each into one `error:` line and exit 2, before any work.

The keys come from the config's own types (`msgspec.inspect`), so a key added later is
fuzzed too; the ranges from the same annotations the loader checks (actors.bounds).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.bounds import range_at
from pipeline.cli import main
from pipeline.config.errors import ConfigError
from pipeline.config.loading import config_from_dict, load_config
from pipeline.config.schema import PipelineConfig
from pipeline.config.toml import dumps_toml, dumps_value

REPO = Path(__file__).resolve().parents[1]
BASE = {"model": {"path": "synth:demo"}}
# Keys whose upper bound is not this test's to hold (none now: reader.concurrency, once
# unbounded above, is `int | "auto"` within [1, MAX_READERS]).
UNBOUNDED_ABOVE: set[tuple[str, ...]] = set()


def _leaves(t: mi.Type, key: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], mi.Type]]:
    if isinstance(t, mi.StructType):
        return [leaf for f in t.fields for leaf in _leaves(f.type, (*key, f.name))]
    return [(key, t)]


LEAVES = [(k, t) for k, t in _leaves(mi.type_info(PipelineConfig)) if k != ("model", "path")]


def _numeric(t: mi.Type) -> mi.IntType | mi.FloatType | None:
    if isinstance(t, mi.UnionType):
        return next((u for u in t.types if isinstance(u, mi.IntType | mi.FloatType)), None)
    return t if isinstance(t, mi.IntType | mi.FloatType) else None


def _refused_values(key: tuple[str, ...], t: mi.Type) -> list[tuple[Any, bool]]:
    """Values this key must refuse, each with whether the refusal is its range's: past
    each bound, non-finite floats, wrong types."""
    out: list[tuple[Any, bool]] = [({"a": {"b": 1}}, False)]  # a table: wrong for every key
    num = _numeric(t)
    if num is None:
        return [*out, (1.5, False)]
    lo = num.ge if num.ge is not None else num.gt
    hi = num.le if num.le is not None else num.lt
    past: list[Any] = []
    if lo is not None:
        past += [lo - 1, lo - 10**6] if num.ge is not None else [lo, lo - 1]
    if hi is not None and key not in UNBOUNDED_ABOVE:
        past += [hi + 1, hi * 2 + 10**9] if num.le is not None else [hi, hi + 1]
    if isinstance(num, mi.FloatType):
        past = [float(v) for v in past] + [math.nan, math.inf, -math.inf]
    elif key not in UNBOUNDED_ABOVE:
        out.append((2**70, False))  # past int64: msgspec's own limit, still one clear line
    return out + [(v, True) for v in past]


CASES = [(k, v, ranged) for k, t in LEAVES for v, ranged in _refused_values(k, t)]
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _with(key: tuple[str, ...], value: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {s: dict(v) for s, v in BASE.items()}
    raw.setdefault(key[0], {})[key[1]] = value
    return raw


def _check_message(msg: str, key: tuple[str, ...], value: Any, ranged: bool) -> None:
    assert "\n" not in msg and "Traceback" not in msg, msg
    assert ".".join(key) in msg, (key, msg)
    rng = range_at(PipelineConfig, key)
    if ranged and rng is not None:
        assert rng in msg, (rng, msg)  # the whole range, not only the bound that failed
        assert dumps_value(value) in msg, msg


def test_every_numeric_key_has_a_range() -> None:
    # Sampling floats are checked by SamplingParams (the same checks as HTTP requests).
    sampling_checked = {"temperature", "top_p", "min_p", "presence_penalty",
                        "frequency_penalty", "repetition_penalty", "logprobs"}
    unbounded = [k for k, t in LEAVES if _numeric(t) is not None and range_at(PipelineConfig, k) is None
                 and not (k[0] == "sampling" and k[1] in sampling_checked)]
    assert unbounded == [], unbounded
    assert ("reader", "retries") in dict(LEAVES) and len(CASES) > 100


@FUZZ
@given(case=st.sampled_from(CASES), via=st.sampled_from(["dict", "toml", "set"]))
def test_a_refused_value_is_one_config_error_naming_key_value_and_range(tmp_path_factory, case, via) -> None:
    key, value, ranged = case
    with pytest.raises(ConfigError) as err:
        if via == "dict":
            config_from_dict(_with(key, value), check_paths=False)
        elif via == "toml":
            path = tmp_path_factory.getbasetemp() / "c.toml"
            path.write_text(dumps_toml(_with(key, value)))
            load_config(path, check_paths=False)
        else:
            config_from_dict(BASE, overrides=[f"{'.'.join(key)}={dumps_value(value)}"],
                             check_paths=False)
    _check_message(str(err.value), key, value, ranged)


@pytest.mark.parametrize("args, expected", [
    (["--set", "reader.retries=20"], "reader.retries: expected int in [0, 5], got 20"),
    (["--set", "reader.retry_backoff_ms=inf"], "reader.retry_backoff_ms: expected float in [0, 100], got inf"),
    (["--prefill-chunk", "-5"], "compute.prefill_chunk: expected int in [0, 65536], got -5"),
    (["--set", "sampling.logit_bias=[[-1, 5.0]]"], "sampling.logit_bias[0][0]: expected int in [0, "),
])
def test_cli_refuses_before_any_work(args, expected, capsys) -> None:
    # A container that does not exist: refusing the knob comes first, nothing is opened.
    assert main(["run", str(REPO / "config" / "demo.toml"), *args]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert expected in lines[0], lines[0]


def test_cli_refuses_bounded_arguments_and_bad_toml(tmp_path, capsys) -> None:
    nested = tmp_path / "nested.toml"
    nested.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    inline = tmp_path / "inline.toml"  # tomllib recursed past the limit: RecursionError
    inline.write_text("x = " + "{a = " * 3000 + "1" + "}" * 3000 + "\n")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\x00\xff\xfe\x00 not text")
    for argv, expected in (
        (["replay", "--workload", "qwen3-next-80b,requests=1000000000"],
         "requests must be in [1, 1024], got 1000000000"),
        (["replay", "--workload", "qwen3-next-80b,requests=1024,decode_tokens=65536"],
         "more than 65536 tokens in all"),
        (["info", str(tmp_path), "--prefill-chunk", "-5"], "prefill_chunk must be in [0, 65536], got -5"),
        (["config", str(nested)], f"{nested}: invalid TOML: arrays or tables nested too deeply"),
        (["run", str(inline)], f"{inline}: invalid TOML: arrays or tables nested too deeply"),
        (["config", str(binary)], f"{binary}: not UTF-8 text (byte 1 is 0xff)"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert expected in lines[0], lines[0]


def test_help_names_what_the_code_accepts(capsys) -> None:
    from pipeline.config.schema import EVICTION_POLICIES, PREFETCH_STRATEGIES

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in (*EVICTION_POLICIES, *PREFETCH_STRATEGIES):
        assert name in text, name
    assert "/v1/*" not in text and "on /metrics unless --metrics-without-key" in text


@pytest.mark.parametrize("argv, expected", [
    (["replay", "--workload", "qwen3-next-80b", "--slots", "0"], "--slots: expected an integer in [1, 16777216], got 0"),
    (["synth", "--preset", "tiny", "-o", "x", "--shard-mb", "0"], "--shard-mb: expected an integer in [1, 1048576], got 0"),
    (["bench", "x.qpack", "--max-tokens", "1000000000"], "--max-tokens: expected an integer in [1, 65536]"),
    (["bench", "x.qpack", "--case-timeout", "nan"], "--case-timeout: expected seconds in (0, 86400], got nan"),
])
def test_counts_no_config_key_checks_are_refused_by_the_parser(argv, expected, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert expected in capsys.readouterr().err
