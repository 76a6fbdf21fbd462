"""Download, verification and caching of pretrained weights, against a real server on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import logging
import subprocess
import threading
import time
from pathlib import Path

import forked_cli
import pytest
import torch
from conftest import REPO, TINY, LoopbackServer, Route, randomize_bn, run_cli, start_cli
from reference import reference_forward
from test_checkpoints import LAYOUTS

import convnets
from convnets.errors import InvalidArgumentError, WeightsUnavailableError
from convnets.registry import _validate
from convnets.weights import download
from convnets.weights.manifest import WeightsEntry, load_manifest

SE = "se_resnext101_32x4d"
NGC_NAME = "nvidia_se-resnext101-32x4d_200821.pth.tar"
X = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))


def _checkpoint_bytes(name: str = SE, seed: int = 0) -> tuple[bytes, dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    state = randomize_bn(convnets.get_model(name, **TINY[name]), seed).state_dict()
    buffer = io.BytesIO()
    torch.save({f"module.{k}": v for k, v in state.items()}, buffer)
    return buffer.getvalue(), state


@pytest.fixture
def tiny(http_server: LoopbackServer):
    """A tiny SE-ResNeXt checkpoint served on loopback, its manifest entry and validator."""
    data, state = _checkpoint_bytes()
    http_server.routes["/w/tiny.pth.tar"] = Route(data)
    entry = dataclasses.replace(load_manifest()[SE], url=f"{http_server.base_url}/w/tiny.pth.tar",
                                file_name="tiny.pth.tar")
    spec = convnets.get_model(SE, **TINY[SE]).spec
    validate = functools.partial(_validate, name=SE, spec=spec, key_map_fn=None)
    return entry, data, validate


def _leftovers(folder: Path) -> list[str]:
    """Everything in the cache, lock files and temporary files included."""
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_download_caches_file_and_digest_record(tiny, http_server: LoopbackServer, isolated_cache: Path) -> None:
    entry, data, validate = tiny
    path = download.fetch_weights(entry, progress=False, validate=validate)
    assert path == isolated_cache / "tiny.pth.tar"
    assert path.read_bytes() == data
    digest = hashlib.sha256(data).hexdigest()
    assert (isolated_cache / "tiny.pth.tar.sha256").read_text().split() == [digest, "tiny.pth.tar"]
    assert download.fetch_weights(entry, progress=False, validate=validate) == path
    assert http_server.hits["/w/tiny.pth.tar"] == 1  # the second load came from the cache


def test_without_a_published_digest_the_first_copy_is_trusted_and_says_so_once(
        tiny, isolated_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    """NGC publishes no digests: the first download is taken as it is (trust on first use), and a warning says
    so once, with the digest recorded; later loads are verified quietly. A published digest needs no word."""
    entry, data, validate = tiny
    assert entry.sha256 is None and load_manifest()[SE].sha256 is None  # as the shipped manifest has it
    digest = hashlib.sha256(data).hexdigest()
    with caplog.at_level(logging.WARNING, logger="convnets.weights.download"):
        for _ in range(3):
            download.fetch_weights(entry, progress=False, validate=validate)
    notices = [r.getMessage() for r in caplog.records if "trusted" in r.getMessage()]
    assert len(notices) == 1 and digest in notices[0] and entry.url in notices[0], notices
    # A file put in the cache by hand (no record) is adopted the same way, and said so once.
    (isolated_cache / "tiny.pth.tar.sha256").unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="convnets.weights.download"):
        for _ in range(2):
            download.fetch_weights(entry, progress=False, validate=validate)
    assert len([r for r in caplog.records if "trusted" in r.getMessage()]) == 1
    for name in ("tiny.pth.tar", "tiny.pth.tar.sha256"):
        (isolated_cache / name).unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="convnets.weights.download"):
        download.fetch_weights(dataclasses.replace(entry, sha256=digest), progress=False, validate=validate)
    assert caplog.records == []


def test_cache_corrupted_after_the_fact_is_downloaded_again(tiny, http_server: LoopbackServer) -> None:
    entry, data, validate = tiny
    path = download.fetch_weights(entry, progress=False, validate=validate)
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # same size, same name: only the digest can tell
    path.write_bytes(bytes(damaged))
    assert download.fetch_weights(entry, progress=False, validate=validate).read_bytes() == data
    assert http_server.hits["/w/tiny.pth.tar"] == 2


@pytest.mark.parametrize("case", ["truncated", "html page", "404", "another model", "wrong sha256"])
def test_bad_download_never_lands_in_the_cache(case: str, tiny, http_server: LoopbackServer,
                                               isolated_cache: Path) -> None:
    entry, data, validate = tiny
    route = http_server.routes["/w/tiny.pth.tar"]
    expected = {
        "truncated": "stopped after|IncompleteRead|Connection broken",
        "html page": "not a usable se_resnext101_32x4d checkpoint",
        "404": "HTTP 404",
        "another model": "not a usable se_resnext101_32x4d checkpoint.*resnext101_32x4d",
        "wrong sha256": "manifest expects",
    }[case]
    if case == "truncated":
        route.declared_length = len(data)
        route.body = data[: len(data) // 3]
    elif case == "html page":
        route.body, route.content_type = b"<html><body>Please log in</body></html>", "text/html"
    elif case == "404":
        route.status, route.body = 404, b"missing"
    elif case == "another model":
        route.body, _ = _checkpoint_bytes("resnext101_32x4d")
    else:
        entry = dataclasses.replace(entry, sha256="0" * 64)
    with pytest.raises(WeightsUnavailableError, match=expected) as info:
        download.fetch_weights(entry, progress=False, validate=validate)
    assert "tiny.pth.tar" in str(info.value) and entry.url in str(info.value)
    assert "CONVNETS_WEIGHTS_MIRROR" in str(info.value) and "pretrained_from_file" in str(info.value)
    assert _leftovers(isolated_cache) == []
    assert "Nothing was cached" in str(info.value)


def test_success_leaves_only_the_file_and_its_record(tiny, isolated_cache: Path) -> None:
    entry, _, validate = tiny
    download.fetch_weights(entry, progress=False, validate=validate)
    assert _leftovers(isolated_cache) == ["tiny.pth.tar", "tiny.pth.tar.sha256"]


def test_damaged_copy_without_network_is_deleted_and_the_message_says_so(
        tiny, isolated_cache: Path, closed_port_url: str) -> None:
    entry, _, validate = tiny
    path = download.fetch_weights(entry, progress=False, validate=validate)
    damaged = bytearray(path.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))
    offline = dataclasses.replace(entry, url=f"{closed_port_url}/tiny.pth.tar")
    with pytest.raises(WeightsUnavailableError) as info:
        download.fetch_weights(offline, progress=False, validate=validate)
    message = str(info.value)
    assert "Nothing was cached" not in message
    assert f"The damaged copy that was in the cache ({path}) was deleted" in message
    assert _leftovers(isolated_cache) == []


def test_foreign_unusable_file_without_network_stays_and_the_message_says_where(
        tiny, isolated_cache: Path, closed_port_url: str) -> None:
    """A file someone else put under torch.hub's folder (no digest record) is not ours to delete."""
    entry, _, validate = tiny
    isolated_cache.mkdir(parents=True)
    (isolated_cache / "tiny.pth.tar").write_bytes(b"someone else's file")
    offline = dataclasses.replace(entry, url=f"{closed_port_url}/tiny.pth.tar")
    with pytest.raises(WeightsUnavailableError) as info:
        download.fetch_weights(offline, progress=False, validate=validate)
    message = str(info.value)
    assert "Nothing was cached" not in message
    assert f"{isolated_cache / 'tiny.pth.tar'} is in the cache but is not a usable checkpoint" in message
    assert "left there and is not used" in message
    assert _leftovers(isolated_cache) == ["tiny.pth.tar"]


_FETCH_WITH_PROGRESS = """
import dataclasses, sys
from convnets.weights.download import fetch_weights
from convnets.weights.manifest import load_manifest
entry = dataclasses.replace(load_manifest()["se_resnext101_32x4d"], url=sys.argv[1], file_name="tiny.pth.tar")
fetch_weights(entry) if sys.argv[2] == "default" else fetch_weights(entry, progress="always")
"""


@pytest.mark.parametrize("setting", ["default", "always"])
def test_progress_bar_only_on_a_terminal_unless_forced(setting: str, tiny, isolated_cache: Path) -> None:
    """stderr is a pipe here (a log file, a CI job): the default draws no bar, "always" does."""
    entry, data, _ = tiny
    result = run_cli(entry.url, setting, code=_FETCH_WITH_PROGRESS, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (isolated_cache / "tiny.pth.tar").read_bytes() == data
    bar = "tiny.pth.tar:" in result.stderr and "%|" in result.stderr
    assert bar == (setting == "always"), result.stderr[-500:]


def test_file_system_without_locks_still_downloads(tiny, isolated_cache: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import fcntl

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    entry, data, validate = tiny
    assert download.fetch_weights(entry, progress=False, validate=validate).read_bytes() == data
    assert _leftovers(isolated_cache) == ["tiny.pth.tar", "tiny.pth.tar.sha256"]


def test_progress_value_is_checked(tiny) -> None:
    entry, _, validate = tiny
    with pytest.raises(InvalidArgumentError, match="progress"):
        download.fetch_weights(entry, progress="yes", validate=validate)


def test_known_sha256_is_verified(tiny) -> None:
    entry, data, validate = tiny
    entry = dataclasses.replace(entry, sha256=hashlib.sha256(data).hexdigest())
    assert download.fetch_weights(entry, progress=False, validate=validate).read_bytes() == data


def test_file_already_in_the_cache_is_adopted(tiny, http_server: LoopbackServer, isolated_cache: Path) -> None:
    """A file upstream's torch.hub cached (same folder and name, no digest record) is reused."""
    entry, data, validate = tiny
    isolated_cache.mkdir(parents=True)
    (isolated_cache / "tiny.pth.tar").write_bytes(data)
    assert download.fetch_weights(entry, progress=False, validate=validate).read_bytes() == data
    assert http_server.hits["/w/tiny.pth.tar"] == 0
    assert (isolated_cache / "tiny.pth.tar.sha256").read_text().split()[0] == hashlib.sha256(data).hexdigest()


def test_unusable_file_in_the_cache_is_replaced(tiny, http_server: LoopbackServer, isolated_cache: Path) -> None:
    entry, data, validate = tiny
    isolated_cache.mkdir(parents=True)
    (isolated_cache / "tiny.pth.tar").write_bytes(b"partial garbage")
    assert download.fetch_weights(entry, progress=False, validate=validate).read_bytes() == data
    assert http_server.hits["/w/tiny.pth.tar"] == 1


def test_silent_server_times_out(tiny, http_server: LoopbackServer, monkeypatch: pytest.MonkeyPatch) -> None:
    entry, _, validate = tiny
    http_server.routes["/w/tiny.pth.tar"].gate = threading.Event()  # never set: no answer for 120 s
    monkeypatch.setattr(download, "READ_TIMEOUT_S", 0.5)
    start = time.monotonic()
    with pytest.raises(WeightsUnavailableError, match="timed out"):
        download.fetch_weights(entry, progress=False, validate=validate)
    assert time.monotonic() - start < 20


def test_concurrent_processes_download_once(tiny, http_server: LoopbackServer, isolated_cache: Path) -> None:
    """DDP ranks or notebooks loading the same weights at once share one verified download."""
    entry, data, _ = tiny
    http_server.routes["/w/tiny.pth.tar"].delay_s = 1.0  # keep the first download in flight
    script = f"""
import dataclasses, functools, sys
sys.path.insert(0, {str(REPO)!r}); sys.path.insert(0, {str(REPO / 'tests')!r})
import convnets
from conftest import TINY
from convnets.registry import _validate
from convnets.weights.download import fetch_weights
from convnets.weights.manifest import load_manifest
entry = dataclasses.replace(load_manifest()["{SE}"], url="{entry.url}", file_name="tiny.pth.tar")
spec = convnets.get_model("{SE}", **TINY["{SE}"]).spec
print(fetch_weights(entry, progress=False, validate=functools.partial(_validate, name="{SE}", spec=spec, key_map_fn=None)))
"""
    procs = [start_cli(code=script, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    outputs = [tuple(map(forked_cli.text, p.communicate(timeout=120))) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outputs]
    assert {out.strip() for out, _ in outputs} == {str(isolated_cache / "tiny.pth.tar")}
    assert http_server.hits["/w/tiny.pth.tar"] == 1
    assert (isolated_cache / "tiny.pth.tar").read_bytes() == data
    assert _leftovers(isolated_cache) == ["tiny.pth.tar", "tiny.pth.tar.sha256"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_through_the_mirror(layout: str, tiny, http_server: LoopbackServer,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror may hold any layout: the download is validated, cached and loads like the original."""
    entry, _, validate = tiny
    torch.manual_seed(5)
    state = randomize_bn(convnets.get_model(SE, **TINY[SE]), 5).state_dict()
    buffer = io.BytesIO()
    torch.save(LAYOUTS[layout](state), buffer)
    http_server.routes["/mirror/tiny.pth.tar"] = Route(buffer.getvalue())
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", f"{http_server.base_url}/mirror")
    path = download.fetch_weights(entry, progress=False, validate=validate)
    assert http_server.hits["/mirror/tiny.pth.tar"] == 1 and http_server.hits["/w/tiny.pth.tar"] == 0
    model = convnets.se_resnext101_32x4d(pretrained_from_file=path, **TINY[SE])
    tolerance = dict(rtol=2e-2, atol=2e-2) if layout == "fp16 tensors" else dict(rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), **tolerance)


# End to end through the public API, with a full-size checkpoint as NGC publishes it.

def _assert_loaded(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    assert not model.training
    with torch.no_grad():
        torch.testing.assert_close(model(X), reference_forward(state, X), rtol=1e-4, atol=1e-4)


def test_pretrained_from_mirror_url_then_cache(full_se_checkpoint, http_server: LoopbackServer,
                                               monkeypatch: pytest.MonkeyPatch, isolated_cache: Path) -> None:
    path, state = full_se_checkpoint
    http_server.routes[f"/mirror/{NGC_NAME}"] = Route(path.read_bytes())
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", f"{http_server.base_url}/mirror/")
    _assert_loaded(convnets.se_resnext101_32x4d(pretrained=True, progress=False), state)
    assert (isolated_cache / NGC_NAME).is_file()
    _assert_loaded(convnets.get_model(SE, pretrained=True, progress=False), state)
    assert http_server.hits[f"/mirror/{NGC_NAME}"] == 1


@pytest.mark.parametrize("form", ["directory", "file:// URL"])
def test_pretrained_from_local_mirror(form: str, full_se_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    path, state = full_se_checkpoint
    mirror = str(path.parent) if form == "directory" else path.parent.as_uri()
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", mirror)
    _assert_loaded(convnets.se_resnext101_32x4d(pretrained=True, progress=False), state)


def test_upstream_key_map_loads_a_ddp_wrapper_checkpoint_through_the_download(
        full_se_checkpoint, tmp_path: Path, http_server: LoopbackServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mirror holding a DDP-saved wrapper (``module.backbone.*``, NGC layout inside): the download
    is validated with the user's map, cached, and loads, as upstream's hub entry point does."""
    _, state = full_se_checkpoint
    buffer = io.BytesIO()
    torch.save({f"module.backbone.{k}": v for k, v in state.items()}, buffer)
    http_server.routes[f"/mirror/{NGC_NAME}"] = Route(buffer.getvalue())
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", f"{http_server.base_url}/mirror")
    model = convnets.se_resnext101_32x4d(pretrained=True, progress=False,
                                         state_dict_key_map_fn=lambda k: k[len("backbone."):])
    _assert_loaded(model, state)
    assert http_server.hits[f"/mirror/{NGC_NAME}"] == 1


def test_pretrained_with_new_head(full_se_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream failed its strict load here; the backbone is kept and a 10-class head is new."""
    path, state = full_se_checkpoint
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", str(path.parent))
    model = convnets.se_resnext101_32x4d(pretrained=True, num_classes=10, progress=False)
    assert model.fc.out_features == 10
    torch.testing.assert_close(model.layer4[2].conv3.weight, state["layer4.2.conv3.weight"])


def test_pretrained_rejects_architecture_overrides() -> None:
    with pytest.raises(ValueError, match="published architecture"):
        convnets.se_resnext101_32x4d(pretrained=True, layers=[1, 1, 1, 1])


@pytest.mark.parametrize("how", ["mirror unreachable", "no mirror, NGC unreachable"])
def test_offline_fails_fast_with_advice(how: str, closed_port_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "mirror unreachable":
        monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", closed_port_url)
    else:  # the real NGC host must never be contacted from tests: point the entry at a dead port
        entries = {k: dataclasses.replace(v, url=f"{closed_port_url}/{v.file_name}") for k, v in load_manifest().items()}
        monkeypatch.setattr("convnets.registry.load_manifest", lambda: entries)
    start = time.monotonic()
    with pytest.raises(WeightsUnavailableError) as info:
        convnets.se_resnext101_32x4d(pretrained=True, progress=False)
    assert time.monotonic() - start < 20  # no retries with back-off: a refused connection is final
    message = str(info.value)
    for needle in (NGC_NAME, "pretrained_from_file", "CONVNETS_WEIGHTS_MIRROR", "cannot reach 127.0.0.1"):
        assert needle in message


def test_cache_follows_torch_home(full_se_checkpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path, _ = full_se_checkpoint
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", str(path.parent))
    convnets.se_resnext101_32x4d(pretrained=True, progress=False)
    assert (tmp_path / "elsewhere" / "hub" / "checkpoints" / NGC_NAME).is_file()


def test_manifest_entries_are_complete() -> None:
    manifest = load_manifest()
    assert {"resnet50", "resnext101_32x4d", "se_resnext101_32x4d"} <= set(manifest)  # the NGC checkpoints
    assert set(manifest) <= set(convnets.list_models())  # a registered model may have no weights
    for name, entry in manifest.items():
        assert isinstance(entry, WeightsEntry)
        assert entry.url.startswith("https://api.ngc.nvidia.com/") and entry.url.endswith(entry.file_name)
        assert (entry.input_size, entry.resize_size, entry.num_classes) == (224, 256, 1000)
        assert entry.mean == (0.485, 0.456, 0.406) and entry.std == (0.229, 0.224, 0.225)
