"""Make PyPI's torchvision importable beside a CPU-only torch (installed as ``_torchvision_cpu_shim``).

PyPI's Linux torchvision wheel is a CUDA build: its ``_C.so`` needs ``libtorch_cuda.so``, which a
CPU torch lacks, so the extension does not load, and then ``torchvision/_meta_registrations.py``
fails at import on ``register_fake("torchvision::nms")``: ``operator torchvision::nms does not
exist``. SGLang (and transformers) import torchvision at module level for vision models only.

setup_env.py copies this file into the venv's site-packages as ``_torchvision_cpu_shim.py`` and adds
``_torchvision_cpu_shim.pth`` (``import _torchvision_cpu_shim``). At interpreter start it only puts
a finder on ``sys.meta_path`` (no torch import). The first ``import torchvision`` triggers it once:
if torchvision's own ``_C`` extension loads, nothing else is done; otherwise it defines the two op
schemas (``nms``, ``qnms``) that torchvision registers fake kernels for unconditionally, so the
import succeeds. The pure-Python parts (transforms, InterpolationMode, ...) then work; the C++ ops
(``torchvision.ops.nms`` etc.) stay unavailable, as torchvision itself reports when its extension
is missing. ``TORCHVISION_CPU_SHIM=0`` turns the shim off.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

_LIB = None  # keep the torch.library.Library alive: its destructor would drop the definitions


def _prepare() -> None:
    global _LIB
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    pkg_dir = next(iter(spec.submodule_search_locations))
    lib = os.path.join(pkg_dir, "_C.so")
    if os.path.exists(lib):
        try:
            torch.ops.load_library(lib)
            return  # a torchvision build that matches this torch: nothing to do
        except (ImportError, OSError):
            pass
    try:
        _ = torch.ops.torchvision.nms.default
        return  # already defined by someone else
    except (AttributeError, RuntimeError):
        pass
    _LIB = torch.library.Library("torchvision", "FRAGMENT")
    _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "torchvision":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(cls)
        try:
            _prepare()
        except Exception as e:  # never break the import itself; torchvision will report its own error
            print(f"_torchvision_cpu_shim: {type(e).__name__}: {e}", file=sys.stderr)
        return None  # let the normal finders import the real package


if os.environ.get("TORCHVISION_CPU_SHIM", "1") != "0" and _Finder not in sys.meta_path:
    sys.meta_path.insert(0, _Finder)
