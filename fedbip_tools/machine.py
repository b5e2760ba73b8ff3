"""The kind of machine a figure or a digest was taken on, so that it is compared only with
figures of the same kind.

float32 results depend on the kernels torch runs: AVX2 and AVX-512 kernels sum in other
orders and blockings (the last bits differ), and a CPU with native bfloat16 samples under bf16
autocast where another runs float32 (``fedbip_flwr.ldm.cpu_has_bf16``). The kind is read from
what torch will run, not from the CPU alone: ``ATEN_CPU_CAPABILITY=avx2`` and
``ONEDNN_MAX_CPU_ISA=AVX2`` make an AVX-512 machine compute as an AVX2 one (README, "Tests").
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from fedbip_flwr.ldm import cpu_has_bf16

# The switches that cap the kernels below what the CPU has; recorded with the kind.
KERNEL_SWITCHES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else ():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else ():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown"


class MachineKind(BaseModel):
    """What a CPU figure depends on: the kernels' instruction set, native bf16, the CPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpu: str
    kernels: str  # torch's CPU capability: "AVX2", "AVX512", ...
    bf16: bool  # sampling under bf16 autocast (native bf16 in the kernels that run)
    amx: bool
    threads: int
    switches: dict[str, str] = {}  # the kernel caps set in the environment

    @property
    def kind(self) -> str:
        """The label figures are grouped by: ``AVX2``, ``AVX512+bf16``, ``AVX512+bf16+AMX``."""
        return self.kernels + ("+bf16" if self.bf16 else "") + ("+AMX" if self.amx else "")


def this_machine() -> MachineKind:
    """The kind of this process's machine, as its kernels run now."""
    flags = cpu_flags()
    kernels = torch.backends.cpu.get_cpu_capability()
    return MachineKind(
        cpu=cpu_model(),
        kernels=kernels,
        bf16=cpu_has_bf16(),
        amx="amx_tile" in flags and kernels == "AVX512",
        threads=torch.get_num_threads(),
        switches={name: os.environ[name] for name in KERNEL_SWITCHES if name in os.environ},
    )
