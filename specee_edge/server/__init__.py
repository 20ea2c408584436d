"""`specee-edge serve`: an OpenAI-compatible HTTP server over one engine, and a page that chats with it."""

from specee_edge.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
