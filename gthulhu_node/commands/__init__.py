"""Subcommands of the `gthulhu-node` CLI, one module each."""
