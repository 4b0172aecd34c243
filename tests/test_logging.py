"""`hf_stable.logging`: bitsandbytes' optional-kernel notice is quiet, and nothing else it says is."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from hf_stable.logging import _KERNELS_NOTICE, BNB_CPU_OPS_LOGGER, optional_kernels_notice
from tests.test_recipe import ROOT

RAW = _KERNELS_NOTICE + ": %s. Please make sure you already `pip install kernels` and the kernels >= 0.11.1"


def _missing_kernels() -> ModuleNotFoundError:
    try:
        import kernels  # noqa: F401
    except ModuleNotFoundError as exc:
        return exc
    pytest.skip("the `kernels` package is installed here: bitsandbytes has nothing to warn about")


def test_importing_peft_after_hf_stable_prints_no_kernels_line():
    """peft imports bitsandbytes, whose import warns that `kernels` is missing (where the CPU could use its
    fused 4-bit kernel); `import hf_stable` first keeps that line out, and the filter remembers it."""
    _missing_kernels()
    code = "import {}peft; from hf_stable.logging import optional_kernels_notice as o; print(bool(o().dropped))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ours = subprocess.run(
        [sys.executable, "-c", code.format("hf_stable, ")], env=env, capture_output=True, text=True, check=True
    )
    assert "kernels" not in ours.stderr
    bare = subprocess.run([sys.executable, "-c", "import peft"], env=env, capture_output=True, text=True, check=True)
    if ours.stdout.strip() == "True":  # bitsandbytes did try the kernel here (a CPU with AVX512-BF16) ...
        assert _KERNELS_NOTICE in bare.stderr  # ... and without hf_stable first its warning shows


def test_the_filter_drops_only_the_missing_package_notice(caplog):
    logger = logging.getLogger(BNB_CPU_OPS_LOGGER)
    notice = optional_kernels_notice()
    assert optional_kernels_notice() is notice and logger.filters.count(notice) == 1  # installed once
    with caplog.at_level(logging.WARNING, logger=BNB_CPU_OPS_LOGGER):
        logger.warning(RAW, _missing_kernels())
        logger.warning(RAW, RuntimeError("kernel build for this torch not found"))  # kernels installed, broken
        logger.warning(RAW, ModuleNotFoundError("No module named 'huggingface_hub'", name="huggingface_hub"))
        logger.warning("bitsandbytes: some other warning")
    shown = [r.getMessage() for r in caplog.records if r.name == BNB_CPU_OPS_LOGGER]
    assert len(shown) == 3 and "kernels'" not in "".join(shown)
    assert "kernel build for this torch" in shown[0] and "huggingface_hub" in shown[1]
    assert "No module named 'kernels'" in notice.dropped
