"""What every test file of llminfer's CPU kernel starts with: ``from kernels_common import pytestmark,
kernel_loaded``.

Those tests are skipped only where the kernel cannot run at all (not x86-64, no AVX2/FMA, switched off); on a
machine that can run it, a failed build fails ``test_kernel_builds_here`` and every kernel test.
"""

from __future__ import annotations

import pytest

from llminfer.kernels import build

pytestmark = pytest.mark.skipif(build._why_not_here() is not None,
                                reason=f"llminfer's CPU kernel cannot run here: {build._why_not_here()}")


@pytest.fixture(autouse=True)
def kernel_loaded():
    """Every test may call the ops directly: load (and on first use build) the kernel first, whichever
    tests run and in whatever order."""
    build.skinny_linear_available()
