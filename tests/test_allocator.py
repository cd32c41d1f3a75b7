"""The allocator settings `kvgate serve` applies: on glibc, exported for the workers; an
operator's own choice is left alone."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from gateway.allocator import MMAP_THRESHOLD_BYTES, tune_allocator


def test_an_operators_choice_is_kept() -> None:
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    assert tune_allocator(env) is False
    assert env == {"MALLOC_MMAP_THRESHOLD_": "131072"}


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_on_glibc_the_thresholds_are_set_and_exported() -> None:
    # In a child: mallopt changes the whole process, and the test suite shares one.
    code = (
        "from gateway.allocator import tune_allocator; env = {}; "
        "print(tune_allocator(env), env.get('MALLOC_MMAP_THRESHOLD_'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["True", str(MMAP_THRESHOLD_BYTES)]
