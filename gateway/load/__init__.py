"""Whether this gateway takes one more session or request: admission, whose work made frames late, and the Prometheus metrics. It imports sessions, never the links that attach to them."""
