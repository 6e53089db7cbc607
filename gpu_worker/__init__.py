"""Everything torch: models, weight loading, the paged KV cache, sampling, the model runner."""
