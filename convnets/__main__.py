"""``python -m convnets COMMAND ...`` (same as the ``convnets`` console script)."""

import sys

from convnets.cli import main

sys.exit(main())
