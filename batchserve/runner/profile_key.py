"""Which cost profile a runner needs and where it is kept: its key (the model, its forward and
kernels, dtype, device, attention backend, the profile's version), its cache path, and its table
for the CLI. Measuring one is `calibrate.py`."""

from __future__ import annotations

import hashlib
import os
import platform
import re
from pathlib import Path

import torch

from batchserve import kernels
from batchserve.cost_profile import CostProfile
from batchserve.model import uses_our_kernels
from batchserve.runner.runner import ModelRunner

# Bumped when what a profile measures changes (the attention backend's batching, the step
# shapes), so that profiles measured before are remeasured instead of trusted.
PROFILE_VERSION = 12  # 6: the row after each 16; 7: row blocks; 8: Q4_1's bfloat16 LM head;
# 9: finer row buckets;
# 10: draft rows among many requests; 11: the invariant attention's per-step scratch and additive mask
# 12: fewer torch calls a layer (packed-row backends, tree tiles through the scratch)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} x{torch.get_num_threads()} threads"


def profile_key(runner: ModelRunner) -> str:
    """Names what the timings depend on: the model, its forward and kernels, dtype, device, attention."""
    model = runner.model
    param = next(model.parameters())
    name = Path(str(getattr(model.config, "_name_or_path", "") or type(model).__name__)).name or "model"
    num_params = sum(p.numel() for p in model.parameters())
    dtype = str(param.dtype).removeprefix("torch.")
    backend = type(runner.backend).__name__.removesuffix("Backend") + ("-onednn" if runner.onednn_linear else "")
    impl = "native" if getattr(model, "native", False) else "hf"  # draft rows cost differently on each
    weights = getattr(model, "cpu_weights", "float32")
    if weights in ("bfloat16", "gguf"):
        impl += f"-{weights}" + ("-ours" if uses_our_kernels(model) else "")  # whose kernels, too
    if uses_our_kernels(model) or backend.startswith("Kernel"):  # their timings change with their source
        backend += f"-{kernels.build_id()}"
    return f"{name}-{num_params}-{impl}-{dtype}-{_device_name(param.device)}-{backend}-v{PROFILE_VERSION}"


def profile_path(key: str) -> Path:
    """Where the profile for `key` is cached ($BATCHSERVE_CACHE_DIR, else ~/.cache/batchserve)."""
    root = Path(os.environ.get("BATCHSERVE_CACHE_DIR") or Path.home() / ".cache" / "batchserve")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", key)[:80]
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    return root / "profiles" / f"{slug}-{digest}.json"


def format_profile(profile: CostProfile) -> str:
    """The curve as a table plus the critical decoding length, for the CLI."""
    lines = [f"cost profile for {profile.key}", ""]
    header = "tokens/step " + "".join(f"{f'ctx {c}':>12}" for c in profile.contexts)
    lines.append(header)
    for i, n in enumerate(profile.token_counts):
        lines.append(f"{n:>11} " + "".join(f"{row[i]:>9.1f} ms" for row in profile.step_ms))
    lines.append("")
    if profile.row_block > 1:
        lines.append(f"rows are taken {profile.row_block} at a time: a started block costs a whole one")
    for c in profile.contexts:
        lines.append(f"each further request in a step at context {c}: +{profile.seq_ms(c):.2f} ms")
    for c in profile.contexts:
        lines.append(f"each draft row among several requests at context {c}: +{profile.draft_row_ms(c):.2f} ms")
    for c in profile.contexts:
        lines.append(
            f"critical decoding length at context {c}: {profile.critical_decoding_length(context=c)} "
            "(the most tokens per step within 10% of a one-token step's time)"
        )
    return "\n".join(lines)
