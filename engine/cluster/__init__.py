"""The engine past one machine: the pool on Ray Serve (its ingress, replicas and hosts, the wire between them, Ray's internals) and the gateway's client of it."""
