"""The tile geometry table (kernels/geometry.py) is what the C++ launchers launch with."""
import pytest

from specdec_ops import _C
from specdec_ops._triton import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the kernels need triton")


def test_cpp_launchers_use_the_geometry_table():
    from specdec_ops.kernels.geometry import LAUNCHED_FROM_CPP

    assert _C._launch_geometry() == LAUNCHED_FROM_CPP
