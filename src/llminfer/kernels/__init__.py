"""llminfer's CPU kernel library: the C++ ops (``csrc/``, one file per op), how they are built and loaded,
their Python wrappers, and the ``nn.Linear`` stand-ins that run on them.

This package imports nothing on its own (no re-exports), so importing one module does not build the kernels
or pull in the others."""
