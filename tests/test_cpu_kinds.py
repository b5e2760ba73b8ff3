"""Running the suite as the other kind of CI machine would: the kernel switches take effect.

CI machines come with AVX2 only or with AVX-512 and bf16. ``ATEN_CPU_CAPABILITY=avx2`` caps
torch's own kernels and ``ONEDNN_MAX_CPU_ISA=AVX2`` oneDNN's (convolutions, bf16 matmuls), so an
AVX-512 machine runs the AVX2 kernels, and ``cpu_has_bf16`` then takes float32 as an AVX2
machine does (README, "Tests"). Each check runs in a fresh interpreter: both switches are read
once, when torch loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fedbip_tools.machine import KERNEL_SWITCHES, cpu_flags

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

PROBE = """
import json, torch
from fedbip_tools.machine import this_machine
torch.nn.functional.conv2d(torch.randn(4, 64, 32, 32), torch.randn(64, 64, 3, 3), padding=1)
print("MACHINE " + json.dumps(this_machine().model_dump()))
"""


def probe(switches: dict[str, str]) -> tuple[dict, str]:
    """This machine's kind and oneDNN's ISA line in a fresh process with only ``switches`` set."""
    env = {k: v for k, v in os.environ.items() if k not in KERNEL_SWITCHES} | switches
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env=env | {"ONEDNN_VERBOSE": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    isa = next(line.rsplit("isa:", 1)[1] for line in out.splitlines() if ",isa:" in line)
    machine = json.loads(next(line for line in out.splitlines() if line.startswith("MACHINE "))[8:])
    return machine, isa


def test_the_avx2_switches_cap_torchs_and_onednns_kernels_and_turn_bf16_off():
    machine, isa = probe(AVX2)
    assert machine["kernels"] == "AVX2"
    assert isa == "Intel AVX2", "oneDNN runs its AVX2 kernels"
    assert machine["bf16"] is False, "bf16 is emulated on AVX2 kernels: a run takes float32"
    assert machine["switches"] == AVX2


def test_without_the_switches_the_kernels_are_the_cpus_own():
    """On an AVX-512 CPU the switches change the kernels (the test above is not a no-op here);
    on an AVX2 one they are what it runs anyway."""
    machine, isa = probe({})
    avx512 = "avx512f" in cpu_flags()
    assert machine["kernels"] == ("AVX512" if avx512 else "AVX2")
    # oneDNN names AVX-512 "AVX10.1" on CPUs that have it (an AMX Xeon)
    assert ("AVX-512" in isa or "AVX10" in isa) == avx512, isa
    assert machine["bf16"] == bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
