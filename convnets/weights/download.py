"""Download, verify and cache pretrained checkpoints.

Files go to ``torch.hub.get_dir()/checkpoints`` (so ``TORCH_HOME`` is honoured, and a file that
upstream's torch.hub already cached there is reused). A download is written to a temporary file
beside its destination and renamed only once it is complete, matches its digest and has been
checked to be the expected model, so a broken or wrong download never lands in the cache.

Where the manifest has no sha256 (none is known for the NGC files), the first complete download is
trusted as it is (trust on first use: a mirror or server that sends other weights of the same
architecture is not detected), and a warning says so, once: its digest is recorded in
``<file>.sha256`` beside it and the cached copy is verified against it on every later load; a file
that no longer matches is deleted and downloaded again. A
lock (``<file>.lock``, deleted when released, see :func:`convnets.locking.exclusive_lock`) lets
concurrent processes (DDP ranks, notebooks) share the cache: one downloads, the others wait. A
failed download leaves nothing in the cache.

The progress bar is drawn only where someone sees it: on a terminal or in a notebook, not in a log
file or a pipe, unless asked for with ``progress="always"`` (``--progress`` on the command line).

``CONVNETS_WEIGHTS_MIRROR`` replaces the NGC host for air-gapped use: a base URL
(``http(s)://`` or ``file://``) or a local directory holding the same file names.

Every download has an overall deadline (:data:`DOWNLOAD_TIMEOUT_S`, or ``timeout=``) and a size
cap (:func:`size_cap`: the manifest's ``size_bytes`` when known, else a generous multiple of the
parameters' float32 size); exceeding either stops it with a :class:`WeightsUnavailableError` that
names the URL and the limit, and leaves nothing in the cache. Redirects are followed by hand
(:func:`convnets.urls.open_url`: at most five, http(s) only, bodies unread, within the deadline).
Private and loopback addresses are *not* refused here: the host is NGC's or the user's own
``CONVNETS_WEIGHTS_MIRROR``, which may well be a server on the LAN or this machine.

We stream with ``requests`` rather than ``torch.hub.download_url_to_file`` because the latter has
no timeout (a dead server hangs forever) and does not check that the whole body arrived.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal
from urllib.parse import quote, unquote, urlsplit

import requests
import torch
import urllib3
from tqdm.auto import tqdm

from convnets.errors import ConvnetsError, InvalidArgumentError, WeightsUnavailableError
from convnets.fileio import atomic_output, atomic_write
from convnets.locking import exclusive_lock
from convnets.constants import MIRROR_ENV
from convnets.urls import RedirectError, open_url, read_chunks
from convnets.weights.manifest import WeightsEntry

__all__ = ["DOWNLOAD_TIMEOUT_S", "MIRROR_ENV", "Progress", "cache_dir", "fetch_weights", "resolve_source", "sha256_file", "show_progress",
           "size_cap"]

#: ``True``: a bar where someone can see it (a terminal or a notebook); ``"always"``: also into a
#: pipe or a log file; ``False``: never.
Progress = bool | Literal["always"]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0  # longest silence tolerated mid-download
LOCK_TIMEOUT_S = 3600.0  # how long a process waits for another one's download
#: Seconds one weights download may take in all (connecting, redirects, the whole file). An hour:
#: the largest NGC checkpoint (~200 MB) needs 7 minutes at 0.5 MB/s; a finite bound keeps a server
#: that drips bytes from holding a process (and the cache lock that others wait on) forever.
DOWNLOAD_TIMEOUT_S = 3600.0
#: Without a recorded ``size_bytes``, a checkpoint may be this many times its float32 parameters
#: (NGC files may hold an EMA copy and optimizer state besides the weights) ...
SIZE_CAP_FACTOR = 8
#: ... plus this much for metadata and container overhead.
SIZE_CAP_SLACK = 64 * 2**20
# flock errors of file systems that cannot lock (some NFS / FUSE mounts). The lock only saves a
# second download: writes are atomic with unique temporary names, so going on without it is safe.
_NO_LOCKING = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Where checkpoints are cached: ``torch.hub.get_dir()/checkpoints``."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def resolve_source(entry: WeightsEntry) -> str:
    """The URL or local path to fetch ``entry`` from: the mirror when one is set, else NGC."""
    mirror = os.environ.get(MIRROR_ENV, "").strip()
    if not mirror:
        return entry.url
    if "://" in mirror:
        return f"{mirror.rstrip('/')}/{quote(entry.file_name)}"
    return str(Path(mirror).expanduser() / entry.file_name)


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _read_record(path: Path) -> str | None:
    try:
        return _record_path(path).read_text(encoding="ascii").split()[0]
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def _write_record(path: Path, digest: str) -> None:
    line = f"{digest}  {path.name}\n"  # sha256sum's format
    atomic_write(_record_path(path), lambda f: f.write(line.encode("ascii")))


def size_cap(entry: WeightsEntry) -> int:
    """The most bytes a download of ``entry`` may be: its ``size_bytes`` when the manifest records
    it, else ``SIZE_CAP_FACTOR`` x its parameters in float32 + ``SIZE_CAP_SLACK``."""
    if entry.size_bytes is not None:
        return entry.size_bytes
    return SIZE_CAP_FACTOR * 4 * entry.num_params + SIZE_CAP_SLACK


class _FetchError(ConvnetsError):
    """A reason a source could not be fetched; becomes a WeightsUnavailableError with advice."""


@contextlib.contextmanager
def _open_source(source: str, deadline: float, timeout: float) -> Iterator[tuple[Iterator[bytes], int | None]]:
    """Yield ``(chunks, total size or None)`` for an http(s) URL, a file:// URL or a path.

    An http(s) source's chunks are read within ``deadline`` (``time.monotonic()``; ``timeout``
    is its length, for the message); a file's are checked against it by :func:`_download`.
    """
    scheme = urlsplit(source).scheme
    if scheme in ("http", "https"):
        try:
            # The mirror may be a LAN or loopback server: private addresses are allowed here.
            with open_url(source, deadline=deadline, headers={"User-Agent": "convnets"}, allow_private=True,
                          connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S) as r:
                if r.status_code != 200:
                    raise _FetchError(f"the server answered HTTP {r.status_code} {r.reason}")
                length = r.headers.get("Content-Length")
                # A compressed transfer is decoded, so its byte count differs from Content-Length.
                total = int(length) if length and length.isdigit() and "Content-Encoding" not in r.headers else None
                yield read_chunks(r, deadline=deadline, chunk_bytes=_CHUNK, max_silence=READ_TIMEOUT_S), total
        except (requests.Timeout, urllib3.exceptions.TimeoutError, TimeoutError) as e:
            if time.monotonic() >= deadline:
                raise _FetchError(f"the download did not finish within {timeout:g} s (the limit for one weights "
                                  "download)") from e
            raise _FetchError(f"timed out ({e.__class__.__name__})") from e
        except RedirectError as e:
            raise _FetchError(str(e)) from e
        except requests.ConnectionError as e:
            # requests nests urllib3's errors; the innermost reason is the readable part.
            reason = getattr(e.args[0], "reason", e) if e.args else e
            raise _FetchError(f"cannot reach {urlsplit(source).netloc} ({reason})") from e
        except (requests.RequestException, urllib3.exceptions.HTTPError) as e:
            raise _FetchError(f"network error: {e}") from e
        return
    if scheme == "file":
        path = Path(unquote(urlsplit(source).path))
    elif scheme == "" or len(scheme) == 1:  # a plain path (a Windows drive letter looks like a scheme)
        path = Path(source)
    else:
        raise _FetchError(f"unsupported URL scheme {scheme!r}; use http(s)://, file:// or a directory")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise _FetchError(f"cannot open it: {e.strerror or e}") from e
    with f:
        yield iter(lambda: f.read(_CHUNK), b""), os.fstat(f.fileno()).st_size


def show_progress(progress: Progress) -> bool:
    """Whether to draw a progress bar on stderr for the ``progress`` setting (see :data:`Progress`).

    Raises:
        InvalidArgumentError: ``progress`` is not ``True``, ``False`` or ``"always"``.
    """
    if isinstance(progress, str) and progress == "always":
        return True
    if not isinstance(progress, int):  # bool is an int; 0 / 1 keep working as before
        raise InvalidArgumentError(f"progress must be True (a bar on a terminal), False or 'always', got {progress!r}")
    if not progress:
        return False
    stderr = sys.stderr
    on_terminal = stderr is not None and hasattr(stderr, "isatty") and stderr.isatty()
    return on_terminal or _in_notebook()


def _in_notebook() -> bool:
    # tqdm.auto draws a widget in Jupyter, whose stderr is not a terminal; tqdm.autonotebook has
    # already decided (at import) whether it runs in one.
    from tqdm import autonotebook, std

    return autonotebook.tqdm is not std.tqdm


def _download(source: str, dst: Path, entry: WeightsEntry, progress: bool,
              validate: Callable[[Path], None] | None, timeout: float, max_bytes: int) -> None:
    digest = hashlib.sha256()
    received = 0
    deadline = time.monotonic() + timeout
    # The temporary file replaces dst only when the block completes: any error below removes it.
    with atomic_output(dst) as f:
        with _open_source(source, deadline, timeout) as (chunks, total):
            if total is not None and total > max_bytes:
                raise _FetchError(f"the server announces {total} bytes, more than the limit of {max_bytes} for "
                                  f"this checkpoint")
            with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=entry.file_name,
                      disable=not progress) as bar:
                for chunk in chunks:
                    received += len(chunk)
                    if received > max_bytes:
                        raise _FetchError(f"it is larger than the limit of {max_bytes} bytes for this checkpoint; "
                                          "stopped reading")
                    if time.monotonic() > deadline:
                        raise _FetchError(f"the download did not finish within {timeout:g} s (the limit for one "
                                          "weights download)")
                    f.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        f.flush()
        expected_size = total if total is not None else entry.size_bytes
        if expected_size is not None and received != expected_size:
            raise _FetchError(f"the transfer stopped after {received} of {expected_size} bytes")
        if entry.sha256 and digest.hexdigest() != entry.sha256:
            raise _FetchError(f"its sha256 is {digest.hexdigest()}, the manifest expects {entry.sha256}: "
                              "it is not the published file")
        if validate is not None:
            try:
                validate(Path(f.name))
            except ConvnetsError as e:
                raise _FetchError(f"it is not a usable {entry.model} checkpoint: {e}") from e
    _write_record(dst, digest.hexdigest())
    if entry.sha256:
        log.info("cached %s (sha256 %s)", dst, digest.hexdigest())
    else:
        _trusted_on_first_use(dst, f"downloaded from {source}", digest.hexdigest())


def _trusted_on_first_use(dst: Path, how: str, digest: str) -> None:
    """Say, once per file (its record is new), that a file without a published digest was taken as it is."""
    log.warning("%s (%s) has no published sha256 to check it against, so this first copy is trusted as it is: "
                "its sha256 %s is recorded in %s and every later load is verified against it. If it did not come "
                "from NVIDIA's NGC (or a mirror you trust), delete both files", dst.name, how, digest,
                _record_path(dst))


def _check_cached_copy(dst: Path, entry: WeightsEntry, validate: Callable[[Path], None] | None) -> str | None:
    """``None`` if the cached ``dst`` can be used; else a sentence that says what the cache now holds.

    A copy that no longer matches its known digest is damaged: it and its record are deleted.
    A file without a digest record that is not a usable checkpoint was put there by someone else
    (by hand, or another tool using torch.hub's folder): it is left alone and not used.
    """
    digest = sha256_file(dst)
    expected = entry.sha256 or _read_record(dst)
    if expected is None:
        # Placed by hand or by upstream's torch.hub (same directory and name): adopt it if it is
        # a usable checkpoint, and detect any later change from now on.
        try:
            if validate is not None:
                validate(dst)
        except ConvnetsError as e:
            log.warning("ignoring cached %s, which is not a usable checkpoint: %s", dst, e)
            return f"The file {dst} is in the cache but is not a usable checkpoint ({e}); it was left there and is not used."
        _write_record(dst, digest)
        _trusted_on_first_use(dst, "found in the cache, put there by hand or by torch.hub", digest)
        return None
    if digest != expected:
        log.warning("cached %s has sha256 %s but %s was recorded; deleting it and downloading it again",
                    dst, digest, expected)
        dst.unlink(missing_ok=True)
        _record_path(dst).unlink(missing_ok=True)
        return f"The damaged copy that was in the cache ({dst}) was deleted."
    return None


def fetch_weights(entry: WeightsEntry, *, progress: Progress = True,
                  validate: Callable[[Path], None] | None = None, timeout: float | None = None,
                  max_bytes: int | None = None) -> Path:
    """Return the path of a verified local copy of ``entry``'s checkpoint, downloading it if needed.

    Args:
        entry: the manifest entry.
        progress: ``True``: a progress bar on stderr while downloading when stderr is a terminal
            (or in a notebook); ``"always"``: whatever stderr is; ``False``: none.
        validate: called with a candidate file before it is accepted into the cache; raises a
            :class:`~convnets.errors.ConvnetsError` if the file is not the expected model.
        timeout: seconds the whole download may take; ``None``: :data:`DOWNLOAD_TIMEOUT_S` (an hour).
        max_bytes: the largest file accepted; ``None``: :func:`size_cap` of ``entry``.

    Returns:
        The cached file.

    Raises:
        WeightsUnavailableError: no verified copy could be obtained; the message names the file,
            the source, the reason and what the cache holds, and explains the offline options.
        InvalidArgumentError: ``progress`` has another value.
    """
    bar = show_progress(progress)
    dst = cache_dir() / entry.file_name
    source = resolve_source(entry)
    cached = "Nothing was cached."
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(exclusive_lock(dst.with_name(dst.name + ".lock"), timeout=LOCK_TIMEOUT_S))
            except OSError as e:
                if e.errno not in _NO_LOCKING:
                    raise
                log.warning("the file system of %s cannot lock files (%s): going on without the lock; "
                            "processes started together may each download the file", dst.parent, e)
            if dst.is_file():
                problem = _check_cached_copy(dst, entry, validate)
                if problem is None:
                    return dst
                cached = problem
            log.info("downloading %s from %s", entry.file_name, source)
            _download(source, dst, entry, bar, validate, DOWNLOAD_TIMEOUT_S if timeout is None else timeout,
                      size_cap(entry) if max_bytes is None else max_bytes)
            return dst
    except _FetchError as e:
        via = f" (from {MIRROR_ENV})" if os.environ.get(MIRROR_ENV, "").strip() else ""
        failed = (f"could not get {entry.file_name}, the pretrained weights of {entry.model}, from "
                  f"{source}{via}: {e}. {cached} To work offline, pass ")
        mirror = f"or set {MIRROR_ENV} to a directory or URL that holds {entry.file_name}."
        # The reason is in the message: no chain of the same words (a few lines in a notebook, not forty).
        raise WeightsUnavailableError(
            f"{failed}pretrained_from_file=PATH (--weights FILE on the command line; any checkpoint layout), {mirror}",
            cli=f"{failed}--weights FILE (any checkpoint layout), {mirror}", keyword="pretrained_from_file") from None
    except TimeoutError as e:
        raise WeightsUnavailableError(
            f"waited {LOCK_TIMEOUT_S:.0f} s for another process to finish downloading {dst}: {e}") from e
    except OSError as e:
        raise WeightsUnavailableError(f"cannot write the weights cache {dst.parent}: {e}. Set TORCH_HOME "
                                      "to a writable directory") from e
