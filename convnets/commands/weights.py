"""``convnets weights``: which pretrained weights exist, whether they are cached, fetching and converting.

Fetching ahead of time is how an air-gapped machine or a cluster job gets its weights: run
``convnets weights fetch NAME`` where the network is reachable, then copy the cache directory, or
point ``CONVNETS_WEIGHTS_MIRROR`` at a directory holding the files.

``convnets weights convert IN OUT.safetensors`` rewrites any checkpoint the package reads (every
layout) as a safetensors file with the architecture, class names and image size in its metadata.

torch and the registry are imported inside :func:`run`, so ``--help`` and usage errors answer at once.
"""

from __future__ import annotations

import argparse
import json

from convnets.commands.options import add_force_argument, add_json_argument
from convnets.constants import MIRROR_ENV
from convnets.errors import InvalidArgumentError



def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.add_argument("action", nargs="?", choices=["list", "fetch", "convert"], default="list",
                        help="list (default): models, files and cache state; fetch: download and verify; "
                             "convert IN OUT.safetensors: rewrite a checkpoint as safetensors")
    parser.add_argument("models", nargs="*", metavar="MODEL",
                        help="fetch: models to fetch (default: all); convert: the input and output files")
    add_json_argument(parser, help="the list")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="fetch: download progress bar on stderr (default: when stderr is a terminal)")
    parser.add_argument("--use-ema", action="store_true",
                        help="convert: take the EMA weights of a training checkpoint")
    add_force_argument(parser, what="convert's OUT file")
    parser.epilog = f"Cache: torch.hub.get_dir()/checkpoints (set TORCH_HOME to move it). Mirror: ${MIRROR_ENV}."


def run(args: argparse.Namespace) -> int:
    """Run ``convnets weights``."""
    if args.action == "convert":
        return _convert(args)
    from convnets.weights.download import cache_dir, resolve_source
    from convnets.weights.manifest import load_manifest

    manifest = load_manifest()
    if args.action == "fetch":
        from convnets.registry import fetch_pretrained

        # None: a bar only on a terminal; --progress: always; --no-progress: never.
        progress = {None: True, True: "always", False: False}[args.progress]
        for name in args.models or sorted(manifest):
            print(fetch_pretrained(name, progress=progress))  # type: ignore[arg-type]
        return 0
    if args.models:
        raise InvalidArgumentError("model names go with 'fetch'; 'list' shows all models")
    rows = [{"model": name, "file": e.file_name, "cached": (cache_dir() / e.file_name).is_file(),
             "path": str(cache_dir() / e.file_name), "source": resolve_source(e), "sha256": e.sha256,
             "top1": e.top1} for name, e in sorted(manifest.items())]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for r in rows:
        print(f"{r['model']:<20} {'cached' if r['cached'] else 'not cached':<10} {r['file']}  <- {r['source']}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    if len(args.models) != 2:
        raise InvalidArgumentError(f"convert takes two files, IN and OUT.safetensors; got {len(args.models)}: "
                                   f"{' '.join(args.models) or '(none)'}")
    src, dst = (Path(p) for p in args.models)
    if dst.suffix.lower() != ".safetensors":
        raise InvalidArgumentError(f"the output file {dst} must end in .safetensors")
    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise InvalidArgumentError(f"convert would overwrite its input {src}; name another output file")
    if os.path.lexists(dst) and not args.force:
        raise InvalidArgumentError(f"{dst} exists ({'a symbolic link' if dst.is_symlink() else 'a file'}); pass "
                                   "--force to replace it, or name another OUT file")
    from convnets.registry import load_model
    from convnets.weights.safetensors_io import save_safetensors

    # load_model reads every layout, takes the architecture from the file (recorded or read off
    # the tensor shapes) and checks that the tensors fit it, so what is written is canonical.
    model = load_model(src, use_ema=args.use_ema)
    save_safetensors(model, dst)
    names = f", {len(model.class_names)} class names" if model.class_names else ""
    print(f"{dst}: {sum(p.numel() for p in model.parameters()):,} parameters, {model.num_classes} classes{names}, "
          f"image size {model.input_size}")
    return 0
