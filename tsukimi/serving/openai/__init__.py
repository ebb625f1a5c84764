"""The OpenAI-compatible front of the router process: request checks, wire shapes, the endpoints."""
