"""``python -m convnets.train ...``: the same as ``convnets train ...`` (also under ``torchrun``)."""

import sys

from convnets.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
