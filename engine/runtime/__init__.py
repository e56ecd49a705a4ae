"""The engine's process on this machine: the worker, its deadline scheduler, what synthesis costs, the frames on its pipe, and the gateway's client that starts, feeds and restarts it."""
