"""cipherlm's server: FastAPI app, settings, tenants and policy, routers, audit log, metrics, the CLI."""

__all__: list[str] = []
