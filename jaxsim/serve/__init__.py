"""The search service: HTTP app, request batcher, web page (see docs/serve.md)."""
