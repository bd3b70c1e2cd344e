"""One rank: its shard of the model, its slice of the KV cache, the step it runs."""
