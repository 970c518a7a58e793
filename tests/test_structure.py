"""Properties of the package as a whole, checked in a fresh interpreter."""

import os
import subprocess
import sys

# The variables eagle_capture.symm handles; unset in the child so that an
# import-time setdefault would show.
MULTICAST_VARIABLES = ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE",
                       "NVSHMEM_DISABLE_NVLS")


def test_importing_the_package_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k not in MULTICAST_VARIABLES}
    # torch._dynamo's import sets TORCHINDUCTOR_CACHE_DIR (torch 2.13): torch's
    # doing, so torch and Triton are imported before the snapshot.
    code = ("import os, torch, torch._dynamo, triton; before = dict(os.environ); "
            "import eagle_capture, eagle_capture.symm; "
            "changed = sorted(k for k in set(before) | set(os.environ) "
            "if before.get(k) != os.environ.get(k)); "
            "assert not changed, f'import changed os.environ: {changed}'")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
