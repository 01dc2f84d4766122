"""Routed experts off the device: their runtime formats, the pinned host store and converted artifacts, the
offloaded provider (a VRAM cache for decode, an arena for prefill, or every expert resident) with its cache
tables and copies, KV pages lent to the cache, routing traces and the cache simulator."""
