"""fleet: bring up a fleet of LLM inference servers, prove them, and push batch jobs through them.

This package is the Prefect-free core; `flows/`, `tasks/` and `blocks/` wrap it.
"""

__version__ = "0.1.0"
