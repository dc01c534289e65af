"""sleuth: reinforcement learning on verifiable tasks for open LLMs."""

__version__ = "0.1.0"
