"""infer-bench: llama-bench's benchmark for every engine."""
