"""The driver's request path: prompts in, scheduled steps out, results back to requests."""
