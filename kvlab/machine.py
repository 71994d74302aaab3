"""What machine a measurement ran on: every figure kvlab shows is named with its machine."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any

from kvlab.data import DATA_DIR

MEASUREMENTS_DIR = DATA_DIR / "measurements"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> dict[str, Any]:
    """CPU model, usable cores, OS, Python, torch and triton versions, GPU name if any, and the date."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "date": _dt.date.today().isoformat(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        info["torch"] = None
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def machine_line(info: dict[str, Any] | None = None) -> str:
    """One line naming the machine, to print next to a figure."""
    info = info or describe_machine()
    where = info.get("gpu") or f"{info['cpu']}, {info['cores']} cores"
    return f"{where}; {info['os']}; Python {info['python']}, torch {info.get('torch')}; {info['date']}"


def save_measurement(name: str, results: Any, method: str, path: Path | None = None) -> Path:
    """Write ``results`` with the machine and the method to ``data/measurements/<name>.json``."""
    path = path or MEASUREMENTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"name": name, "machine": describe_machine(), "method": method, "results": results}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def load_measurement(name: str) -> dict[str, Any] | None:
    """A saved measurement (with its machine), or None if it was never measured."""
    path = MEASUREMENTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None
