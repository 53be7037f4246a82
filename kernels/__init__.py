"""cipherlm's kernels: Triton kernels with typed launchers and their torch references."""

__all__: list[str] = []
