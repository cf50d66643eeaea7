"""Decode role: continuous-batching decode over a KV pool that prefill writes into; pause and recovery."""
