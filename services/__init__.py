"""Tandem: asynchronous RL post-training for LLMs as gRPC services."""

__version__ = "0.1.0"
