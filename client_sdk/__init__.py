"""cipherlm's client SDK."""

__all__: list[str] = []
