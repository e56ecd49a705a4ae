"""Whether this gateway takes one more: admission, whose work made frames late, the Prometheus metrics."""
