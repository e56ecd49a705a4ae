"""The engine's process on this machine: the worker, its scheduler and costs, its pipe's frames, the client."""
