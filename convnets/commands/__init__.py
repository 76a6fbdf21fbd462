"""Subcommands of the ``convnets`` command line (thin: arguments in, feature functions called)."""
