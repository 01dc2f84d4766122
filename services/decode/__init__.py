"""The decode worker's process: a thin loop around common/workers/decode.py's core."""
