"""The simulated ComfyUI's node catalogue and POST /prompt validation (v0.3.64 / 0.8.0 shapes).

Only a handful of core nodes exist; the error bodies are the ones recorded from a real server
(comfyui-observed.md) and read from execution.py (engine-wire-facts.md B.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]

SAMPLERS = ["euler", "euler_ancestral", "heun", "dpm_2", "dpmpp_2m", "dpmpp_sde", "ddim", "uni_pc"]
SCHEDULERS = ["simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal"]
_MAX_RES = 16384


def _int(default: int, lo: int, hi: int, step: int = 1) -> list[Any]:
    return ["INT", {"default": default, "min": lo, "max": hi, "step": step}]


@dataclass(frozen=True, slots=True)
class NodeClass:
    name: str
    display_name: str
    category: str
    required: tuple[tuple[str, list[Any]], ...]
    output: tuple[str, ...]
    output_name: tuple[str, ...]
    output_node: bool = False
    description: str = ""
    optional: tuple[tuple[str, list[Any]], ...] = ()
    hidden: tuple[tuple[str, str], ...] = ()

    def info(self) -> JSON:
        """The /object_info entry (V1 schema)."""
        return {
            "input": {"required": {k: v for k, v in self.required},
                      **({"optional": {k: v for k, v in self.optional}} if self.optional else {}),
                      **({"hidden": {k: v for k, v in self.hidden}} if self.hidden else {})},
            "input_order": {"required": [k for k, _ in self.required],
                            **({"optional": [k for k, _ in self.optional]} if self.optional else {}),
                            **({"hidden": [k for k, _ in self.hidden]} if self.hidden else {})},
            "output": list(self.output), "output_is_list": [False] * len(self.output),
            "output_name": list(self.output_name), "name": self.name, "display_name": self.display_name,
            "description": self.description, "python_module": "nodes", "category": self.category,
            "output_node": self.output_node,
        }


def catalogue(checkpoints: list[str]) -> dict[str, NodeClass]:
    """Node classes; the checkpoint combo is read from the configured files, like ComfyUI reads disk."""
    hidden = (("prompt", "PROMPT"), ("extra_pnginfo", "EXTRA_PNGINFO"))
    nodes = [
        NodeClass("CheckpointLoaderSimple", "Load Checkpoint", "loaders",
                  (("ckpt_name", [list(checkpoints), {"tooltip": "The name of the checkpoint (model) to load."}]),),
                  ("MODEL", "CLIP", "VAE"), ("MODEL", "CLIP", "VAE"),
                  description="Loads a diffusion model checkpoint, diffusion models are used to denoise latents."),
        NodeClass("CLIPTextEncode", "CLIP Text Encode (Prompt)", "conditioning",
                  (("text", ["STRING", {"multiline": True, "dynamicPrompts": True}]), ("clip", ["CLIP", {}])),
                  ("CONDITIONING",), ("CONDITIONING",),
                  description="Encodes a text prompt using a CLIP model into an embedding."),
        NodeClass("EmptyLatentImage", "Empty Latent Image", "latent",
                  (("width", _int(512, 16, _MAX_RES, 8)), ("height", _int(512, 16, _MAX_RES, 8)),
                   ("batch_size", _int(1, 1, 4096))),
                  ("LATENT",), ("LATENT",), description="Create a new batch of empty latent images."),
        NodeClass("KSampler", "KSampler", "sampling",
                  (("model", ["MODEL", {}]), ("seed", _int(0, 0, 0xFFFFFFFFFFFFFFFF)),
                   ("steps", _int(20, 1, 10000)),
                   ("cfg", ["FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01}]),
                   ("sampler_name", [SAMPLERS, {}]), ("scheduler", [SCHEDULERS, {}]),
                   ("positive", ["CONDITIONING", {}]), ("negative", ["CONDITIONING", {}]),
                   ("latent_image", ["LATENT", {}]),
                   ("denoise", ["FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01}])),
                  ("LATENT",), ("LATENT",), description="Uses the provided model to denoise the latent image."),
        NodeClass("VAEDecode", "VAE Decode", "latent",
                  (("samples", ["LATENT", {}]), ("vae", ["VAE", {}])), ("IMAGE",), ("IMAGE",),
                  description="Decodes latent images back into pixel space images."),
        NodeClass("SaveImage", "Save Image", "image",
                  (("images", ["IMAGE", {}]), ("filename_prefix", ["STRING", {"default": "ComfyUI"}])),
                  (), (), output_node=True, hidden=hidden,
                  description="Saves the input images to your ComfyUI output directory."),
        NodeClass("PreviewImage", "Preview Image", "image", (("images", ["IMAGE", {}]),), (), (),
                  output_node=True, hidden=hidden, description="Saves the input images to your ComfyUI output directory."),
        NodeClass("EmptyImage", "EmptyImage", "image",
                  (("width", _int(512, 1, _MAX_RES)), ("height", _int(512, 1, _MAX_RES)),
                   ("batch_size", _int(1, 1, 4096)), ("color", _int(0, 0, 0xFFFFFF))),
                  ("IMAGE",), ("IMAGE",)),
    ]
    return {n.name: n for n in nodes}


@dataclass(frozen=True, slots=True)
class Rejected:
    """A 400 answer to POST /prompt."""
    body: JSON


@dataclass(frozen=True, slots=True)
class Accepted:
    outputs: tuple[str, ...]   # output node ids that validated (these run)
    node_errors: JSON          # failing outputs (partial validity still queues)


def _err(kind: str, message: str, details: str = "", extra: JSON | None = None) -> JSON:
    return {"type": kind, "message": message, "details": details, "extra_info": extra or {}}


def _is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def _input_errors(nid: str, node: JSON, classes: dict[str, NodeClass]) -> list[JSON]:
    """Errors of this node's own inputs (links are checked for presence only)."""
    cls = classes[node["class_type"]]
    inputs = node.get("inputs") or {}
    errors: list[JSON] = []
    for name, conf in cls.required:
        if name not in inputs:
            errors.append(_err("required_input_missing", "Required input is missing", name, {"input_name": name}))
            continue
        value = inputs[name]
        if _is_link(value):
            continue
        kind, opts = conf[0], conf[1]
        if isinstance(kind, list):
            if value not in kind:
                shown = f"(list of length {len(kind)})" if len(kind) > 20 else repr(kind)
                errors.append(_err("value_not_in_list", "Value not in list", f"{name}: '{value}' not in {shown}",
                                   {"input_name": name, "input_config": None if len(kind) > 20 else conf,
                                    "received_value": value}))
        elif kind in ("INT", "FLOAT"):
            try:
                number = int(value) if kind == "INT" else float(value)
            except (TypeError, ValueError):
                errors.append(_err("invalid_input_type", f"Failed to convert an input value to a {kind} value",
                                   f"{name}, {value}, invalid literal",
                                   {"input_name": name, "input_config": conf, "received_value": value}))
                continue
            if "min" in opts and number < opts["min"]:
                errors.append(_err("value_smaller_than_min", f"Value {number} smaller than min of {opts['min']}",
                                   name, {"input_name": name, "input_config": conf, "received_value": value}))
            elif "max" in opts and number > opts["max"]:
                errors.append(_err("value_bigger_than_max", f"Value {number} bigger than max of {opts['max']}",
                                   name, {"input_name": name, "input_config": conf, "received_value": value}))
    return errors


def dependencies(graph: JSON, nid: str) -> list[str]:
    """Linked upstream node ids of one node, in input order."""
    return [v[0] for v in (graph[nid].get("inputs") or {}).values() if _is_link(v) and v[0] in graph]


def validate(graph: Any, classes: dict[str, NodeClass]) -> Rejected | Accepted:
    """validate_prompt(): class checks first, then outputs, then every output's upstream inputs."""
    if not isinstance(graph, dict):
        return Rejected({"error": _err("invalid_prompt", "Cannot execute because the prompt is not a dict."),
                         "node_errors": {}})
    for nid, node in graph.items():
        if not isinstance(node, dict) or "class_type" not in node:
            return Rejected({"error": _err("invalid_prompt",
                                           "Cannot execute because a node is missing the class_type property.",
                                           f"Node ID '#{nid}'"), "node_errors": {}})
        if node["class_type"] not in classes:
            return Rejected({"error": _err("invalid_prompt",
                                           f"Cannot execute because node {node['class_type']} does not exist.",
                                           f"Node ID '#{nid}'"), "node_errors": {}})
    outputs = [nid for nid, node in graph.items() if classes[node["class_type"]].output_node]
    if not outputs:
        return Rejected({"error": _err("prompt_no_outputs", "Prompt has no outputs"), "node_errors": {}})

    own: dict[str, list[JSON]] = {nid: _input_errors(nid, graph[nid], classes) for nid in graph}
    good: list[str] = []
    node_errors: JSON = {}
    output_messages: list[str] = []
    for out in outputs:
        seen: list[str] = []
        stack = [out]
        while stack:
            nid = stack.pop()
            if nid in seen:
                continue
            seen.append(nid)
            stack.extend(dependencies(graph, nid))
        failing = [nid for nid in seen if own[nid]]
        if not failing:
            good.append(out)
            continue
        # Only the output node's own errors make the top-level details (as in execution.py).
        output_messages.extend(f"{e['message']}: {e['details']}" for e in own[out])
        for nid in failing:
            entry = node_errors.setdefault(nid, {"errors": own[nid], "dependent_outputs": [],
                                                 "class_type": graph[nid]["class_type"]})
            entry["dependent_outputs"].append(out)
    if not good:
        return Rejected({"error": _err("prompt_outputs_failed_validation", "Prompt outputs failed validation",
                                       "\n".join(output_messages)), "node_errors": node_errors})
    return Accepted(tuple(good), node_errors)


def execution_order(graph: JSON, outputs: tuple[str, ...]) -> list[str]:
    """Dependencies before dependants, outputs in the order given (a topological DFS)."""
    order: list[str] = []

    def visit(nid: str) -> None:
        if nid in order:
            return
        for dep in dependencies(graph, nid):
            visit(dep)
        order.append(nid)

    for out in outputs:
        visit(out)
    return order
