"""Fetch a checkpoint from a Hugging Face hub (or any HF_ENDPOINT mirror), file by file.

huggingface_hub does the transfer: its cache makes finished files free on a re-run and
a connection dropped mid-file is resumed with a Range request. We only choose which
files a pack needs and read HF_ENDPOINT / HF_HUB_CACHE at call time (huggingface_hub
reads them once at import, which would pin whatever the environment was back then).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import structlog

from qpack.source import TOKENIZER_FILES
from qpack.spec import QpackError

log = structlog.get_logger("qpack.hub")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_WANTED = {"config.json", "model.safetensors.index.json", *TOKENIZER_FILES}


def wanted(filename: str) -> bool:
    """Files a pack reads; everything else in a repo (READMEs, .bin, images) is skipped."""
    return "/" not in filename and (filename in _WANTED or filename.endswith(".safetensors"))


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


def download(repo_id: str, *, revision: str | None = None, progress: bool = True,
             cache_dir: str | None = None, endpoint: str | None = None) -> Path:
    from huggingface_hub import HfApi, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or None
    where = f"{endpoint or 'https://huggingface.co'}/{repo_id}"
    if not progress:
        disable_progress_bars()
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, revision=revision)
        files = sorted(s.rfilename for s in (info.siblings or []) if wanted(s.rfilename))
        if "config.json" not in files:
            raise QpackError(where, f"repo has no config.json (files: {files[:10]})")
        commit = info.sha or revision
        log.info("hub.download", repo=repo_id, revision=commit, files=len(files))
        local = None
        for i, name in enumerate(files):
            log.debug("hub.file", file=name, n=i + 1, of=len(files))
            local = hf_hub_download(repo_id, name, revision=commit, cache_dir=cache_dir, endpoint=endpoint)
        assert local is not None
        return Path(local).parent
    except RepositoryNotFoundError:
        raise QpackError(where, "repository not found (or private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise QpackError(where, f"revision {revision!r} not found") from None
    except EntryNotFoundError as exc:
        raise QpackError(where, f"file listed by the hub is missing: {exc}") from None
    except HfHubHTTPError as exc:
        raise QpackError(where, f"hub request failed: {exc}") from None
    except OSError as exc:
        raise QpackError(where, f"download failed: {exc}; re-run to resume") from None
    finally:
        if not progress:
            enable_progress_bars()
