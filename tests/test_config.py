"""Pipeline config: the shipped TOMLs load, and every kind of bad input is named precisely."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from pipeline.cli.config import register
from pipeline.config.errors import ConfigError
from pipeline.config.loading import load_config
from pipeline.config.schema import EVICTION_POLICIES, PREFETCH_STRATEGIES, PipelineConfig

CONFIG_DIR = Path(__file__).resolve().parent.parent / "config"


def _write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _error(path: Path, overrides: list[str] | dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    return str(err.value)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, PipelineConfig)
    assert cfg.pool.eviction in EVICTION_POLICIES
    assert cfg.prefetch.strategy in PREFETCH_STRATEGIES
    # The printed effective config is valid TOML that loads back to the same config.
    assert load_config(_write(tmp_path, cfg.to_toml(), path.name)) == cfg


def test_shipped_configs_are_the_expected_set() -> None:
    names = {p.name for p in CONFIG_DIR.glob("*.toml")}
    assert {"demo.toml", "qwen3-next-80b.toml", "qwen3.6-35b.toml"} <= names
    assert "prefetch-experiment.toml" in names
    exp = load_config(CONFIG_DIR / "prefetch-experiment.toml")
    assert exp.prefetch.strategy == "combined"
    assert set(exp.prefetch.combine) == {"next-gate", "transition"}
    assert exp.run.record_routing
    demo = load_config(CONFIG_DIR / "demo.toml")
    assert exp.model == demo.model
    assert demo.run.stats == "demo-data/demo-stats.json" and demo.prefetch.strategy == "next-gate"
    assert 2 <= len(demo.run.prompts) <= 3


def test_minimal_file_gets_defaults(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, '[model]\npath = "synth:tiny"\n'))
    assert cfg.model.path == "synth:tiny" and cfg.model.verify == "first-use"
    assert cfg.pool.budget_mb is None and cfg.pool.slots is None
    assert cfg.server.host == "127.0.0.1" and cfg.server.port == 8000
    assert cfg.server.shutdown_grace_s == 5.0
    assert cfg.compute.overlap is True
    assert cfg.sampling.temperature is None  # unset: the model's generation_config, then 1.0
    assert cfg.sampling.params().temperature == 1.0
    assert "server" in cfg.to_toml_dict() and "api_key" not in cfg.to_toml_dict()["server"]


def test_chat_message_prompts(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        '[model]\npath = "synth:tiny"\n[run]\n'
        'prompts = ["plain", [{role = "user", content = "hi"}]]\n',
    )
    cfg = load_config(p)
    assert cfg.run.prompts[0] == "plain"
    assert cfg.run.prompts[1][0].role == "user"  # type: ignore[union-attr]


# --- errors ----------------------------------------------------------------------------


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="config file not found: .*nope.toml"):
        load_config(Path("/nonexistent/nope.toml"))


def test_bad_toml_syntax_names_line(tmp_path: Path) -> None:
    p = _write(tmp_path, '[model]\npath = "synth:tiny"\n[pool]\nbudget_mb = = 3\n')
    msg = _error(p)
    assert str(p) in msg and "invalid TOML" in msg and "line 4" in msg


def test_unknown_key_with_suggestion_and_line(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        '# demo\n[model]\npath = "synth:tiny"\n\n[pool]\neviction = "lru"\nbudgt_mb = 5\n',
    )
    msg = _error(p)
    assert f"{p}: unknown key 'pool.budgt_mb' (line 7); did you mean 'budget_mb'?" in msg


def test_unknown_section_and_all_unknown_keys_reported(tmp_path: Path) -> None:
    p = _write(tmp_path, '[model]\npath = "synth:tiny"\nverfy = "off"\n[pol]\nslots = 3\n')
    msg = _error(p)
    assert "unknown key 'model.verfy' (line 3); did you mean 'verify'?" in msg
    assert "unknown key 'pol' (line 4); did you mean 'pool'?" in msg


def test_unknown_key_inside_chat_message(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        '[model]\npath = "synth:tiny"\n[run]\nprompts = [[{role = "user", text = "hi"}]]\n',
    )
    msg = _error(p)
    assert "unknown key 'run.prompts[0][0].text'" in msg and "(line 4)" in msg


def test_wrong_type_names_key_value_and_line(tmp_path: Path) -> None:
    p = _write(tmp_path, '[model]\npath = "synth:tiny"\n\n[pool]\nbudget_mb = "abc"\n')
    assert 'pool.budget_mb: expected int, got str "abc" (line 5)' in _error(p)


def test_wrong_type_bool_for_int_and_table_for_value(tmp_path: Path) -> None:
    p = _write(tmp_path, '[model]\npath = "synth:tiny"\n[reader]\nretries = true\n')
    assert "reader.retries: expected int, got bool true (line 4)" in _error(p)
    p = _write(tmp_path, 'pool = 3\n[model]\npath = "synth:tiny"\n')
    assert "pool: expected table, got int 3 (line 1)" in _error(p)


@pytest.mark.parametrize(
    ("section", "line", "expected"),
    [
        ("[reader]\nconcurrency = 0", 4, "reader.concurrency: expected int in [1, 256], got 0"),
        ("[server]\nport = 70000", 4, "server.port: expected int in [0, 65535], got 70000"),
        ("[server]\nshutdown_grace_s = -1", 4, "server.shutdown_grace_s: expected float in [0, 3600], got -1"),
        ("[pool]\nlfu_decay = 1.5", 4, "pool.lfu_decay: expected float in (0, 1], got 1.5"),
        ("[sampling]\ntemperature = 5", 4, "sampling.temperature must be in [0, 2], got 5"),
        ('[pool]\neviction = "lfuu"', 4, "pool.eviction must be one of 'lfu', 'lru', 'slru'"),
        ('[prefetch]\nstrategy = "nextgate"', 4, "did you mean 'next-gate'?"),
        ('[prefetch]\nstrategy = "combined"', 3, "prefetch.combine must list at least two"),
        ('[model]\nverify = "sometimes"', 3, "model.verify: invalid value 'sometimes', expected "
         "one of "),
        ("[compute]\nkv_bits = 5", 4, "compute.kv_bits: invalid value 5, expected one of 0, 4, 8"),
        ('[log]\nlevel = "loud"', 4, "log.level must be one of"),
        ('[prefetch]\npass_max_per_layer = "some"', 4, "prefetch.pass_max_per_layer"),
    ],
)
def test_out_of_range_values(tmp_path: Path, section: str, line: int, expected: str) -> None:
    # The [model] case extends the [model] table instead of opening a second one.
    body = section.split("\n", 1)[1] if section.startswith("[model]") else section
    text = '[model]\npath = "synth:tiny"\n' + body + "\n"
    msg = _error(_write(tmp_path, text))
    assert expected in msg
    assert f"(line {line})" in msg


def test_slots_and_budget_are_exclusive(tmp_path: Path) -> None:
    p = _write(tmp_path, '[model]\npath = "synth:tiny"\n[pool]\nbudget_mb = 5\nslots = 9\n')
    msg = _error(p)
    assert "pool.slots and budget_mb are exclusive" in msg and "(line 5)" in msg


def test_missing_model_path(tmp_path: Path) -> None:
    assert "missing required key 'model.path' (line 1)" in _error(_write(tmp_path, "[model]\n"))
    assert "missing required key 'model'" in _error(_write(tmp_path, "[pool]\nslots = 4\n"))


def test_model_path_must_exist_unless_synth_or_source(tmp_path: Path) -> None:
    gone = tmp_path / "gone.qpack"
    p = _write(tmp_path, f'[model]\n\npath = "{gone}"\n')
    msg = _error(p)
    assert f"model.path: '{gone}' does not exist (line 3)" in msg
    assert load_config(p, check_paths=False).model.path == str(gone)
    # With a source to build it from, a missing container is fine (packed on first use).
    assert load_config(p, ["model.source=synth:demo"]).model.source == "synth:demo"
    (gone).mkdir()
    assert load_config(p).model.path == str(gone)
    assert "model.path must name" in _error(_write(tmp_path, '[model]\npath = "synth:"\n'))


# --- overrides -------------------------------------------------------------------------


def test_overrides_apply_with_toml_values(tmp_path: Path) -> None:
    p = _write(tmp_path, '[model]\npath = "synth:tiny"\n[pool]\nbudget_mb = 5\n')
    cfg = load_config(
        p,
        [
            "pool.budget_mb=64",
            "compute.overlap=false",
            "sampling.temperature=0.7",
            'run.prompts=["a", "b"]',
            "server.api_key=secret",  # a bare word is a string
            "model.path = demo-data/x.qpack",
            "model.source=synth:demo",
        ],
    )
    assert cfg.pool.budget_mb == 64 and cfg.compute.overlap is False
    assert cfg.sampling.temperature == 0.7 and cfg.run.prompts == ("a", "b")
    assert cfg.server.api_key == "secret" and cfg.model.path == "demo-data/x.qpack"
    # A dict works too, and can create a section the file does not have.
    cfg = load_config(p, {"prefetch.strategy": "none", "log.json": "true"})
    assert cfg.prefetch.strategy == "none" and cfg.log.json is True


def test_bad_overrides_are_named(tmp_path: Path) -> None:
    p = _write(tmp_path, '[model]\npath = "synth:tiny"\n[pool]\nbudget_mb = 5\n')
    msg = _error(p, ["pool.budget_mb=abc"])
    assert "pool.budget_mb: expected int, got str \"abc\" (override 'pool.budget_mb=abc')" in msg
    msg = _error(p, ["pool.budgt_mb=3"])
    assert "unknown key 'pool.budgt_mb' (override 'pool.budgt_mb=3'); did you mean" in msg
    assert "override 'budget_mb'" in _error(p, ["budget_mb"])
    assert "expected section.key=value" in _error(p, ["budget_mb=4"])
    assert "'model' is not a section" in _error(
        _write(tmp_path, 'model = "x"\n', "flat.toml"), ["model.path=y"]
    )
    msg = _error(p, ["reader.concurrency=0"])
    assert "reader.concurrency: expected int in [1, 256], got 0 (override 'reader.concurrency=0')" in msg


def test_an_override_is_one_toml_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What follows the value (a line break and a table, another key) is refused, naming
    the override; before, `v = <text>` parsed it as more keys and dropped them."""
    p = _write(tmp_path, '[model]\npath = "synth:tiny"\n[pool]\nbudget_mb = 5\n')
    for bad in ("pool.budget_mb=4\n[evil]\nx=1", 'pool.budget_mb=4\nserver_api_key = "k"',
                "pool.budget_mb=4\nv = 5", "model.path=demo-data/x.qpack\n[evil]",
                "server.api_key=se\x1bcret"):
        msg = _error(p, [bad])
        assert f"override {bad!r}: the value must be one TOML value" in msg, msg
        assert "\n" not in msg  # one line: the override is shown as its repr
    # One value may still span lines (an array), carry a comment, or be a bare word.
    cfg = load_config(p, ['run.prompts=["a",\n "b"]', "pool.budget_mb=7 # note",
                          "model.path=demo-data/x.qpack"], check_paths=False)
    assert cfg.run.prompts == ("a", "b") and cfg.pool.budget_mb == 7
    assert cfg.model.path == "demo-data/x.qpack"
    parser = argparse.ArgumentParser(prog="moestream")
    register(parser.add_subparsers())
    args = parser.parse_args(["config", str(p), "--set", "pool.budget_mb=4\n[evil]\nx=1"])
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'pool.budget_mb=4\\n[evil]\\nx=1'" in err, err


def test_cli_config_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="moestream")
    register(parser.add_subparsers())
    good = _write(tmp_path, '[model]\npath = "synth:tiny"\n')
    args = parser.parse_args(["config", str(good), "--set", "pool.slots=12"])
    assert args.func(args) == 0
    assert "slots = 12" in capsys.readouterr().out
    args = parser.parse_args(["config", str(good), "--set", "pool.slots=0"])
    assert args.func(args) == 2
    assert "pool.slots: expected int in [1, 16_777_216], got 0" in capsys.readouterr().err


def test_a_date_where_a_string_belongs_is_one_error_and_odd_strings_round_trip(tmp_path: Path) -> None:
    """TOML has dates and times of its own: a wrong type like any other (the message's own
    writing of it crashed); and a string with DEL, which TOML forbids raw, is written escaped."""
    from pipeline.config.toml import dumps_toml

    path = tmp_path / "date.toml"
    path.write_text('[model]\npath = "x.qpack"\n[run]\nstats = 2024-01-01\n')
    with pytest.raises(ConfigError, match=r"run.stats: expected str, got date 2024-01-01 \(line 4\)"):
        load_config(path, check_paths=False)
    prompt = "a\x7fb \U0001f916 \\ \""
    path.write_text(dumps_toml({"model": {"path": "x.qpack"}, "run": {"prompts": [prompt]}}))
    assert list(load_config(path, check_paths=False).run.prompts) == [prompt]


def test_a_word_where_a_number_or_a_word_belongs_lists_the_words(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text('[model]\npath = "x.qpack"\n[memory]\nbudget_mb = "AUTO"\n')
    with pytest.raises(ConfigError, match=r"memory.budget_mb: invalid value 'AUTO', expected a number "
                                          r"or one of 'auto', 'off' \(line 4\)"):
        load_config(path, check_paths=False)

