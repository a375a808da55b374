"""kvtier: a multi-tier (GPU HBM / host DRAM / SSD) KV cache service for LLM inference."""

__version__ = "0.1.0"
