"""One parsed tokenizer.json per content for the engine's tokenizer and for llguidance's,
in each test process.

`pipeline.tokenizer` caches a built tokenizer per directory, and a container's private
tokenizer directory is named by the digests of all its tokenizer files, generation_config.json
among them. So containers that differ only in generation_config, the template variant or
the model type each parse the same 15 MB tokenizer.json again: about 1 s of CPU at Qwen3.5's
248k tokens. That was a dozen times per xdist worker.

Here `pipeline.tokenizer_build.parse` (what `pipeline.tokenizer` builds its Rust object
with) answers with one object per file content (a sha256 of the bytes, ~15 ms). The object
is a real one, built from those bytes by the product's own code: the product already shares
one between every engine of a process and never changes it. Other callers (transformers,
which sets truncation and padding on the object it gets) call the library as before.

The grammar's `llguidance.LLTokenizer` (1.2-2 s of CPU to build) is cached by the server
per container path, and every test module serves its own containers (or copies): here
`pipeline.server.grammar`'s calls get one per (content, vocabulary size, EOS ids), as its
cache would for one container. Nothing else is cached.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

_BY_DIGEST: dict[Any, Any] = {}
_LL_CALLERS = frozenset({"pipeline.server.grammar"})


def install() -> None:
    """Put the content-keyed `from_file` and `LLTokenizer` in place (once per process)."""
    _share_from_file()
    _share_ll_tokenizer()


def _share_ll_tokenizer() -> None:
    import llguidance

    build = llguidance.LLTokenizer
    if getattr(llguidance, "_moestream_tests_shared", False):
        return

    def ll_tokenizer(text: str, *args: Any, **kwargs: Any) -> Any:
        if args or sys._getframe(1).f_globals.get("__name__") not in _LL_CALLERS:
            return build(text, *args, **kwargs)
        key = (hashlib.sha256(text.encode()).hexdigest(), repr(sorted(kwargs.items())))
        if key not in _BY_DIGEST:
            _BY_DIGEST[key] = build(text, **kwargs)
        return _BY_DIGEST[key]

    # The module's name only: grammar.py looks it up at each call; llguidance's own modules
    # (hf, llamacpp) and type checks use the class from llguidance._lib.
    llguidance.LLTokenizer = ll_tokenizer
    llguidance._moestream_tests_shared = True


def _share_from_file() -> None:
    from pipeline import tokenizer_build

    parse = tokenizer_build.parse
    if getattr(parse, "_moestream_tests_shared", False):
        return

    def shared(path: Path) -> Any:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        if digest not in _BY_DIGEST:
            _BY_DIGEST[digest] = parse(path)
        return _BY_DIGEST[digest]

    # `pipeline.tokenizer` calls it through the module, so this name is the one it meets.
    shared._moestream_tests_shared = True  # type: ignore[attr-defined]
    tokenizer_build.parse = shared
