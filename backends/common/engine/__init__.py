"""The offline engine: a model runner, continuous batching, logits to tokens, and the sizing of pools from the
machine."""
