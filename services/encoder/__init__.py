"""The vision encoder worker's process: a thin loop around common/workers/encoder.py's core."""
