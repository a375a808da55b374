"""Connectors that let real inference engines use kvtier; each is a client of the local daemon
(`kvtier.client`), never a second cache."""
