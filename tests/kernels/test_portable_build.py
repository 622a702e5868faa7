"""The native kernels compile for the CPUs this one is not. The build targets the machine
(-march=native), so each day compiles only its CPU's branches: on a CPU with AVX512-BF16 the
AVX2-only branches (an AMD Zen 3's) and the portable ones (no AVX2) are never compiled, and a
mistake there would break the kernels on those machines unseen. Here every source (the
Python bindings aside, which have no CPU-dependent code) is checked with the build's flags
for those two targets. Machines without AVX512-BF16 build their own branches already and skip
this (the suite's time there is tight). Running those branches, not only compiling them:
`make test-other-cpus` (PIPESERVE_CPU_MARCH)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.utils.cpp_extension import include_paths

from pipeserve.device import native_bf16_pairs
from pipeserve.kernels import CFLAGS, HERE, SOURCES

ON_OTHER_CPUS = pytest.mark.skipif(
    not native_bf16_pairs(), reason="this CPU's own build compiles the AVX2 branches"
)


@ON_OTHER_CPUS
@pytest.mark.parametrize(
    "march",
    [
        "znver3",  # AVX2, FMA and F16C without AVX512
        "x86-64",  # none of them: the portable branches
    ],
)
def test_every_kernel_compiles_for_another_cpu(march: str) -> None:
    flags = [f for f in CFLAGS if not f.startswith("-O")]
    command = ["c++", "-std=c++20", f"-march={march}", "-fsyntax-only", *flags, f"-I{HERE}"]
    for path in include_paths():
        command += ["-isystem", path]
    sources = [s for s in SOURCES if s.name != "bindings.cpp"]

    def check(source: object) -> tuple[object, subprocess.CompletedProcess[str]]:
        done = subprocess.run(
            [*command, str(source)], capture_output=True, text=True, timeout=300, check=False
        )
        return source, done

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(check, sources))
    failed = {str(s): r.stderr[-2000:] for s, r in results if r.returncode != 0}
    assert not failed, failed


def test_pipeserve_cpu_march_names_the_build_s_target(monkeypatch: pytest.MonkeyPatch) -> None:
    """The target CPU is -march=native unless PIPESERVE_CPU_MARCH names another; each target
    is a library of its own in the cache (its flags are in the key); a value that is not a
    -march name is refused before it reaches the compiler's command line."""
    from pipeserve import kernels

    monkeypatch.delenv("PIPESERVE_CPU_MARCH", raising=False)
    assert kernels.cflags()[0] == "-march=native"
    native_key = kernels._key()
    monkeypatch.setenv("PIPESERVE_CPU_MARCH", "znver3")
    assert kernels.cflags() == ["-march=znver3", *CFLAGS]
    assert kernels._key() != native_key
    monkeypatch.setenv("PIPESERVE_CPU_MARCH", "znver3 -fplugin=x.so")
    with pytest.raises(ValueError, match="PIPESERVE_CPU_MARCH"):
        kernels.cflags()
