"""The engine process: scheduler, KV cache, model runner; no sockets below loop.py."""
