"""``convnets weights``: which pretrained weights exist, whether they are cached, and fetching them.

Fetching ahead of time is how an air-gapped machine or a cluster job gets its weights: run
``convnets weights fetch NAME`` where the network is reachable, then copy the cache directory, or
point ``CONVNETS_WEIGHTS_MIRROR`` at a directory holding the files.
"""

from __future__ import annotations

import argparse
import json

from convnets.errors import InvalidArgumentError

# convnets.weights.download.MIRROR_ENV, spelled out because that module imports PyTorch and
# `--help` must not wait for it; tests/test_cli_startup.py checks that the two agree.
MIRROR_ENV = "CONVNETS_WEIGHTS_MIRROR"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this command's options."""
    parser.add_argument("action", nargs="?", choices=["list", "fetch"], default="list",
                        help="list (default): models, files and cache state; fetch: download and verify")
    parser.add_argument("models", nargs="*", metavar="MODEL", help="models to fetch (default: all)")
    parser.add_argument("--json", action="store_true", help="print the list as JSON")
    parser.epilog = f"Cache: torch.hub.get_dir()/checkpoints (set TORCH_HOME to move it). Mirror: ${MIRROR_ENV}."


def run(args: argparse.Namespace) -> int:
    """Run ``convnets weights``."""
    from convnets.registry import fetch_pretrained
    from convnets.weights.download import cache_dir, resolve_source
    from convnets.weights.manifest import load_manifest

    manifest = load_manifest()
    if args.action == "fetch":
        for name in args.models or sorted(manifest):
            print(fetch_pretrained(name))
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
