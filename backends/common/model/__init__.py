"""The models and what they run on: weights loading (Hugging Face folders, GGUF), tokenizers, the KV and state stores,
the PyTorch models (Llama family, hybrid) and their GPU paths in CUDA graphs."""
