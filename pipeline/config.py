"""The pipeline config: typed sections decoded from TOML, with errors that name key and line.

Only `[model].path` is required; every other key has a default, so a two-line file runs.
Relative paths (model.path, run.stats, ...) are taken relative to the current working
directory, not the config file, so that `config/*.toml` can name `demo-data/...` and
work from the repository root.

`load_config(path, overrides)` parses with tomllib, applies `section.key=value` overrides
(values in TOML syntax, falling back to a plain string), checks for unknown keys (with a
difflib suggestion), then decodes with `msgspec.convert(strict=True)`. Every failure is a
`ConfigError` naming the file, the dotted key and the line (or the override it came from).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import math
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from actors.sampler import SamplingParams

# Eviction policies the expert pool knows. Extend here (and in the pool's policy registry)
# to add one: "lfu" = frequency with decay and recency tie-break (default), "lru" = least
# recently used, "slru" = segmented LRU (probation + protected segments, scan-resistant).
EVICTION_POLICIES: tuple[str, ...] = ("lfu", "lru", "slru")

# Prefetch strategies (see DESIGN.md). "combined" unions the strategies in `combine`.
PREFETCH_STRATEGIES: tuple[str, ...] = (
    "none",
    "next-gate",
    "lookahead",
    "history",
    "transition",
    "combined",
)

LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")
SYNTH_PREFIX = "synth:"

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class ConfigError(ValueError):
    """A config that cannot be used; the message names file, key and line."""


def _one_of(field: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        hint = difflib.get_close_matches(value, allowed, n=1)
        extra = f"; did you mean {hint[0]!r}?" if hint else ""
        choices = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{field} must be one of {choices}, got {value!r}{extra}")


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class ModelConfig(_Section):
    # A `.qpack` directory, or `synth:<preset>` (synthesize and pack the preset on first use).
    path: str
    # Hub id, checkpoint directory or `synth:<preset>` to pack `path` from when it is missing.
    source: str | None = None
    # Checksums: "off", "first-use" (each expert once, when first read) or "full" (at open).
    verify: Literal["off", "first-use", "full"] = "first-use"

    def __post_init__(self) -> None:
        for name, value in (("path", self.path), ("source", self.source)):
            if value is not None and value.strip() in ("", SYNTH_PREFIX):
                raise ValueError(f"{name} must name a container or a synth:<preset>, got {value!r}")


class PoolConfig(_Section):
    # Give budget_mb or slots, or neither (derive from the memory left after the dense core).
    budget_mb: PositiveInt | None = None
    slots: PositiveInt | None = None
    eviction: str = "lfu"
    # LFU counts fade by this factor every `lfu_period` pool accesses (1.0 = plain LFU);
    # the parameters of actors.eviction.LFUDecay, ignored by the other policies.
    lfu_decay: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.9
    lfu_period: PositiveInt = 512

    def __post_init__(self) -> None:
        if self.budget_mb is not None and self.slots is not None:
            raise ValueError("slots and budget_mb are exclusive: set one, or neither to derive")
        _one_of("eviction", self.eviction, EVICTION_POLICIES)


class ReaderConfig(_Section):
    concurrency: PositiveInt = 4  # expert reads in flight at once
    retries: NonNegInt = 2  # per read, on EIO/short read, before the error propagates
    retry_backoff_ms: Annotated[float, msgspec.Meta(ge=0.0)] = 10.0
    o_direct: bool = False  # bypass the page cache (Linux; falls back if unsupported)


class PrefetchConfig(_Section):
    strategy: str = "next-gate"
    depth: PositiveInt = 1  # layers ahead, for "lookahead"
    max_per_layer: PositiveInt | None = None  # cap on predicted experts per layer
    combine: tuple[str, ...] = ()  # the strategies "combined" unions

    def __post_init__(self) -> None:
        _one_of("strategy", self.strategy, PREFETCH_STRATEGIES)
        parts = tuple(s for s in PREFETCH_STRATEGIES if s not in ("none", "combined"))
        for s in self.combine:
            _one_of("combine", s, parts)
        if self.strategy == "combined" and len(self.combine) < 2:
            raise ValueError('combine must list at least two strategies when strategy = "combined"')
        if self.strategy != "combined" and self.combine:
            raise ValueError(
                f'combine is only used with strategy = "combined", not {self.strategy!r}'
            )


class ComputeConfig(_Section):
    prefill_chunk: PositiveInt = 256  # prompt tokens per forward during prefill
    overlap: bool = True  # false = the serial streamer baseline (no read/compute overlap)
    # Activation dtype. "auto": float32 on MLX's CPU backend (its bfloat16 kernels are ~10x
    # slower than float32 there), the model's own dtype on GPUs; "model": always the model's.
    dtype: Literal["auto", "model", "float32", "bfloat16", "float16"] = "auto"


class ChatMessage(_Section):
    role: Literal["system", "user", "assistant"]
    content: str


class RunConfig(_Section):
    # Each prompt is a plain string (completion) or a list of chat messages.
    prompts: tuple[str | tuple[ChatMessage, ...], ...] = ("Hello",)
    max_tokens: PositiveInt = 64
    stats: str | None = None  # JSON stats file
    trace: str | None = None  # event trace (timeline) file
    record_routing: str | None = None  # routing trace for `replay`


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)] = 8000
    api_key: str | None = None  # when set, requests need `Authorization: Bearer <key>`
    max_queue: PositiveInt = 16  # requests waiting beyond this get 429
    max_body_bytes: PositiveInt = 1 << 20
    context_limit: PositiveInt | None = None  # None = the model's max_position_embeddings


class LogConfig(_Section):
    level: str = "info"
    json: bool = False

    def __post_init__(self) -> None:
        _one_of("level", self.level, LOG_LEVELS)


class PipelineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    model: ModelConfig
    pool: PoolConfig = PoolConfig()
    reader: ReaderConfig = ReaderConfig()
    prefetch: PrefetchConfig = PrefetchConfig()
    compute: ComputeConfig = ComputeConfig()
    sampling: SamplingParams = SamplingParams()
    run: RunConfig = RunConfig()
    server: ServerConfig = ServerConfig()
    log: LogConfig = LogConfig()

    def to_toml_dict(self) -> dict[str, Any]:
        """Plain dicts/lists for printing; unset (None) keys are left out, as TOML has no null."""
        return _drop_none(msgspec.to_builtins(self))

    def to_toml(self) -> str:
        """The effective config as TOML text (loads back to an equal config)."""
        return dumps_toml(self.to_toml_dict())


# --- loading ---------------------------------------------------------------------------


def load_config(
    path: str | Path,
    overrides: Mapping[str, str] | Sequence[str] | None = None,
    *,
    check_paths: bool = True,
) -> PipelineConfig:
    """Read, override, validate. `check_paths=False` skips the model-path existence check."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    return config_from_dict(
        raw, source=str(path), text=text, overrides=overrides, check_paths=check_paths
    )


def config_from_dict(
    raw: dict[str, Any],
    *,
    source: str = "<config>",
    text: str = "",
    overrides: Mapping[str, str] | Sequence[str] | None = None,
    check_paths: bool = True,
) -> PipelineConfig:
    """Validate an already-parsed TOML document (`text` only serves the line numbers)."""
    raw = copy.deepcopy(raw)  # overrides must not leak into the caller's dict
    where = _Locator(source, text)
    for key, value_text in _override_items(overrides):
        _apply_override(raw, key, value_text, where)
    problems = _unknown_keys(raw, PipelineConfig, ())
    if problems:
        raise ConfigError("\n".join(where.unknown(k, hint) for k, hint in problems))
    try:
        cfg = msgspec.convert(raw, type=PipelineConfig, strict=True)
    except msgspec.ValidationError as e:
        raise ConfigError(where.validation(str(e), raw)) from None
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


def _apply_override(raw: dict[str, Any], key: str, value_text: str, where: _Locator) -> None:
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
    try:
        node[parts[-1]] = tomllib.loads(f"v = {value_text}")["v"]
    except tomllib.TOMLDecodeError:
        node[parts[-1]] = value_text  # a bare word like `demo-data/x.qpack` means the string
    where.overridden[tuple(parts)] = name


def _struct_type(tp: Any) -> type[msgspec.Struct] | None:
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    return None


def _unknown_keys(
    raw: Any, tp: type[msgspec.Struct], prefix: tuple[str, ...]
) -> list[tuple[tuple[str, ...], str | None]]:
    if not isinstance(raw, dict):
        return []  # the wrong-type error comes from msgspec, with its own message
    fields = {f.name: f for f in msgspec.structs.fields(tp)}
    out: list[tuple[tuple[str, ...], str | None]] = []
    for key, value in raw.items():
        if key not in fields:
            hint = difflib.get_close_matches(key, list(fields), n=1)
            out.append(((*prefix, key), hint[0] if hint else None))
        elif (sub := _struct_type(fields[key].type)) is not None:
            out.extend(_unknown_keys(value, sub, (*prefix, key)))
    return out


def _check_model_path(cfg: PipelineConfig, where: _Locator) -> None:
    m = cfg.model
    if m.path.startswith(SYNTH_PREFIX) or Path(m.path).exists() or m.source is not None:
        return
    raise ConfigError(
        f"{where.source}: model.path: {m.path!r} does not exist{where.at(('model', 'path'))}"
        " and model.source is not set to build it"
    )


# --- error locations -------------------------------------------------------------------

_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(
    r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*="""
)
_MSGSPEC_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)


def _split_key(key: str) -> tuple[str, ...]:
    return tuple(p.strip().strip("\"'") for p in key.split("."))


class _Locator:
    """Finds the line of a dotted key by a simple scan of the TOML text."""

    def __init__(self, source: str, text: str) -> None:
        self.source = source
        self.overridden: dict[tuple[str, ...], str] = {}
        self.lines: dict[tuple[str, ...], int] = {}
        section: tuple[str, ...] = ()
        for n, line in enumerate(text.splitlines(), start=1):
            if h := _HEADER.match(line):
                section = _split_key(h.group(1))
                self.lines.setdefault(section, n)
            elif k := _KEY.match(line):
                self.lines.setdefault((*section, *_split_key(k.group(1))), n)

    def at(self, key: tuple[str, ...]) -> str:
        """' (line N)', " (override 'k=v')" or '' for the key or its nearest enclosing one."""
        for i in range(len(key), 0, -1):
            if key[:i] in self.overridden:
                return f" (override {self.overridden[key[:i]]!r})"
            if key[:i] in self.lines:
                return f" (line {self.lines[key[:i]]})"
        return ""

    def unknown(self, key: tuple[str, ...], hint: str | None) -> str:
        extra = f"; did you mean {hint!r}?" if hint else ""
        return f"{self.source}: unknown key {'.'.join(key)!r}{self.at(key)}{extra}"

    def validation(self, message: str, raw: dict[str, Any]) -> str:
        m = _MSGSPEC_AT.match(message)
        assert m is not None  # the pattern matches any string
        msg, path = m.group("msg"), m.group("path") or ""
        key = tuple(p for p in re.split(r"\.|\[(\d+)\]", path) if p)
        if missing := re.match(r"Object missing required field `(\w+)`", msg):
            full = (*key, missing.group(1))
            return f"{self.source}: missing required key {'.'.join(full)!r}{self.at(key)}"
        if expected := re.match(r"Expected `([^`]*)`(.*?)(?:, got `(\w+)`)?$", msg):
            tp = " | ".join(_toml_type(t) for t in expected.group(1).split(" | ") if t != "null")
            want = f"expected {tp}{expected.group(2)}"
            value = _lookup(raw, key)
            # With a type name this is a wrong type; without, a range constraint failed.
            got = _toml_type(expected.group(3)) + " " if expected.group(3) else ""
            want += f", got {got}{_show(value)}".rstrip()
            return f"{self.source}: {_dotted(key)}: {want}{self.at(key)}"
        if unknown := re.match(r"Object contains unknown field `([^`]*)`", msg):
            full = (*key, unknown.group(1))
            return f"{self.source}: unknown key {_dotted(full)!r}{self.at(full)}"
        if enum := re.match(r"Invalid enum value (.*)", msg):
            return f"{self.source}: {_dotted(key)}: invalid value {enum.group(1)}{self.at(key)}"
        # A ValueError from a section's __post_init__: it starts with the field's name.
        first = msg.split(" ", 1)[0]
        if key and isinstance(_lookup(raw, key), dict) and first.isidentifier():
            return f"{self.source}: {_dotted(key)}.{msg}{self.at((*key, first))}"
        return f"{self.source}: {_dotted(key) or 'config'}: {msg}{self.at(key)}"


def _dotted(key: tuple[str, ...]) -> str:
    out = ""
    for p in key:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def _lookup(raw: Any, key: tuple[str, ...]) -> Any:
    node = raw
    for p in key:
        if isinstance(node, dict) and p in node:
            node = node[p]
        elif isinstance(node, list) and p.isdigit() and int(p) < len(node):
            node = node[int(p)]
        else:
            return None
    return node


def _toml_type(name: str) -> str:
    return {"object": "table", "array": "array", "null": "nothing"}.get(name, name)


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        text = dumps_value(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return dumps_value(value) if value is not None else ""


# --- writing TOML (for printing the effective config) -----------------------------------


def _drop_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_none(v) for v in x]
    return x


def dumps_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, str):
        return msgspec.json.encode(v).decode()  # JSON string escapes are valid TOML
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(dumps_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {dumps_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def dumps_toml(doc: Mapping[str, Any]) -> str:
    """Top-level tables of scalars/arrays/inline tables: all a PipelineConfig needs."""
    out: list[str] = []
    for section, body in doc.items():
        out.append(f"[{section}]")
        out.extend(f"{k} = {dumps_value(v)}" for k, v in body.items())
        out.append("")
    return "\n".join(out)


# --- CLI -------------------------------------------------------------------------------


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="validate a pipeline config and print the effective settings",
        description="Load a TOML pipeline config, apply --set overrides, validate every key, "
        "and print the effective config (all defaults filled in) as TOML.",
    )
    p.add_argument("path", type=Path, help="the TOML config file, e.g. config/demo.toml")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one key (TOML value syntax; bare words are strings); repeatable",
    )
    p.add_argument(
        "--no-check-paths", action="store_true", help="do not require model.path to exist"
    )
    p.set_defaults(func=_cmd_config)


def _cmd_config(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.path, args.overrides, check_paths=not args.no_check_paths)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(cfg.to_toml(), end="")
    return 0
