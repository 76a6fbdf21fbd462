"""``convnets serve`` under concurrent clients, against in-process ``predict`` on the same images and engine.

Usage (with the serve extra installed: ``pip install -c constraints.txt -e '.[serve]'``)::

    python benchmarks/bench_serve.py                           # SE-ResNeXt101, 1/8/32 clients, 3 rounds
    python benchmarks/bench_serve.py --model resnet50 --requests 32 --rounds 1    # a quick check

What it measures, with random weights (speed does not depend on them; a checkpoint is written once
to ``--folder`` so that the server and this process run the same weights, and the server's engine
loads from the engine cache):

* ``in process``: :func:`convnets.inference.predict.predict` over ``--requests`` JPEG files
  (decoding, preprocessing, the model, top-5) in batches of ``--max-batch-size``, on the engine the
  server picked (``--engine auto`` by default, as both commands do), decoding in this process as
  ``convnets predict`` does on a small machine;
* ``N clients``: ``convnets serve`` with the same options, and N threads here, each with its own
  ``tritonclient`` HTTP connection, sending one encoded image per request until ``--requests``
  images are answered: throughput (img/s), per-request latency p50 / p99 (over all rounds), the
  mean batch the dynamic batcher formed (Triton's statistics), and the throughput as a fraction
  of in-process in the same round (median, min-max).

Rounds interleave the variants in a rotated order. The clients run on the same cores as the server:
on a small machine their share of the CPU is part of what is measured, as is any other load on it.
Target: at least 0.8x in-process throughput at 8 clients or more.

Then what the server's front costs (``benchmarks/serve_front.py`` says how): a tiny model served, the same
requests through the front's ports and straight to Triton's own unix sockets, HTTP and gRPC at
``--front-clients`` clients, and the readiness endpoint's requests per second. Target: at most 5 % in
throughput and in p99 latency.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from convnets.deploy.benchmark import environment  # noqa: E402
from convnets.deploy.optimize import optimize_for_inference  # noqa: E402
from convnets.inference.predict import class_labels, predict  # noqa: E402
from convnets.preprocessing.presets import preset_for_model  # noqa: E402
from convnets.registry import choose_model, load_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results  # noqa: E402
import serve_front  # noqa: E402

log = logging.getLogger("bench_serve")

REPO = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.8
_READY = re.compile(r"HTTP http://127\.0\.0\.1:(\d+), gRPC 127\.0\.0\.1:(\d+)")


def make_images(folder: Path, count: int) -> list[Path]:
    """``count`` JPEGs of about 500x375 (ImageNet's typical size), from the example photos: crops and flips."""
    folder.mkdir(parents=True, exist_ok=True)
    examples = sorted(p for p in (REPO / "examples").iterdir() if p.suffix in (".png", ".jpg"))
    paths = []
    for i in range(count):
        path = folder / f"photo{i:03d}.jpg"
        if not path.exists():
            image = Image.open(examples[i % len(examples)]).convert("RGB")
            w, h = image.size
            left, top = (i * 7) % max(1, w // 5), (i * 11) % max(1, h // 5)
            image = image.crop((left, top, left + w * 4 // 5, top + h * 4 // 5)).resize((500, 375))
            (ImageOps.mirror(image) if i % 2 else image).save(path, quality=90)
        paths.append(path)
    return paths


def make_checkpoint(folder: Path, model: str) -> Path:
    """Random weights (BatchNorm statistics measured on random inputs) in a checkpoint, made once."""
    path = folder / f"{model}-random.pth"
    if not path.exists():
        chosen = choose_model(model, pretrained=False)
        torch.save({"state_dict": chosen.model.state_dict(), "arch_spec": chosen.model.spec.to_dict()}, path)
    return path


def start_server(python: str, checkpoint: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[str], int, int]:
    """``convnets serve`` on ``checkpoint`` as ``args`` say; its HTTP and gRPC ports."""
    command = [python, "-m", "convnets", "serve", "--weights", str(checkpoint), "--name", "bench", "--engine",
               args.engine, "--precision", args.precision, "--max-batch-size", str(args.max_batch_size),
               "--max-queue-delay-ms", str(args.max_queue_delay_ms), "--http-port", "0", "--grpc-port", "0",
               "--metrics-port", "0"]
    log.info("starting %s", " ".join(command))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.stdout is not None
    line = process.stdout.readline()
    ready = _READY.search(line)
    if not ready:
        process.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return process, int(ready.group(1)), int(ready.group(2))


def stats(port: int) -> tuple[int, int]:
    """Triton's (inference count, execution count) of the model so far."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/bench/stats", timeout=30) as response:
        model = json.load(response)["model_stats"][0]
    return int(model["inference_count"]), int(model["execution_count"])


def served_run(port: int, images: list[bytes], clients: int) -> tuple[float, list[float], float]:
    """``clients`` threads send one image per request until every image is answered.

    Returns:
        Images per second, each request's latency in ms, and the mean batch Triton executed.
    """
    import tritonclient.http as httpclient

    work: queue.Queue[bytes] = queue.Queue()
    for data in images:
        work.put(data)
    latencies: list[float] = []
    lock = threading.Lock()
    connections = [httpclient.InferenceServerClient(f"127.0.0.1:{port}", network_timeout=600)
                   for _ in range(clients)]

    def client(http: Any) -> None:
        while True:
            try:
                data = work.get_nowait()
            except queue.Empty:
                return
            tensor = httpclient.InferInput("image", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[data]], dtype=object))
            start = time.perf_counter()
            http.infer("bench", [tensor], outputs=[httpclient.InferRequestedOutput("top_indices")])
            with lock:
                latencies.append(1000 * (time.perf_counter() - start))
    before = stats(port)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, connections))
    seconds = time.perf_counter() - start
    after = stats(port)
    for http in connections:
        http.close()
    return len(images) / seconds, latencies, (after[0] - before[0]) / max(1, after[1] - before[1])


def measure_front(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`serve_front.measure` on a tiny model served as the module doc says, with the load average around it."""
    options = argparse.Namespace(engine="torch", precision="fp32", max_batch_size=16, max_queue_delay_ms=0.0)
    load_before = os.getloadavg()[0]
    server, http_port, grpc_port = start_server(args.serve_python, serve_front.tiny_checkpoint(args.folder), options)
    try:
        front = serve_front.measure(server.pid, http_port, grpc_port, args.front_clients, args.front_requests,
                                    args.front_rounds, args.readiness_seconds)
    finally:
        server.send_signal(2)
        server.wait(timeout=120)
    return {**front, "load_average": [load_before, os.getloadavg()[0]]}


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="se_resnext101_32x4d")
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-queue-delay-ms", type=float, default=5.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="images per measurement (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median reported)")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/convnets_bench_serve"),
                        help="where the JPEGs and the random-weights checkpoint are kept")
    parser.add_argument("--serve-python", default=sys.executable,
                        help="the interpreter that runs `convnets serve` (one with the serve extra; default: this one)")
    parser.add_argument("--front-clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--front-requests", type=int, default=256, help="front: requests per measurement (default 256)")
    parser.add_argument("--front-rounds", type=int, default=8, help="front: interleaved rounds (default 8)")
    parser.add_argument("--readiness-seconds", type=float, default=3.0,
                        help="front: seconds per readiness measurement (default 3)")
    results.add_output_option(parser, "bench_serve")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    paths = make_images(args.folder / "images", 32)
    files = [paths[i % len(paths)] for i in range(args.requests)]
    images = [p.read_bytes() for p in files]
    checkpoint = make_checkpoint(args.folder, args.model)
    load_before = os.getloadavg()[0]
    server, port, _ = start_server(args.serve_python, checkpoint, args)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/bench/config", timeout=30) as response:
            engine = json.load(response)["parameters"]["engine"]["string_value"]
        model = load_model(checkpoint)
        net = optimize_for_inference(model, args.precision, engine=engine, compile=False)
        labels, preset = class_labels(model), preset_for_model(model)

        def in_process() -> float:
            start = time.perf_counter()
            for result in predict(net, [str(f) for f in files], labels=labels, preset=preset,
                                  batch_size=args.max_batch_size, workers=0):
                assert result.ok, result.error
            return len(files) / (time.perf_counter() - start)

        variants = ["in process", *(f"{c} clients" for c in args.clients)]
        log.info("warm-up (engine %s)", engine)
        in_process()
        served_run(port, images[:args.max_batch_size], args.max_batch_size)
        speed: dict[str, list[float]] = {v: [] for v in variants}
        latency: dict[str, list[float]] = {v: [] for v in variants}
        batch: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            shift = r % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                if variant == "in process":
                    speed[variant].append(in_process())
                    continue
                img_s, ms, mean_batch = served_run(port, images, int(variant.split()[0]))
                speed[variant].append(img_s)
                latency[variant] += ms
                batch[variant].append(mean_batch)
            log.info("round %d/%d: %s", r + 1, args.rounds, ", ".join(f"{v} {s[-1]:.2f} img/s" for v, s in speed.items()))
    finally:
        server.send_signal(2)
        server.wait(timeout=120)
    load_after = os.getloadavg()[0]
    front = measure_front(args)
    base = speed["in process"]
    rows = []
    for variant in variants:
        ratios = [s / b for s, b in zip(speed[variant], base)]
        rows.append({"variant": variant, "img_per_s": statistics.median(speed[variant]),
                     "img_per_s_all_rounds": speed[variant], "vs_in_process": statistics.median(ratios),
                     "vs_in_process_min_max": [min(ratios), max(ratios)],
                     "p50_ms": percentile(latency[variant], 50) if latency[variant] else None,
                     "p99_ms": percentile(latency[variant], 99) if latency[variant] else None,
                     "mean_batch": statistics.mean(batch[variant]) if batch[variant] else None})
    concurrent = [row for row in rows if row["variant"] != "in process" and int(row["variant"].split()[0]) >= 8]
    results.save(args.json, environment("cpu"), {
        "model": args.model, "engine": engine, "precision": args.precision, "requests": args.requests,
        "image": "500x375 JPEG", "max_batch_size": args.max_batch_size, "queue_delay_ms": args.max_queue_delay_ms,
        "rounds": args.rounds, "target_ratio": TARGET_RATIO,
        "worst_ratio_from_8_clients": min((row["vs_in_process"] for row in concurrent), default=None),
        "load_average": [load_before, load_after], "rows": rows, "front": front})
    for row in [*rows, *front["rows"]]:
        print(row)
    print("readiness req/s", front["readiness_per_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
