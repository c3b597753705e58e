"""The wire protocol without I/O: frames and their codec, the client's connection state
machine, and every command written once for both clients."""
