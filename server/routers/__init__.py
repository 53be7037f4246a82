"""HTTP routers. :data:`DEFAULT_ROUTERS` is what :func:`server.app.create_app` mounts; other routers
(encrypted sessions, keys, admin) are added through ``create_app(..., routers=...)``."""

from server.routers import health, openai, tenant

DEFAULT_ROUTERS = (health.router, openai.router, tenant.router)

__all__ = ["DEFAULT_ROUTERS"]
