"""Ray Data: classify and embed images beyond one machine (the ``ray`` extra).

:class:`Classifier` and :class:`Embedder` follow Ray Data's convention for batch inference: a class
whose ``__init__`` loads the model once per actor and whose ``__call__`` takes a batch (a dict of
NumPy arrays) and returns one, run as an actor pool by ``Dataset.map_batches``::

    import ray
    from convnets.ray import Classifier, pool_options

    ds = ray.data.read_binary_files("photos/", include_paths=True)
    ds = ds.map_batches(Classifier, fn_constructor_kwargs={"model": "resnext101_32x4d"}, batch_size=16,
                        **pool_options("cpu"))
    ds.write_parquet("predictions/")

A batch holds one of these columns, checked in this order:

* ``bytes``: encoded images (``read_binary_files``), decoded and preprocessed exactly as ``convnets
  predict`` does, so the answers are the same;
* ``image``: decoded arrays (``read_images``: uint8, height x width x channels). Ray's decoder made
  them, so EXIF orientation, ICC profiles and the decoder's own choices are whatever it did; the
  resize, crop and normalisation are still the package's;
* ``tensor``: batches that :class:`Preprocessor` made in CPU tasks (for GPU actors);
* ``input``: paths or URLs, read by the actor itself (what ``convnets predict --ray`` sends).

``path`` (or ``input``) is passed through as the rows' name. An input that cannot be read is one row
with its message in ``error`` (``""`` when it was read), never a failed batch.

``convnets predict --ray ADDRESS`` and ``convnets embed --ray ADDRESS`` run through :func:`iter_results`:
the driver lists the inputs, streams them through the pool in order and writes each record as it
arrives, so ``--output``, ``--resume`` and the output lock work as in a single process. Ray restarts a
dead actor and retries its batch; the ordered stream holds each input once.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from convnets.errors import InvalidArgumentError
from convnets.lazy import lazy_getattr

if TYPE_CHECKING:
    from convnets.inputs.listing import InputItem
    from convnets.ray.workers import Classifier, Embedder, Preprocessor, R, Worker

__all__ = ["CONNECT_TIMEOUT", "LOCAL", "Classifier", "Embedder", "Preprocessor", "Worker", "check_address", "connect",
           "iter_results", "pool_options"]

#: ``--ray local``: a new cluster on this machine, for this run.
LOCAL = "local"

__getattr__ = lazy_getattr(__name__, {name: "workers" for name in ("Classifier", "Embedder", "Preprocessor", "Worker")})


def _ray() -> Any:
    """``ray`` (with ``ray.data``), imported with its usage statistics off unless the user opted in to them
    (:mod:`convnets.deploy.telemetry`)."""
    from convnets.deploy.formats.base import require

    require("ray.data", extra="ray", purpose="Ray Data (convnets.ray, --ray)")
    return require("ray", extra="ray", purpose="Ray Data (convnets.ray, --ray)")


def pool_options(device: str | None = "cpu", *, spare_cpus: int = 1, grow: bool = True, most: int | None = None,
                 cpus: float | None = None, gpus: float | None = None) -> dict[str, Any]:
    """``map_batches`` options for :class:`Classifier` and :class:`Embedder` on the connected cluster: requests that
    cannot starve Ray's own tasks, on any cluster size. The pool grows from one actor as the work queues (``grow``),
    or starts whole.

    * CPU actors ask for one CPU each (PyTorch and the engines then run one thread each), at most one per CPU
      but ``spare_cpus``, which are left to the pipeline's tasks (``read_binary_files``, :class:`Preprocessor`).
      A cluster with no CPU to spare gets one actor that asks for none.
    * GPU actors (``"cuda"``) ask for a GPU and no CPU, one per GPU: every CPU is left to the tasks that decode.

    Args:
        device: ``"cpu"``, ``"cuda"``, or ``None``: CUDA when the cluster has GPUs.
        spare_cpus: CPUs the pool leaves free (0 when nothing else runs: ``convnets predict --ray`` sends the
            inputs from this process, ``from_items``).
        grow: start one actor and add more as the work queues; ``False``: start them all (``--ray``: a run with
            a known amount of work, where actors started late are throughput lost).
        most: at most this many actors (the blocks there are to compute: more would have nothing to do).
        cpus, gpus: the cluster's (default: what ``ray.cluster_resources()`` reports).
    """
    ray = _ray()
    resources = ray.cluster_resources()
    if gpus is None:
        gpus = resources.get("GPU", 0)
    if device is None:
        device = "cuda" if gpus else "cpu"
    if str(device).partition(":")[0] == "cuda":
        if int(gpus) < 1:
            raise InvalidArgumentError("device='cuda' but the Ray cluster has no GPU; add GPU nodes or use the CPU",
                                       keyword="device", cli="--device cuda but the Ray cluster has no GPU; add GPU "
                                                             "nodes or pass --device cpu")
        count, requests = int(gpus), {"num_gpus": 1, "num_cpus": 0}
    else:
        actors = int(cpus if cpus is not None else resources.get("CPU", 1)) - spare_cpus
        count, requests = max(1, actors), {"num_cpus": 1 if actors >= 1 else 0}
    size = min(count, most or count)
    return {"compute": ray.data.ActorPoolStrategy(min_size=1 if grow else size, max_size=size), **requests}


#: Seconds to wait for a cluster's address to accept a connection (ray.init itself retries for minutes).
CONNECT_TIMEOUT = 10.0


def check_address(address: str) -> None:
    """Refuse an address that is not ``auto``, ``local`` or ``[ray://]HOST:PORT``, or where nothing listens (within
    :data:`CONNECT_TIMEOUT`): ``ray.init`` itself retries for minutes.

    Raises:
        InvalidArgumentError: naming the address (``--ray`` on the command line).
    """
    import socket

    if address in (LOCAL, "auto"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    problem = None
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        problem = "it is not auto, local, HOST:PORT or ray://HOST:PORT"
    else:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
        except OSError as e:
            problem = f"nothing answers there ({e.strerror or e})"
    if problem is not None:
        raise InvalidArgumentError(f"ray address {address!r}: {problem}", keyword="ray",
                                   cli=f"--ray {address}: {problem}; start a cluster with `ray start --head`, or pass "
                                       "--ray local")


def connect(address: str) -> None:
    """Connect this process to a Ray cluster (``ray.init``), quietly: ``"local"`` starts one here; ``"auto"``,
    ``"host:port"`` and ``"ray://host:port"`` join a running one. Nothing is done when already connected.

    Raises:
        InvalidArgumentError: the address cannot be reached (``--ray`` on the command line).
    """
    ray = _ray()
    if ray.is_initialized():
        return
    check_address(address)
    try:
        # No dashboard for a cluster of our own (nothing to read it with, one port less); a joined one has its own.
        ray.init(address=address, logging_level=logging.WARNING,
                 **({"include_dashboard": False} if address == LOCAL else {}))
        # Ray Data logs each dataset's plan and timing at INFO on its own logger: the command line shows its own progress.
        logging.getLogger("ray.data").setLevel(logging.WARNING)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
        raise InvalidArgumentError(f"ray address {address!r} cannot be reached ({e})", keyword="ray",
                                   cli=f"--ray {address}: cannot connect to a Ray cluster there ({e}); start one "
                                       "with `ray start --head`, or pass --ray local") from e


#: What Ray core logs at error level once per driver process when an actor that may restart takes constructor
#: arguments by reference (ray-project/ray#53727). Ray Data 2.60 starts every actor of a pool with its own ray.put()
#: references (the data context, the map transformer) and max_restarts=-1, so any pool logs it, whatever the
#: actors' arguments (ray-project/ray#57733, open). Here it is a false alarm: the driver holds those references
#: until the run ends, so a restarted actor finds them (tests/test_ray.py kills actors mid-run).
_RESTART_FALSE_ALARM = re.compile(rb"^\[[^\]\n]*\] core_worker\.cc:\d+: Actor with class name: '[^'\n]*' and ID: '\w+' "
                                  rb"has constructor arguments in the object store and max_restarts > 0\.[^\n]*\n", re.M)


def _read_or_end(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError:  # closed under the read
        return b""


@contextlib.contextmanager
def _without_restart_false_alarm() -> Iterator[None]:
    """This process's stderr (the file descriptor, where Ray's C++ logging writes) passed through as it comes,
    less :data:`_RESTART_FALSE_ALARM`. Entered once the cluster runs: processes started inside would hold the pipe."""
    sys.stderr.flush()
    original = os.dup(2)
    reader, writer = os.pipe()
    os.dup2(writer, 2)
    os.close(writer)

    def send(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(original, view):]

    def forward() -> None:
        pending = b""
        # Until the last writer is gone; a process started meanwhile keeps a copy, so the pipe may be closed
        # under the read instead (below: 10 s at most), which ends it too.
        while chunk := _read_or_end(reader):
            lines, end, tail = (pending + chunk).rpartition(b"\n")
            out = _RESTART_FALSE_ALARM.sub(b"", lines + end)
            # A line that may be Ray's ("[time E pid tid] ...") waits for its end; the rest (progress bars) goes now.
            pending = tail if tail.startswith(b"[") else b""
            send(out + (b"" if pending else tail))
        send(pending)

    thread = threading.Thread(target=forward, name="convnets-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(original, 2)  # the pipe's last writer closed: the thread reads to its end
        thread.join(timeout=10)
        os.close(original)
        os.close(reader)


def iter_results(worker: type[Worker[R]], options: dict[str, Any], items: Sequence[InputItem], *, batch_size: int,
                 on_batch: Callable[[int], None] | None = None) -> Iterator[R]:
    """The results of ``worker`` (:class:`Classifier` or :class:`Embedder`, built with ``options``) over ``items``,
    computed on the connected cluster and yielded here in the items' order, as they arrive.

    Items that failed when they were listed are not sent. ``on_batch`` is called with the number of
    results after each block.
    """
    ray = _ray()
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # the records' order is the inputs'
    context.enable_progress_bars = False  # the driver shows its own
    with _without_restart_false_alarm():
        yield from _ordered_results(worker, options, items, batch_size=batch_size, on_batch=on_batch)


def _ordered_results(worker: type[Worker[R]], options: dict[str, Any], items: Sequence[InputItem], *,
                     batch_size: int, on_batch: Callable[[int], None] | None) -> Iterator[R]:
    ray = _ray()
    names = [name for name, error in items if error is None]
    rows: Iterator[dict[str, Any]] = iter(())
    if names:
        blocks = min(math.ceil(len(names) / batch_size), 10_000)
        dataset = ray.data.from_items([{"input": name} for name in names], override_num_blocks=blocks)
        # Nothing else here needs a CPU (from_items), and the amount of work is known: every actor at once.
        pool = pool_options(options.get("device"), spare_cpus=0, grow=False, most=blocks)
        dataset = dataset.map_batches(worker, fn_constructor_kwargs=options, batch_size=batch_size,
                                      batch_format="numpy", **pool)
        rows = _rows(dataset)
    count = 0
    for name, error in items:
        result = worker.result(name, None, error) if error is not None else worker.result(name, next(rows))
        yield result
        count += 1
        if on_batch is not None and count % batch_size == 0:
            on_batch(batch_size)
    if on_batch is not None and count % batch_size:
        on_batch(count % batch_size)


def _rows(dataset: Any) -> Iterator[dict[str, Any]]:
    for batch in dataset.iter_batches(batch_size=None, batch_format="numpy"):
        columns = list(batch)
        for i in range(len(batch["error"])):
            yield {column: batch[column][i] for column in columns}

