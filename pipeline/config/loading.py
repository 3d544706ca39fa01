"""Reading a pipeline config: TOML in, overrides applied, unknown keys named, then decoded
into `PipelineConfig` (pipeline.config.schema) with `msgspec.convert(strict=True)`. Every
failure is a `ConfigError` naming the file, the dotted key and the line (or the override
it came from)."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from pipeline.config.errors import ConfigError, Locator, unknown_keys
from pipeline.config.schema import SYNTH_PREFIX, PipelineConfig

MAX_CONFIG_BYTES = 1 << 20


def load_config(
    path: str | Path,
    overrides: Mapping[str, str] | Sequence[str] | None = None,
    *,
    check_paths: bool = True,
) -> PipelineConfig:
    """Read, override, validate. `check_paths=False` skips the model-path existence check."""
    raw, text = read_toml(path)
    return config_from_dict(
        raw, source=str(path), text=text, overrides=overrides, check_paths=check_paths
    )


def read_toml(path: str | Path) -> tuple[dict[str, Any], str]:
    """A config file's document and text; what is not a TOML file is a ConfigError naming it."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:  # a config is a page of text, not a disk
            raise ConfigError(f"{path}: {path.stat().st_size} bytes is not a config file "
                              f"(at most {MAX_CONFIG_BYTES})")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start} is 0x{e.object[e.start]:02x});"
                          " a config is a TOML file") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None
    return _parse_toml(text, str(path)), text


def _parse_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per level of nested arrays / inline tables
        raise ConfigError(f"{source}: invalid TOML: arrays or tables nested too deeply") from None


def config_from_dict(
    raw: dict[str, Any],
    *,
    source: str = "<config>",
    text: str = "",
    overrides: Mapping[str, str] | Sequence[str] | None = None,
    check_paths: bool = True,
) -> PipelineConfig:
    """Validate an already-parsed TOML document (`text` only serves the line numbers)."""
    try:
        raw = copy.deepcopy(raw)  # overrides must not leak into the caller's dict
    except RecursionError:
        raise ConfigError(f"{source}: values nested too deeply") from None
    where = Locator(source, text)
    for key, value_text in _override_items(overrides):
        _apply_override(raw, key, value_text, where)
    problems = unknown_keys(raw, PipelineConfig, ())
    if problems:
        raise ConfigError("\n".join(where.unknown(k, hint) for k, hint in problems))
    try:
        cfg = msgspec.convert(raw, type=PipelineConfig, strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(where.validation(str(e), raw, PipelineConfig)) from None
    if check_paths:
        _check_model_path(cfg, where)
    return cfg


def _override_items(overrides: Mapping[str, str] | Sequence[str] | None) -> list[tuple[str, str]]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [(str(k).strip(), str(v).strip()) for k, v in overrides.items()]
    if isinstance(overrides, str):
        overrides = [overrides]
    items = []
    for item in overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        items.append((key.strip(), value.strip()))
    return items


def _apply_override(raw: dict[str, Any], key: str, value_text: str, where: Locator) -> None:
    """Set `key` (dotted) to `value_text` parsed as a TOML value, or as a string if not one."""
    name = f"{key}={value_text}"
    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {name!r}: expected section.key=value")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {name!r}: {p!r} is not a section")
    node[parts[-1]] = _override_value(name, value_text)
    where.overridden[tuple(parts)] = name


def _override_value(name: str, value_text: str) -> Any:
    """`value_text` as one TOML value (a bare word: that string). It is parsed as the
    document `v = <text>`, so whatever follows the value (a newline and `[table]`, another
    key) would come back as more keys: refused, never silently dropped or merged."""
    try:
        doc = tomllib.loads(f"v = {value_text}")
    except RecursionError:
        raise ConfigError(f"override {name[:80]!r}: value nested too deeply") from None
    except tomllib.TOMLDecodeError:
        if any(ch < " " or ch == "\x7f" for ch in value_text):
            raise ConfigError(f"override {name!r}: the value must be one TOML value "
                              "(it holds a line break or control character)") from None
        return value_text  # a bare word like `demo-data/x.qpack` means the string
    if list(doc) != ["v"]:
        raise ConfigError(f"override {name!r}: the value must be one TOML value; "
                          "found more after it")
    return doc["v"]


def _check_model_path(cfg: PipelineConfig, where: Locator) -> None:
    m = cfg.model
    if m.path.startswith(SYNTH_PREFIX) or Path(m.path).exists() or m.source is not None:
        return
    raise ConfigError(
        f"{where.source}: model.path: {m.path!r} does not exist{where.at(('model', 'path'))}"
        " and model.source is not set to build it"
    )
