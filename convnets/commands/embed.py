"""``convnets embed``: one vector per image, the pooled output of a ResNet stage, written to a file.

``--output FILE.npy`` writes float32 ``[N, D]`` with the inputs in ``FILE.npy.inputs.txt`` (same
order); ``--output FILE.parquet`` columns ``input`` and ``embedding``. Records stream into
``FILE.spool`` as batches finish and FILE is assembled at the end, so a killed run continues with
``--resume`` (see :mod:`convnets.inference.records`). Inputs that cannot be read are reported on stderr, get
no vector and leave the exit status at 1. The inputs, batches, workers and output options are
``convnets predict``'s (:mod:`convnets.commands.options`), and so is sharding under ``torchrun``:
each process embeds its share of the batches into a part (its spool), and rank 0 merges the parts
into FILE at the end (:mod:`convnets.inference.shard`).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack

from convnets.commands.options import (add_batch_arguments, add_compile_argument, add_device_argument, add_input_arguments,
                                       add_model_arguments, add_output_arguments, add_precision_argument,
                                       add_progress_argument, device_from_args, input_error_message, load_from_args,
                                       progress_from_args, skip_recorded, sources_from_args, workers_from_args)

from convnets.constants import DEFAULT_MODEL, LAYERS
from convnets.errors import InvalidArgumentError

__all__ = ["add_arguments", "run"]



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    add_input_arguments(parser)
    add_model_arguments(parser, default_weights="pretrained", default_model=DEFAULT_MODEL)
    group = parser.add_argument_group("embedding")
    group.add_argument("--layer", choices=LAYERS, default="layer4",
                       help="the stage whose output is averaged over the image: layer4 (default; the classifier's "
                            "input, 2048 values for the NGC models), layer3 (1024), layer2 (512), layer1 (256)")
    group.add_argument("--normalize", action="store_true", help="L2-normalise each vector")
    add_device_argument(parser)
    add_precision_argument(parser, help="fp32 (default); bf16 (CPUs with AVX512-BF16 or AMX, GPUs); fp16 (GPUs). "
                                        "The network runs like predict's torch engine: BatchNorm folded, "
                                        "channels_last; vectors are float32")
    add_compile_argument(parser, default=False, help="faster per image, but the first batch waits for the "
                                                     "compilation")
    add_batch_arguments(parser, default_batch_size=16)
    add_output_arguments(
        parser, required=True,
        output_help="where the vectors go; its suffix picks the format: .npy (float32 [N, D]; the inputs, one per "
                    "line, in FILE.inputs.txt) or .parquet (input, embedding; needs pyarrow). Written at the end "
                    "from FILE.spool, which grows as batches finish. An existing FILE is refused",
        resume_help="continue the FILE.spool that a stopped or killed run left: its torn last record is cut away "
                    "and the inputs it records are skipped")
    add_progress_argument(parser)


def run(args: argparse.Namespace) -> int:
    """Run ``convnets embed``; exit status 1 if any input could not be read."""
    from convnets.inference.records import check_embedding_destination, embedding_output_complete, spool_path
    from convnets.inference.shard import ShardedRun

    # Before PyTorch and the model load: a wrong --output fails at once.
    check_embedding_destination(args.output, resume=args.resume)
    if args.resume and embedding_output_complete(args.output):
        print(f"convnets embed: {args.output} is complete (no {spool_path(args.output).name} to continue); "
              "nothing to do", file=sys.stderr)
        return 0
    # Under torchrun, this process's shard of the inputs and its part of --output (see convnets.inference.shard).
    sharded = ShardedRun.from_env(output=args.output, batch_size=args.batch_size, reads_stdin=args.from_file == "-")
    part = sharded.part(args.output)
    if sharded.world > 1:
        if spool_path(args.output).exists():  # a single process's run: its spool is not split into parts
            raise InvalidArgumentError(f"{spool_path(args.output)} was left by a run of one process: continue it "
                                       "with one process (--resume, without torchrun), or delete it")
        check_embedding_destination(part, resume=args.resume)

    from tqdm.auto import tqdm

    from convnets.inference.embed import embed_items, features_model
    from convnets.inference.predict import iter_inputs
    from convnets.preprocessing.presets import preset_for_model
    from convnets.inference.records import open_embedding_writer, read_embedding_records
    from convnets.inference.shard import PartFiles

    device = sharded.join(device_from_args(args), resume=args.resume)
    model = load_from_args(args, device=device).model
    preset = preset_for_model(model).with_crop_size(args.image_size or model.input_size)
    net = features_model(model, args.layer, precision=args.precision, device=device, compile=args.compile)

    with ExitStack() as stack:
        # A shard's part stays a spool: rank 0 assembles FILE from all of them.
        writer, found = open_embedding_writer(part, dim=net.num_features, resume=args.resume, stack=stack,
                                              assemble=sharded.world == 1)
        items = sharded.items(iter_inputs(sources_from_args(args, stack), recursive=args.recursive))
        done = found.records if found else 0
        if done:
            items = skip_recorded(items, (r["input"] for r in read_embedding_records(part)), str(part))
        total, show = progress_from_args(args, sys.stderr.isatty(), sharded)
        failed = 0

        def on_batch(count: int) -> None:
            writer.flush()
            bar.update(count)
        with tqdm(total=total, initial=done, unit="img", disable=not show, file=sys.stderr) as bar:
            for result in embed_items(net, items, preset=preset, normalize=args.normalize,
                                      batch_size=args.batch_size, device=device, timeout=args.timeout,
                                      workers=workers_from_args(args, device), start=done, on_batch=on_batch):
                done += 1
                if result.ok:
                    writer.write({"input": result.input, "embedding": result.vector})
                    continue
                error = input_error_message(result.error)
                writer.write({"input": result.input, "error": error})
                failed += 1
                bar.clear()
                # One write per line: under torchrun the ranks share stderr (print() writes twice).
                sys.stderr.write(f"convnets embed: error: {error}\n")
    earlier = found.errors if found else 0
    # Under torchrun: totals over the ranks, and rank 0 merges the parts into --output.
    failed, earlier, done = sharded.finish([failed, earlier, done], files=PartFiles.embeddings(net.num_features))
    if (failed or earlier) and sharded.is_main:
        also = f" ({earlier} in the earlier run)" if earlier else ""
        print(f"convnets embed: {failed + earlier} of {done} inputs could not be read and have no vector{also}",
              file=sys.stderr)
    sharded.close()
    return 1 if failed or earlier else 0
