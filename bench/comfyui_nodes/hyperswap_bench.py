"""A ComfyUI custom node for bench/real_comfyui.py: a prompt that runs for a set time with no model.

Copy (or symlink) this file into a ComfyUI checkout's `custom_nodes/` folder and restart ComfyUI.
It adds one output node, `HyperSwapBenchBusy` ("HyperSwap bench: busy for N seconds"): it keeps one
CPU core computing (repeated torch matmuls; `mode: sleep` waits instead) until `seconds` have
passed, reports progress every step as ComfyUI's own nodes do (the `progress` websocket frames), and
shows the seconds it took. It downloads and loads nothing, so it runs on `--cpu` with no checkpoint.

Not part of the proxy: ComfyUI imports it, not HyperSwap (ComfyUI's `comfy` package is only there).
"""

from __future__ import annotations

import time
from typing import Any

import comfy.model_management  # type: ignore[import-not-found]
import comfy.utils  # type: ignore[import-not-found]
import torch  # type: ignore[import-not-found]


class HyperSwapBenchBusy:
    CATEGORY = "hyperswap"
    FUNCTION = "run"
    OUTPUT_NODE = True
    RETURN_TYPES = ()

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "seconds": ("FLOAT", {"default": 45.0, "min": 0.0, "max": 3600.0, "step": 0.5}),
                "mode": (["compute", "sleep"],),
                "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),  # a new seed: not served from the cache
            }
        }

    def run(self, seconds: float, mode: str, seed: int) -> dict[str, Any]:
        began = time.monotonic()
        steps = max(1, int(seconds * 2))  # a progress frame every half second
        bar = comfy.utils.ProgressBar(steps)
        gen = torch.Generator().manual_seed(seed)
        a = torch.randn(256, 256, generator=gen)
        for step in range(steps):
            until = began + seconds * (step + 1) / steps
            while time.monotonic() < until:
                comfy.model_management.throw_exception_if_processing_interrupted()  # /interrupt ends it
                if mode == "compute":
                    a = torch.tanh(a @ a.T / 256.0)
                else:
                    time.sleep(min(0.05, max(0.0, until - time.monotonic())))
            bar.update_absolute(step + 1, steps)
        took = time.monotonic() - began
        return {"ui": {"text": [f"busy for {took:.2f} s ({mode})"], "seconds": [took]}}


NODE_CLASS_MAPPINGS = {"HyperSwapBenchBusy": HyperSwapBenchBusy}
NODE_DISPLAY_NAME_MAPPINGS = {"HyperSwapBenchBusy": "HyperSwap bench: busy for N seconds"}
