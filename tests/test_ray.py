"""``--ray`` and :mod:`convnets.ray` on a real two-node Ray cluster started on this machine (``ray.cluster_utils``):
no mock of Ray.

The runs through the cluster are compared with single-process runs of the same command on the same
folder (subfolders, two unreadable files): the same records in the same order, probabilities within
1e-5, the same vectors. One run has its busiest actor SIGKILLed while the output is being written, and
another loses a whole node: Ray restarts the actors, and the output still holds each input once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TINY, LoopbackServer, Route, cli_in_process, run_cli, start_cli
from PIL import Image
from strict_skips import require_module

import convnets
from convnets.deploy.engines.base import EngineSettings

ray = require_module("ray", extra="ray")
psutil = require_module("psutil")

BATCH = 2
N_GOOD = 120  # + 2 unreadable files, in two subfolders: enough batches that a fault meets an actor at work

#: The cluster's processes read it; this module's runs send Ray no usage statistics.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _write_images(folder: Path, count: int, size: tuple[int, int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for i in range(count):
        sub = folder / f"part{i % 2}"
        sub.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 255, (*size, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(sub / f"img{i:03d}.{'png' if i % 3 else 'jpg'}")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny model's checkpoint, a folder of images with two unreadable files, and the single-process runs."""
    root = tmp_path_factory.mktemp("ray")
    torch.manual_seed(0)
    model = convnets.get_model("resnet50", **TINY["resnet50"])
    ckpt = root / "tiny.pth.tar"
    torch.save({"state_dict": model.state_dict(), "arch_spec": model.spec.to_dict()}, ckpt)
    images = root / "images"
    _write_images(images, N_GOOD, (60, 80), seed=0)
    (images / "part0" / "broken.png").write_bytes(b"not an image")
    good = (images / "part1" / "img001.png").read_bytes()
    (images / "part1" / "cut.png").write_bytes(good[: len(good) // 2])
    args = ["--weights", str(ckpt), "--image-size", "48", "--batch-size", str(BATCH), "--no-progress", "--recursive",
            "--device", "cpu", "--engine", "torch"]
    single = root / "single"
    single.mkdir()
    runs = [cli_in_process("predict", str(images), *args, "--output", str(single / "p.jsonl")),
            cli_in_process("embed", str(images), *args, "--output", str(single / "e.npy"))]
    assert [r.returncode for r in runs] == [1, 1], [r.stderr[-2000:] for r in runs]
    return {"root": root, "ckpt": ckpt, "images": images, "args": args, "single": single,
            "errors": _error_lines(runs[0].stderr)}


@pytest.fixture(scope="module")
def cluster() -> Any:
    """Two nodes of one CPU each, started here and stopped at the end of the module."""
    from ray.cluster_utils import Cluster

    # A lost node (its raylet gone: refused at once) is declared dead after 3 failed health checks 1 s apart (default:
    # 5, 3 s apart); a raylet slowed by a busy machine still has the default 10 s to answer each.
    health = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                          "_system_config": health})
    nodes.add_node(num_cpus=1)
    nodes.wait_for_nodes()
    yield nodes
    if ray.is_initialized():
        ray.shutdown()
    nodes.shutdown()


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("convnets ") and ": error: " in line]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_same_predictions(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["input"] for r in got] == [r["input"] for r in want]  # each input once, in the single run's order
    for g, w in zip(got, want):
        assert g.get("error") == w.get("error"), g["input"]
        if "top" in w:
            assert [(t["index"], t["label"]) for t in g["top"]] == [(t["index"], t["label"]) for t in w["top"]]
            assert np.allclose([t["probability"] for t in g["top"]], [t["probability"] for t in w["top"]],
                               rtol=0, atol=1e-5)


def _map_workers() -> list[Any]:
    """The processes of Ray Data's actors (their title is ``ray::MapWorker(MapBatches(...))``)."""
    return [p for p in psutil.process_iter(["cmdline"]) if any("MapWorker" in part for part in p.info["cmdline"] or [])]


def _predict_through_a_fault(data: dict[str, Any], cluster: Any, server: LoopbackServer, name: str,
                             fault: Callable[[], None]) -> None:
    """``predict --ray`` with ``fault`` done mid-run: each input once, in order, the same records, errors and exit
    status as one process.

    Mid-run for certain, on a machine of any speed: the first input is a URL of the test's server, which answers
    only after the fault. The fault comes once an actor has asked for it; the run cannot end before the answer (the
    records are written in order), while the other actor works through the folder."""
    output = data["root"] / f"{name}.jsonl"
    spool = output.with_name(output.name + ".partial.jsonl")
    photo = data["images"] / "part1" / "img001.png"
    server.routes["/first.png"] = gate = Route(photo.read_bytes(), content_type="image/png", gate=threading.Event())
    url = f"{server.base_url}/first.png"
    run = start_cli("predict", url, str(data["images"]), *data["args"], "--output", str(output), "--ray",
                    cluster.address, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not server.hits["/first.png"]:  # an actor waits for the first input's answer
            assert run.poll() is None, (run.communicate()[1] or b"")[-3000:].decode()
            assert time.monotonic() < deadline, "no actor asked for the first input"
            time.sleep(0.01)
        fault()
        mid_run = run.poll() is None
        assert gate.gate is not None
        gate.gate.set()
        stderr = (run.communicate(timeout=240)[1] or b"").decode()
    finally:
        if run.poll() is None:
            run.kill()
    assert mid_run, "the run ended before the fault"
    assert run.returncode == 1, stderr[-3000:]  # the two unreadable files
    first, *rest = _records(output)
    _assert_same_predictions(rest, _records(data["single"] / "p.jsonl"))
    (same,) = [r for r in rest if r["input"] == str(photo)]
    _assert_same_predictions([{**first, "input": same["input"]}], [same])  # the URL served that file's bytes
    assert first["input"] == url
    assert _error_lines(stderr) == data["errors"] and len(data["errors"]) == 2
    assert stderr.splitlines()[-1] == f"convnets predict: 2 of {N_GOOD + 3} inputs could not be read"
    assert not spool.exists() and not output.with_name(output.name + ".lock").exists()


def test_predict_on_a_cluster_equals_one_process_though_a_worker_is_killed(data: dict[str, Any], cluster: Any,
                                                                           http_server: LoopbackServer) -> None:
    """The busiest actor is SIGKILLed mid-run: Ray restarts it and reruns its batches."""
    def kill_the_busiest() -> None:
        max(_map_workers(), key=lambda p: sum(p.cpu_times()[:2])).send_signal(signal.SIGKILL)

    _predict_through_a_fault(data, cluster, http_server, "killed", kill_the_busiest)


def test_embed_on_a_cluster_equals_one_process(data: dict[str, Any], cluster: Any) -> None:
    output = data["root"] / "cluster.npy"
    embedded = run_cli("embed", str(data["images"]), *data["args"], "--output", str(output), "--ray", cluster.address,
                       timeout=240)
    assert embedded.returncode == 1, embedded.stderr[-3000:]
    assert _error_lines(embedded.stderr) == [line.replace("predict", "embed", 1) for line in data["errors"]]
    # No error-level line of Ray's C++ logging ("[time E pid tid] file:line: ..."): Ray Data's false alarm about
    # its own actors' arguments (convnets.ray._RESTART_FALSE_ALARM) is not shown; the rest of stderr is.
    assert not re.search(r"^\[[^\]\n]* E \d+ \d+\] ", embedded.stderr, re.M), embedded.stderr[-3000:]
    assert embedded.stderr.strip().splitlines()[-1].startswith(f"convnets embed: 2 of {N_GOOD + 2} inputs could not")
    assert (data["root"] / "cluster.npy.inputs.txt").read_bytes() == (data["single"] / "e.npy.inputs.txt").read_bytes()
    got, want = np.load(output), np.load(data["single"] / "e.npy")
    assert got.shape == want.shape == (N_GOOD, 256) and np.allclose(got, want, rtol=0, atol=1e-5)


def test_python_api_classifies_bytes_and_embeds_arrays(data: dict[str, Any], cluster: Any) -> None:
    """``read_binary_files`` (bytes, decoded as predict decodes) through :class:`~convnets.ray.Preprocessor` in CPU
    tasks and :class:`~convnets.ray.Classifier` in actors; :class:`~convnets.ray.Embedder` on a batch of
    ``read_images``' arrays (called here: an actor pool of it runs in test_embed_on_a_cluster_equals_one_process).
    An unreadable file is a row with its error, not a failed batch."""
    from convnets.ray import Classifier, Embedder, Preprocessor, pool_options

    few = data["root"] / "few"
    _write_images(few, 6, (60, 80), seed=2)
    (few / "broken.png").write_bytes(b"not an image")
    single = [cli_in_process("predict", str(few), *data["args"], "--output", str(data["root"] / "few.jsonl")),
              cli_in_process("embed", str(few), *data["args"], "--output", str(data["root"] / "few.npy"))]
    assert [r.returncode for r in single] == [1, 1], [r.stderr[-2000:] for r in single]
    want = {r["input"]: r for r in _records(data["root"] / "few.jsonl")}
    vectors = dict(zip((data["root"] / "few.npy.inputs.txt").read_text().splitlines(), np.load(data["root"] / "few.npy")))
    model = convnets.load_model(data["ckpt"])
    kwargs = {"model": model, "image_size": 48, "device": "cpu", "engine": "torch"}
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        # The GPU pattern, on CPUs: decoding in tasks (one CPU left for them), the model in the actors.
        encoded = ray.data.read_binary_files(str(few), include_paths=True)
        staged = encoded.map_batches(Preprocessor(model, image_size=48), batch_size=BATCH, num_cpus=1)
        rows = staged.map_batches(Classifier, fn_constructor_kwargs=kwargs, batch_size=BATCH,
                                  **pool_options("cpu")).take_all()
        assert sorted(row["path"] for row in rows) == sorted(want)  # each file once
        for row in rows:
            _check_row(row, want[row["path"]])
        # Ray's decoder's arrays, read by Ray; the Embedder called here on them (its pool is the Classifier's code).
        arrays = ray.data.read_images(sorted(vectors), include_paths=True, mode="RGB").take_batch(len(vectors))
        assert ray.get(_settings_in_an_actor.remote(kwargs, EngineSettings())) == (1, {
            "INFERENCE_NUM_THREADS": 1, "ENABLE_CPU_PINNING": False})
        asked = EngineSettings(threads=2, runtime={"openvino": {"ENABLE_CPU_PINNING": True}})
        assert ray.get(_settings_in_an_actor.remote(kwargs, asked)) == (2, {
            "INFERENCE_NUM_THREADS": 2, "ENABLE_CPU_PINNING": True})
    finally:
        ray.shutdown()
    out = Embedder(**kwargs)(arrays)
    embedded = [{column: out[column][i] for column in out} for i in range(len(out["path"]))]
    assert sorted(r["path"] for r in embedded) == sorted(vectors)
    for row in embedded:  # PNGs and JPEGs without EXIF: Ray's decoder gives PIL's pixels
        assert row["error"] == "" and np.allclose(row["embedding"], vectors[row["path"]], rtol=0, atol=1e-5)


def test_predict_on_a_cluster_finishes_though_a_node_is_lost(data: dict[str, Any], cluster: Any,
                                                             http_server: LoopbackServer) -> None:
    """The node without the driver is removed mid-run (its raylet and actor SIGKILLed): Ray marks it dead, restarts its
    actor on the other node once that node's actor has a free CPU (when the rest of the work is done), and reruns the
    lost batches; the records wait for them, in order. A node like it is added back for the tests after this one."""
    def lose_a_node() -> None:
        cluster.remove_node(next(n for n in cluster.list_all_nodes() if n is not cluster.head_node),
                            allow_graceful=False)

    try:
        _predict_through_a_fault(data, cluster, http_server, "node-lost", lose_a_node)
    finally:
        if len(cluster.list_all_nodes()) < 2:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()


@ray.remote(num_cpus=1)
def _settings_in_an_actor(kwargs: dict[str, Any], settings: Any) -> tuple[int | None, dict[str, Any]]:
    """A one-CPU Ray worker's :class:`~convnets.ray.Classifier`: its threads, and what OpenVINO would be given. Its
    threads are the worker's CPUs and are not pinned: OpenVINO pins each process's threads to the first cores, so
    every actor of a node ran on the same core (half speed with two, benchmarks/bench_ray.py)."""
    from convnets.ray import Classifier

    classifier = Classifier(**{**kwargs, "settings": settings})
    return classifier.settings.threads, classifier.settings.runtime_options("openvino")


def _check_row(row: dict[str, Any], expected: dict[str, Any]) -> None:
    if "error" in expected:  # the message names the bytes, not the file: Ray read them
        assert row["error"].startswith("Cannot load image ")
        assert list(row["top_indices"]) == [-1] * len(row["top_indices"]) and len(row["top_labels"]) == 0
        return
    assert row["error"] == ""
    assert list(row["top_indices"]) == [t["index"] for t in expected["top"]]
    assert list(row["top_labels"]) == [t["label"] for t in expected["top"]]
    assert np.allclose(row["top_probabilities"], [t["probability"] for t in expected["top"]], rtol=0, atol=1e-5)


def test_unreachable_address_is_one_line(closed_port_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at once, before the model loads (its loading is made to fail here: it is never reached)."""
    import convnets.commands.predict

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model loaded before the address was checked")

    monkeypatch.setattr(convnets.commands.predict, "load_from_args", never)
    assert not ray.is_initialized()  # else --ray would use this process's connection
    port = closed_port_url.rsplit(":", 1)[1].strip("/")
    started = time.monotonic()
    proc = cli_in_process("predict", "examples/", "--random-init", "--ray", f"127.0.0.1:{port}")
    assert proc.returncode == 2 and time.monotonic() - started < 60  # no retries: a refused connection is final
    assert proc.stderr.strip().splitlines()[-1].startswith(f"convnets predict: error: --ray 127.0.0.1:{port}: "
                                                            "nothing answers there")


@pytest.mark.parametrize("options, message", [
    (["--workers", "2"], "--workers sets this process's decoding"),
    (["--show", "sheet.png"], "--show draws contact sheets"),
    (["--decode", "device"], "--decode device decodes on this process's device"),
])
def test_options_a_cluster_cannot_honour_are_refused(tmp_path: Path, options: list[str], message: str) -> None:
    proc = cli_in_process("predict", "examples/", "--random-init", "--ray", "auto",
                          *[str(tmp_path / o) if o.endswith(".png") else o for o in options])
    assert proc.returncode != 0 and message in proc.stderr


def test_predict_under_torchrun_points_to_ray() -> None:
    proc = cli_in_process("embed", "examples/", "--random-init", "--output", "x.npy",
                          env={"RANK": "0", "WORLD_SIZE": "2"})
    assert proc.returncode != 0 and "not under torchrun" in proc.stderr and "--ray ADDRESS" in proc.stderr


def test_a_missing_ray_extra_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    proc = cli_in_process("predict", "examples/", "--random-init", "--ray", "local")
    assert proc.returncode == 1
    (line,) = [line for line in proc.stderr.splitlines() if "error" in line]
    assert "install the 'ray' extra" in line and ".[ray]" in line


def test_the_docs_block_without_weights_stops_on_the_driver_in_a_few_lines_naming_the_fix(tmp_path: Path) -> None:
    """docs/ray.md's block with nothing to get the weights from (an empty mirror): one error at its first line,
    before Ray starts, with the builder's keyword for a checkpoint, not hundreds of lines of actor retries."""
    from test_docs import python_blocks

    (block,) = [b for b in python_blocks(Path(__file__).parents[1] / "docs" / "ray.md") if b.not_run is None]
    empty = tmp_path / "mirror"
    empty.mkdir()
    (tmp_path / "examples").symlink_to(Path(__file__).parents[1] / "examples")
    done = run_cli(code=block.code, cwd=tmp_path, env={"CONVNETS_WEIGHTS_MIRROR": str(empty)}, timeout=240)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) <= 20, done.stderr[-3000:]
    assert lines[-1].startswith("convnets.errors.WeightsUnavailableError: could not get ")
    assert "pass pretrained_from_file=PATH" in lines[-1] and "CONVNETS_WEIGHTS_MIRROR" in lines[-1]
    assert "Ray instance" not in done.stderr and not (tmp_path / "predictions").exists()  # it stopped before Ray


def test_a_classifier_without_weights_advises_its_own_keyword(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An actor given a name gets the weights itself: its error advises ``weights=PATH``, Classifier's keyword."""
    from convnets.errors import WeightsUnavailableError
    from convnets.ray import Classifier

    monkeypatch.setenv("CONVNETS_WEIGHTS_MIRROR", str(tmp_path))  # holds no weights
    with pytest.raises(WeightsUnavailableError) as caught:
        Classifier("se_resnext101_32x4d", topk=3)
    assert "pass weights=PATH" in str(caught.value) and "pretrained_from_file" not in str(caught.value)
    assert caught.value.keyword == "weights" and "--weights FILE" in caught.value.message_for("cli")


def test_only_ray_s_restart_false_alarm_is_kept_off_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    """What reaches file descriptor 2 in a run goes through at once and whole (a progress bar's partial line
    too), but the one line Ray core logs about Ray Data's own actors (see convnets.ray._RESTART_FALSE_ALARM)."""
    from convnets.ray import _without_restart_false_alarm

    alarm = ("[2026-11-29 08:19:56,476 E 10556 10556] core_worker.cc:2465: Actor with class name: 'MapWorker(MapBatches("
             "Classifier))' and ID: 'e7bb025178efbb749c347f7501000000' has constructor arguments in the object store "
             "and max_restarts > 0. If the arguments in the object store go out of scope or are lost, the actor restart "
             "will fail. See https://github.com/ray-project/ray/issues/53727 for more details.\n")
    other = "[2026-11-29 08:19:57,000 E 10556 10557] task_manager.cc:1545: Failed to push error to driver\n"
    with _without_restart_false_alarm():
        os.write(2, b"convnets predict: 3 inputs\n[2026-11-29 08:19:56,476 E 10556 10556] core_")
        os.write(2, alarm.encode()[len("[2026-11-29 08:19:56,476 E 10556 10556] core_"):])
        os.write(2, other.encode() + b"\r 50%|#####     |")
        os.write(2, b" 60%|######    |\n")
    assert capfd.readouterr().err == f"convnets predict: 3 inputs\n{other}\r 50%|#####     | 60%|######    |\n"
