"""The prefill worker's process: a thin loop around common/workers/prefill.py's core."""
