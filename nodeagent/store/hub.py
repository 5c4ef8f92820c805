"""The Hugging Face hub, through huggingface-hub: list GGUF files, read a remote header with
HTTP range requests (never the weights), and download with resume and sha256 check.

huggingface-hub honours HF_ENDPOINT (a mirror), HF_TOKEN and HF_HUB_OFFLINE;
nodeagent's own NODEAGENT_OFFLINE is passed through as ``offline``.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Iterator, Mapping

from nodeagent.errors import HubError, NodeAgentError, NotFoundError
from nodeagent.modelfile.source import RangeSource
from nodeagent.store.files import sha256_file

log = logging.getLogger(__name__)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")

# what works without the hub: in offline mode, or when it cannot be reached
OFFLINE_WORKS = "only local models and the package-index test models can be planned and pulled"
UNREACHABLE_HINT = (f"check the network, or set HF_ENDPOINT to a mirror; without the hub {OFFLINE_WORKS} "
                    "(see 'nodeagent models list' and 'nodeagent models fetch-test')")
OFFLINE_VARIABLES = ("NODEAGENT_OFFLINE", "HF_HUB_OFFLINE")


def offline_switches(env: Mapping[str, str] | None = None) -> list[str]:
    """The variables that turn offline mode on in ``env`` (this process's environment by default)."""
    from nodeagent.config import parse_bool

    env = os.environ if env is None else env
    on = []
    for name in OFFLINE_VARIABLES:
        try:
            if parse_bool(env.get(name, "")):
                on.append(name)
        except ValueError:
            continue
    return on


def offline_hint(env: Mapping[str, str] | None = None) -> str:
    """How to leave offline mode: unset the variables that are set, or else the config file's setting."""
    names = offline_switches(env)
    if names:
        return f"unset {' '.join(names)}"
    return "set offline = false in the config file (see 'nodeagent config show')"


def _translate(exc: Exception, what: str, offline: bool) -> NodeAgentError:
    from huggingface_hub import errors

    if isinstance(exc, errors.RepositoryNotFoundError):
        return NotFoundError(f"no repository {what} on the hub (or it is private)",
                             hint="check the name; for a private repository set HF_TOKEN")
    if isinstance(exc, errors.OfflineModeIsEnabled) or (offline and isinstance(exc, errors.LocalEntryNotFoundError)):
        return HubError(f"offline mode is on, and {what} is not in the local cache",
                        hint=f"{offline_hint()}, or use a local file")
    if isinstance(exc, errors.LocalEntryNotFoundError):  # (an EntryNotFoundError: the hub did not answer)
        return HubError(f"the hub could not be reached for {what}, and it is not in the local cache",
                        hint=UNREACHABLE_HINT)
    if isinstance(exc, (errors.EntryNotFoundError,)):
        return NotFoundError(f"no file {what} on the hub", hint="see the repository's file list")
    return HubError(f"the hub could not be reached for {what}: {type(exc).__name__}: {exc}".splitlines()[0],
                    hint=UNREACHABLE_HINT)


def _guard_offline(offline: bool, what: str) -> None:
    if offline:
        raise HubError(f"offline mode is on, so {what} cannot be fetched",
                       hint=f"{offline_hint()}, or use a local file")


def list_gguf_files(repo: str, offline: bool, revision: str | None = None) -> list[str]:
    """GGUF model files of a repository: projectors and later parts of split files left out."""
    _guard_offline(offline, repo)
    from huggingface_hub import list_repo_files

    try:
        files = list_repo_files(repo, revision=revision)
    except Exception as exc:  # the hub library raises many types; each is translated once, here
        raise _translate(exc, repo, offline) from None
    out = []
    for f in files:
        if not f.endswith(".gguf") or "mmproj" in f.lower():
            continue
        m = _SPLIT.search(f)
        if m and m.group(1) != "00001":
            continue
        out.append(f)
    if not out:
        raise NotFoundError(f"repository {repo} has no GGUF file", hint="pick a repository with .gguf files")
    return sorted(out)


# A server that ignores Range (200 with the whole file) is read as a stream, in chunks, and dropped once the
# bytes asked for have arrived: never held whole. Skipping up to this many bytes to reach a later part of the
# header is allowed; past it, the read is refused.
STREAM_CHUNK_BYTES = 1 << 16
MAX_SKIP_BYTES = 64 << 20


def _read_window(chunks: Iterator[bytes], skip: int, length: int) -> bytes:
    """Bytes [skip, skip + length) of a stream, keeping at most ``length`` of them."""
    out = bytearray()
    for chunk in chunks:
        if skip >= len(chunk):
            skip -= len(chunk)
            continue
        out += chunk[skip : skip + length - len(out)]
        skip = 0
        if len(out) >= length:
            break
    return bytes(out)


def remote_source(repo: str, filename: str, offline: bool, revision: str | None = None) -> RangeSource:
    """A byte source over a hub file: each read is one HTTP range request."""
    _guard_offline(offline, f"{repo}/{filename}")
    from huggingface_hub import get_hf_file_metadata, get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(repo, filename, revision=revision)
    try:
        meta = get_hf_file_metadata(url)
    except Exception as exc:
        raise _translate(exc, f"{repo}/{filename}", offline) from None
    if meta.size is None:
        raise HubError(f"the hub did not say how large {repo}/{filename} is")
    location = meta.location or url
    headers = build_hf_headers()

    def fetch(offset: int, length: int) -> bytes:
        what = f"{repo}/{filename}"
        try:
            with get_session().stream("GET", location, follow_redirects=True,
                                      headers={**headers, "Range": f"bytes={offset}-{offset + length - 1}"}) as resp:
                resp.raise_for_status()
                ranged = resp.status_code == 206
                if not ranged and offset > MAX_SKIP_BYTES:
                    raise HubError(f"the server ignored the range request for {what}, and the header part asked "
                                   f"for starts {offset} bytes in", hint="use a mirror with HTTP range support")
                return _read_window(resp.iter_bytes(STREAM_CHUNK_BYTES), 0 if ranged else offset, length)
        except HubError:
            raise
        except Exception as exc:
            raise _translate(exc, what, offline) from None

    return RangeSource(fetch, meta.size, f"hf://{repo}/{filename}")


def download(repo: str, filename: str, offline: bool, revision: str | None = None) -> Path:
    """Download into the standard hub cache (progress bar, resume), then check the sha256."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    try:
        path = Path(hf_hub_download(repo, filename, revision=revision, local_files_only=offline))
    except Exception as exc:
        raise _translate(exc, f"{repo}/{filename}", offline) from None
    if offline:
        return path
    try:
        etag = get_hf_file_metadata(hf_hub_url(repo, filename, revision=revision)).etag
    except Exception as exc:
        raise _translate(exc, f"{repo}/{filename}", offline) from None
    if etag and re.fullmatch(r"[0-9a-f]{64}", etag):  # LFS files: the etag is the sha256 of the content
        digest = sha256_file(path)
        if digest != etag:
            path.unlink(missing_ok=True)
            raise HubError(f"{repo}/{filename}: sha256 {digest} does not match the hub's {etag}; removed",
                           hint="run the pull again")
    return path

