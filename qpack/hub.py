"""Fetch a checkpoint from a Hugging Face hub (or any HF_ENDPOINT mirror), file by file.

huggingface_hub does the transfer: its cache makes finished files free on a re-run and
a connection dropped mid-file is resumed with a Range request. We only choose which
files a pack needs and read HF_ENDPOINT / HF_HUB_CACHE at call time (huggingface_hub
reads them once at import, which would pin whatever the environment was back then).
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from qpack.checkpoint_kind import check_config, check_files, needed_shards
from qpack.source import TOKENIZER_FILES
from qpack.spec import QpackError, parse_json
from qpack.tokenizer_convert import conversion_source

log = structlog.get_logger("qpack.hub")
T = TypeVar("T")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_WANTED = {"config.json", "model.safetensors.index.json", *TOKENIZER_FILES}


def wanted(filename: str) -> bool:
    """Files a pack reads; everything else in a repo (READMEs, .bin, images) is skipped."""
    return "/" not in filename and (filename in _WANTED or filename.endswith(".safetensors"))


def wanted_files(listed: list[str]) -> list[str]:
    """The files of a repo's listing a pack reads: `wanted` ones, plus the file its
    tokenizer.json is converted from where it ships none (Kimi-K2's tiktoken.model)."""
    files = {f for f in listed if wanted(f)}
    if (source := conversion_source(listed)) is not None:
        files.add(source)
    return sorted(files)


def is_repo_id(source: str) -> bool:
    return bool(_REPO_ID.match(source)) and not source.startswith((".", "/"))


def resolve_source(source: str, *, revision: str | None = None, progress: bool = True,
                   cache_dir: str | None = None, endpoint: str | None = None) -> Path:
    """A local checkpoint directory as is, or a hub repo id downloaded into the HF cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if not is_repo_id(source):
        raise QpackError(source, "is neither a checkpoint directory nor a hub repo id (owner/name)")
    return download(source, revision=revision, progress=progress, cache_dir=cache_dir, endpoint=endpoint)


# Every hub request is bounded: a server that accepts and never answers would otherwise
# hold `pack` silently for as long as the OS keeps the connection (minutes). Tests and
# slow links tune these through the environment.
TIMEOUT_ENV, RETRIES_ENV, BACKOFF_ENV = "MOESTREAM_HUB_TIMEOUT_S", "MOESTREAM_HUB_ATTEMPTS", "MOESTREAM_HUB_BACKOFF_S"


class HubError(QpackError):
    """The hub could not be reached or did not answer; names the repo and the endpoint."""


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        return default


def _http_module() -> Any:
    """The HTTP client huggingface_hub runs on: httpx, or its fork httpx2 in newer releases."""
    try:
        import httpx2

        return httpx2
    except ImportError:
        import httpx

        return httpx


def _transient(exc: BaseException) -> bool:
    """Worth another attempt: no answer, a dropped connection, a 5xx or 429."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    httpx = _http_module()
    if isinstance(exc, httpx.TransportError | LocalEntryNotFoundError | TimeoutError | ConnectionError):
        return True
    if isinstance(exc, HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return status is None or status == 429 or status >= 500
    return False


def _describe(exc: BaseException, timeout: float) -> str:
    httpx = _http_module()
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({' '.join(str(exc).split()) or type(exc).__name__})"
    text = " ".join(str(exc).split())
    return text[:300] or type(exc).__name__


def _with_retries(what: str, fn: Callable[[], T], *, attempts: int, backoff: float, timeout: float) -> T:
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if not _transient(exc) or attempt == attempts:
                raise
            wait = backoff * 2 ** (attempt - 1)
            log.warning("hub.retry", what=what, attempt=attempt, of=attempts, wait_s=wait,
                        error=_describe(exc, timeout))
            time.sleep(wait)
    raise AssertionError("unreachable")


def download(repo_id: str, *, revision: str | None = None, progress: bool = True,
             cache_dir: str | None = None, endpoint: str | None = None) -> Path:
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    where = f"{endpoint or 'https://huggingface.co'}/{repo_id}"
    timeout = _env_float(TIMEOUT_ENV, 10.0)
    attempts = max(1, int(_env_float(RETRIES_ENV, 4)))
    backoff = _env_float(BACKOFF_ENV, 1.0)
    retry: dict[str, Any] = {"attempts": attempts, "backoff": backoff, "timeout": timeout}
    # huggingface_hub reads its download timeout once, at import; ours applies per call.
    # (annotated int there; it goes on to requests, which takes seconds as a float)
    saved_timeout, constants.HF_HUB_DOWNLOAD_TIMEOUT = constants.HF_HUB_DOWNLOAD_TIMEOUT, timeout  # type: ignore[assignment]
    if not progress:
        disable_progress_bars()
    try:
        if progress:
            print(f"hub: asking {where} for its file list", file=sys.stderr, flush=True)
        info = _with_retries("model_info", lambda: HfApi(endpoint=endpoint).model_info(
            repo_id, revision=revision, timeout=timeout), **retry)
        listed = [s.rfilename for s in (info.siblings or [])]
        check_files(listed, where)
        files = wanted_files(listed)
        if "config.json" not in files:
            raise QpackError(where, f"repo has no config.json (files: {files[:10]})")
        commit = info.sha or revision

        def fetch(name: str) -> Path:
            return Path(_with_retries(name, lambda: hf_hub_download(
                repo_id, name, revision=commit, cache_dir=cache_dir, endpoint=endpoint,
                etag_timeout=timeout), **retry))

        # config.json (and the index) first: what cannot be packed is refused, and what
        # the text model does not need is skipped, before any weight is downloaded.
        config_path = fetch("config.json")
        config = parse_json(config_path.read_bytes(), config_path, "config.json")
        if not isinstance(config, dict):
            raise QpackError(where, "config.json is not a JSON object")
        check_config(config, where)
        files = _text_shards(files, fetch, config, where)
        log.info("hub.download", repo=repo_id, revision=commit, files=len(files))
        for i, name in enumerate(files):
            log.debug("hub.file", file=name, n=i + 1, of=len(files))
            if progress:
                print(f"hub: file {i + 1}/{len(files)} {name}", file=sys.stderr, flush=True)
            fetch(name)
        return config_path.parent
    except RepositoryNotFoundError:
        raise QpackError(where, "repository not found (or private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise QpackError(where, f"revision {revision!r} not found") from None
    except LocalEntryNotFoundError as exc:  # the connection failed and the cache lacks the file
        raise HubError(where, f"hub unreachable after {attempts} attempts: {_describe(exc, timeout)}; "
                       "check the network or HF_ENDPOINT, then re-run to resume") from None
    except EntryNotFoundError as exc:
        raise QpackError(where, f"file listed by the hub is missing: {exc}") from None
    except HfHubHTTPError as exc:
        raise HubError(where, f"hub request failed: {_describe(exc, timeout)}") from None
    except Exception as exc:
        if isinstance(exc, _http_module().HTTPError | OSError):  # httpx errors are not OSErrors
            raise HubError(where, f"hub unreachable after {attempts} attempts: {_describe(exc, timeout)}; "
                           "check the network or HF_ENDPOINT, then re-run to resume") from None
        raise
    finally:
        constants.HF_HUB_DOWNLOAD_TIMEOUT = saved_timeout
        if not progress:
            enable_progress_bars()


def _text_shards(files: list[str], fetch: Callable[[str], Path], config: dict, where: str) -> list[str]:
    """`files` without the shards that hold no text-model tensor (per the index)."""
    index_name = "model.safetensors.index.json"
    if index_name not in files:
        return files
    index_path = fetch(index_name)
    index = parse_json(index_path.read_bytes(), index_path, index_name)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise QpackError(where, f"{index_name} has no weight_map")
    needed = needed_shards(weight_map, config)
    skipped = sorted({str(s) for s in weight_map.values()} - needed)
    if skipped:
        log.info("hub.skip_shards", shards=skipped, reason="no text-model tensor")
    return [f for f in files if not f.endswith(".safetensors") or f in needed]
