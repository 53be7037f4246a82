"""Exceptions raised by the kernel launchers.

Hierarchy::

    KernelError                  base class of every error raised by ``kernels``
    ├── KernelInputError         (also a ValueError) a tensor's dtype, shape, stride or device is wrong
    └── BackendUnavailableError  the Triton backend was asked for but cannot run here
"""


class KernelError(Exception):
    """Base class of every kernel error."""


class KernelInputError(KernelError, ValueError):
    """A launcher's argument has the wrong dtype, shape, stride or device."""


class BackendUnavailableError(KernelError):
    """``backend="triton"`` was requested but Triton or a CUDA tensor is missing."""
