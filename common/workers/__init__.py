"""The worker cores that do no I/O: prefill, decode and encoder, stepped in-process by tests and run
behind sockets by the services; and what decode shares with prefill."""
