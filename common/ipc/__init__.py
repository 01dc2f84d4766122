"""Memory and sockets shared between processes: tensors exported and mapped (CUDA IPC, shared memory),
page-aliased pools, pinned host stores, file-descriptor passing, typed ZeroMQ sockets and port picking."""
