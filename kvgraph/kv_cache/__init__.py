"""Model-facing KV caches: specs, allocation, and binding each layer to its cache tuple."""
