"""Writing a config back as TOML text, for `moestream config` and `PipelineConfig.to_toml`.

Only what a PipelineConfig needs: top-level tables of scalars, arrays and inline tables.
tomllib reads TOML but cannot write it, and this is too small to justify a dependency.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import Any

import msgspec


def drop_none(x: Any) -> Any:
    """`x` without None values in its dicts: TOML has no null, an unset key is left out."""
    if isinstance(x, dict):
        return {k: drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [drop_none(v) for v in x]
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
        # JSON string escapes are valid TOML; DEL, which JSON leaves as is, TOML forbids.
        return msgspec.json.encode(v).decode().replace("\x7f", "\\u007f")
    if isinstance(v, (datetime.date, datetime.time)):  # TOML's own (a datetime is a date)
        return v.isoformat()
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
