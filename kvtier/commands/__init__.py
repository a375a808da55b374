"""Subcommand modules of the `kvtier` CLI (see kvtier/cli.py for the contract)."""
