"""Environment checks: versions, accelerators, precision support, optional extras, NVML hardware, NUMA affinity.

Everything here is read-only and cheap (no model). Where a source is missing (no GPU, no pynvml, no sysfs) the
finding says so instead of guessing; on a CPU-only machine the report says that plainly, once.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from hf_stable.config.doctor import DoctorConfig
from hf_stable.doctor.findings import Finding
from hf_stable.doctor.precision_checks import precision_findings
from hf_stable.doctor.settings import TrainingSettings
from hf_stable.import_utils import (
    is_bitsandbytes_available,
    is_deepspeed_available,
    is_flash_attn_available,
    is_nvml_available,
)

PACKAGES = ("hf-stable", "torch", "transformers", "accelerate", "peft", "datasets", "trl", "tokenizers")
GIB = 1024**3


def _f(severity: str, name: str, what: str, evidence: str = "", fix: str = "") -> Finding:
    return Finding(severity, what, evidence, fix, check=f"environment.{name}")


def package_versions() -> dict[str, str | None]:
    import importlib.metadata as md

    from hf_stable import __version__

    out: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:  # ours from the code that runs: an editable install's metadata can lag behind hf_stable.__version__
            out[pkg] = __version__ if pkg == "hf-stable" else md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' (sysfs cpulist format) -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's '00000000:3B:00.0' -> sysfs' '0000:3b:00.0' (4-digit domain, lower case)."""
    domain, _, rest = nvml_bus_id.strip().partition(":")
    return f"{domain[-4:]}:{rest}".lower()


def numa_cpus(bus_id: str, sysfs: Path = Path("/sys")) -> tuple[int | None, set[int] | None]:
    """NUMA node of a PCI device and that node's CPUs, or (None, None) where sysfs does not say."""
    try:
        node = int((sysfs / "bus/pci/devices" / sysfs_bus_id(bus_id) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None, None
    if node < 0:  # single-socket machines report -1
        return None, None
    try:
        return node, parse_cpulist((sysfs / f"devices/system/node/node{node}/cpulist").read_text())
    except OSError:
        return node, None


def _gpu_facts() -> list[dict]:
    import torch

    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpu = {
            "index": i,
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "total_gib": round(props.total_memory / GIB, 2),
            "bf16": props.major >= 8,  # native bf16 arithmetic starts with Ampere (sm_80)
            "uuid": str(getattr(props, "uuid", "") or ""),
        }
        if getattr(props, "pci_bus_id", None) is not None:  # lets the NUMA check work without NVML
            domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
            gpu["bus_id"] = f"{domain:08x}:{props.pci_bus_id:02x}:{device:02x}.0"
        try:
            free, _total = torch.cuda.mem_get_info(i)
            gpu["free_gib"] = round(free / GIB, 2)
        except RuntimeError:
            gpu["free_gib"] = None
        gpus.append(gpu)
    return gpus


def _nvml_facts(gpus: list[dict]) -> list[str]:
    """Add temperature, PCIe link and NVLink state to each GPU dict; returns problems reading NVML."""
    import pynvml

    problems = []
    pynvml.nvmlInit()
    try:
        for gpu in gpus:
            try:
                uuid = gpu["uuid"]
                handle = (
                    pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
                    if uuid
                    else pynvml.nvmlDeviceGetHandleByIndex(gpu["index"])
                )
            except Exception:  # older bindings want bytes; index order may differ from CUDA's, so UUID first
                handle = pynvml.nvmlDeviceGetHandleByIndex(gpu["index"])
            reads = {
                "temperature_c": lambda h: pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                "pcie_gen": pynvml.nvmlDeviceGetCurrPcieLinkGeneration,
                "pcie_gen_max": pynvml.nvmlDeviceGetMaxPcieLinkGeneration,
                "pcie_width": pynvml.nvmlDeviceGetCurrPcieLinkWidth,
                "pcie_width_max": pynvml.nvmlDeviceGetMaxPcieLinkWidth,
                "bus_id": lambda h: pynvml.nvmlDeviceGetPciInfo(h).busId,
            }
            for key, read in reads.items():
                try:
                    value = read(handle)
                    gpu[key] = value.decode() if isinstance(value, bytes) else value
                except pynvml.NVMLError as e:
                    gpu[key] = None
                    problems.append(f"GPU {gpu['index']} {key}: {e}")
            active = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    active += int(pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED)
                except pynvml.NVMLError:
                    break  # links past the device's last one (or no NVLink at all) raise
            gpu["nvlink_active"] = active
    finally:
        pynvml.nvmlShutdown()
    return problems


def _versions_finding(versions: dict) -> Finding:
    import torch

    text = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    cuda = torch.version.cuda
    extra = []
    if cuda:
        extra.append(f"CUDA {cuda}")
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        extra.append(f"cuDNN {cudnn}" if cudnn else "cuDNN not available")
        try:
            nccl = torch.cuda.nccl.version()
            extra.append("NCCL " + (".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
        except (AttributeError, RuntimeError):
            extra.append("NCCL not available")
    else:
        extra.append("torch built without CUDA")
    return _f("info", "versions", "software versions", f"{text}; {', '.join(extra)}")


def _hardware_findings(gpus: list[dict], doctor: DoctorConfig) -> list[Finding]:
    out = []
    for g in gpus:
        tag = f"GPU {g['index']} ({g['name']})"
        temp = g.get("temperature_c")
        if temp is not None and temp >= doctor.temperature_warn_c:
            out.append(
                _f(
                    "warning",
                    "temperature",
                    f"{tag} is already hot before training",
                    f"{temp} C",
                    "check cooling / other jobs; the thermal guard will lower gradient accumulation when it throttles",
                )
            )
        width, width_max = g.get("pcie_width"), g.get("pcie_width_max")
        if width and width_max and width < width_max:
            out.append(
                _f(
                    "warning",
                    "pcie",
                    f"{tag} PCIe link is narrower than the card supports",
                    f"x{width} of x{width_max}",
                    "reseat the card or check the slot / riser; host<->device copies run at a fraction of the speed",
                )
            )
        gen, gen_max = g.get("pcie_gen"), g.get("pcie_gen_max")
        if gen and gen_max and gen < gen_max:
            out.append(
                _f(
                    "info",
                    "pcie",
                    f"{tag} PCIe link below its top generation",
                    f"gen {gen} of {gen_max}",
                    "idle GPUs lower the link generation to save power; recheck under load if transfers are slow",
                )
            )
    reported = [g for g in gpus if "nvlink_active" in g]
    if len(gpus) > 1 and reported and all(g["nvlink_active"] == 0 for g in reported):
        out.append(
            _f(
                "info",
                "nvlink",
                "no active NVLink between the GPUs",
                f"{len(gpus)} GPUs",
                "gradient all-reduce goes over PCIe; expect slower multi-GPU steps",
            )
        )
    return out


def _affinity_findings(gpus: list[dict]) -> list[Finding]:
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return []
    out = []
    for g in gpus:
        bus = g.get("bus_id")
        if not bus:
            continue
        node, cpus = numa_cpus(bus)
        g["numa_node"] = node
        if node is None or not cpus:
            continue
        if not allowed & cpus:
            out.append(
                _f(
                    "warning",
                    "numa",
                    f"process CPUs are all on another NUMA node than GPU {g['index']}",
                    f"GPU on node {node} (CPUs {min(cpus)}-{max(cpus)}); process allowed CPUs {sorted(allowed)[:8]}...",
                    f"pin the process to node {node} (e.g. numactl --cpunodebind={node} or accelerate's "
                    "--enable_cpu_affinity) so dataloader copies stay on the GPU's socket",
                )
            )
    return out


def check_environment(cfg, settings: TrainingSettings, doctor: DoctorConfig) -> tuple[dict, list[Finding]]:
    """Return (facts, findings) about the machine the run is about to use."""
    import torch

    versions = package_versions()
    findings = [_versions_finding(versions)]
    facts: dict = {"versions": versions, "platform": platform.platform(), "executable": sys.executable}
    gpus = _gpu_facts() if torch.cuda.is_available() else []
    facts["gpus"] = gpus
    if not gpus:
        findings.append(
            _f(
                "info",
                "accelerator",
                "CPU-only machine: no CUDA GPU is visible",
                f"torch {torch.__version__}, cuda available: False, {os.cpu_count()} CPU cores",
                "fine for the embedded tiny base; real checkpoints need a GPU (and a CUDA build of torch)",
            )
        )
    else:
        desc = "; ".join(
            f"{g['index']}: {g['name']} sm_{g['capability'].replace('.', '')}, bf16 {'yes' if g['bf16'] else 'no'}, "
            f"{g['free_gib']} of {g['total_gib']} GiB free"
            for g in gpus
        )
        findings.append(_f("ok", "accelerator", f"{len(gpus)} CUDA GPU(s)", desc))
        busy = [g for g in gpus if g["free_gib"] is not None and g["free_gib"] < 0.5 * g["total_gib"]]
        if busy:
            findings.append(
                _f(
                    "warning",
                    "gpu_memory",
                    "GPU memory is already in use by another process",
                    "; ".join(f"GPU {g['index']}: {g['free_gib']} of {g['total_gib']} GiB free" for g in busy),
                    "stop the other job or pick a free GPU with CUDA_VISIBLE_DEVICES",
                )
            )
    findings += precision_findings(gpus, settings, cfg)

    extras = {
        "flash_attn": is_flash_attn_available(),
        "deepspeed": is_deepspeed_available(),
        "pynvml": is_nvml_available(),
        "bitsandbytes": is_bitsandbytes_available(),
    }
    facts["extras"] = extras
    findings.append(
        _f(
            "info",
            "extras",
            "optional extras",
            ", ".join(f"{k}: {'installed' if v else 'missing'}" for k, v in extras.items()),
        )
    )
    if getattr(cfg.attention, "backend", "auto") == "flash" and not extras["flash_attn"]:
        findings.append(
            _f(
                "error",
                "extras",
                "attention.backend is 'flash' but flash-attn is not installed",
                "import flash_attn fails",
                'pip install "hf-stable[flash]" or set attention.backend: auto',
            )
        )
    if settings.get("deepspeed") and not extras["deepspeed"]:
        findings.append(
            _f(
                "error",
                "extras",
                "training.deepspeed is set but DeepSpeed is not installed",
                f"training.deepspeed={settings.get('deepspeed')!r}",
                'pip install "hf-stable[deepspeed]"',
            )
        )

    if gpus and extras["pynvml"]:
        try:
            problems = _nvml_facts(gpus)
            if problems:
                facts["nvml_problems"] = problems
        except Exception as e:  # NVML present but unusable (driver mismatch, container without NVML)
            findings.append(_f("info", "nvml", "NVML could not be read", f"{type(e).__name__}: {e}"))
        findings += _hardware_findings(gpus, doctor)
    elif gpus:
        findings.append(
            _f(
                "info",
                "nvml",
                "no NVML: GPU temperature, PCIe link and NVLink state not checked",
                "pynvml missing",
                'pip install "hf-stable[nvml]"',
            )
        )
    findings += _affinity_findings(gpus)
    return facts, findings
