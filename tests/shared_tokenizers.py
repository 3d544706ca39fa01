"""One parsed tokenizer.json per content for the engine's tokenizer, across the test session.

`pipeline.tokenizer` caches a built tokenizer per directory, and a container's private
tokenizer directory is named by the digests of all its tokenizer files, generation_config.json
among them. So containers that differ only in generation_config, the template variant or
the model type each parse the same 15 MB tokenizer.json again: about 1 s of CPU at Qwen3.5's
248k tokens. That was a dozen times per xdist worker.

Here `tokenizers.Tokenizer.from_file` answers calls from `pipeline.tokenizer` with one Rust
object per file content (a sha256 of the bytes, ~15 ms). The object is a real one, parsed
from those bytes by the library: the product already shares one between every engine of a
process and never changes it. Other callers (transformers, which sets truncation and padding
on the object it gets) get a fresh one as before. Nothing else is cached.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

_BY_DIGEST: dict[str, Any] = {}
_CALLERS = frozenset({"pipeline.tokenizer"})


def install() -> None:
    """Put the content-keyed `from_file` in place (once per process)."""
    import tokenizers

    cls = tokenizers.Tokenizer
    if getattr(cls, "_moestream_tests_shared", False):
        return
    parse = cls.from_file

    def from_file(path: str, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or sys._getframe(1).f_globals.get("__name__") not in _CALLERS:
            return parse(path, *args, **kwargs)
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        if digest not in _BY_DIGEST:
            _BY_DIGEST[digest] = parse(path)
        return _BY_DIGEST[digest]

    cls.from_file = staticmethod(from_file)
    cls._moestream_tests_shared = True
