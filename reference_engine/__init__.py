"""The built-in reference engine: GGUF loading, tokenizer and chat template in Python; the forward
pass, kernels, thread pool and sampling in C (csrc/)."""
