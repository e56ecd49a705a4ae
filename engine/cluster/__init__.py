"""The engine past one machine: the pool on Ray Serve, and the gateway's client of it."""
