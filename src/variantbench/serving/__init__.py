"""Serving variants: continuous batching, scheduling, routing, the OpenAI-compatible server."""
