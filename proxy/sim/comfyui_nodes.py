"""The simulated ComfyUI's node catalogue and POST /prompt validation (v0.3.64 / 0.8.0 shapes).

Only a handful of core nodes exist; the error bodies are the ones recorded from a real server
(comfyui-observed.md) and read from execution.py (engine-wire-facts.md B.3).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]

SAMPLERS = ["euler", "euler_ancestral", "heun", "dpm_2", "dpmpp_2m", "dpmpp_sde", "ddim", "uni_pc"]
SCHEDULERS = ["simple", "sgm_uniform", "karras", "exponential", "ddim_uniform", "beta", "normal"]
_MAX_RES = 16384


def _int(default: int, lo: int, hi: int, step: int | None = None, tooltip: str | None = None,
         **extra: Any) -> list[Any]:
    """An INT input's config with the keys in nodes.py's order (step only where nodes.py gives one)."""
    conf: JSON = {"default": default, "min": lo, "max": hi}
    if step is not None:
        conf["step"] = step
    conf.update(extra)
    if tooltip is not None:
        conf["tooltip"] = tooltip
    return ["INT", conf]


def _in(kind: Any, tooltip: str) -> list[Any]:
    return [kind, {"tooltip": tooltip}]

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
    python_module: str = "nodes"
    output_tooltips: tuple[str, ...] | None = None

    def inputs(self) -> Iterator[tuple[str, list[Any], bool]]:
        """(name, config, required) for every required then optional input."""
        yield from ((name, conf, True) for name, conf in self.required)
        yield from ((name, conf, False) for name, conf in self.optional)

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
            "description": self.description, "python_module": self.python_module, "category": self.category,
            "output_node": self.output_node,
            **({"output_tooltips": list(self.output_tooltips)} if self.output_tooltips is not None else {}),
        }


def catalogue(checkpoints: list[str]) -> dict[str, NodeClass]:
    """Node classes as nodes.py defines them (INPUT_TYPES, OUTPUT_TOOLTIPS, DESCRIPTION); the checkpoint
    combo is read from the configured files, like ComfyUI reads disk."""
    hidden = (("prompt", "PROMPT"), ("extra_pnginfo", "EXTRA_PNGINFO"))
    save_description = "Saves the input images to your ComfyUI output directory."
    nodes = [
        NodeClass("CheckpointLoaderSimple", "Load Checkpoint", "loaders",
                  (("ckpt_name", _in(list(checkpoints), "The name of the checkpoint (model) to load.")),),
                  ("MODEL", "CLIP", "VAE"), ("MODEL", "CLIP", "VAE"),
                  description="Loads a diffusion model checkpoint, diffusion models are used to denoise latents.",
                  output_tooltips=("The model used for denoising latents.",
                                   "The CLIP model used for encoding text prompts.",
                                   "The VAE model used for encoding and decoding images to and from latent space.")),
        NodeClass("CLIPTextEncode", "CLIP Text Encode (Prompt)", "conditioning",
                  (("text", ["STRING", {"multiline": True, "dynamicPrompts": True,
                                        "tooltip": "The text to be encoded."}]),
                   ("clip", _in("CLIP", "The CLIP model used for encoding the text."))),
                  ("CONDITIONING",), ("CONDITIONING",),
                  description="Encodes a text prompt using a CLIP model into an embedding that can be used to guide "
                              "the diffusion model towards generating specific images.",
                  output_tooltips=("A conditioning containing the embedded text used to guide the diffusion model.",)),
        NodeClass("EmptyLatentImage", "Empty Latent Image", "latent",
                  (("width", _int(512, 16, _MAX_RES, 8, "The width of the latent images in pixels.")),
                   ("height", _int(512, 16, _MAX_RES, 8, "The height of the latent images in pixels.")),
                   ("batch_size", _int(1, 1, 4096, None, "The number of latent images in the batch."))),
                  ("LATENT",), ("LATENT",),
                  description="Create a new batch of empty latent images to be denoised via sampling.",
                  output_tooltips=("The empty latent image batch.",)),
        NodeClass("KSampler", "KSampler", "sampling",
                  (("model", _in("MODEL", "The model used for denoising the input latent.")),
                   ("seed", _int(0, 0, 0xFFFFFFFFFFFFFFFF, None, "The random seed used for creating the noise.",
                                 control_after_generate=True)),
                   ("steps", _int(20, 1, 10000, None, "The number of steps used in the denoising process.")),
                   ("cfg", ["FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01,
                                      "tooltip": "The Classifier-Free Guidance scale balances creativity and adherence "
                                                 "to the prompt. Higher values result in images more closely matching "
                                                 "the prompt however too high values will negatively impact quality."}]),
                   ("sampler_name", _in(SAMPLERS, "The algorithm used when sampling, this can affect the quality, "
                                                  "speed, and style of the generated output.")),
                   ("scheduler", _in(SCHEDULERS, "The scheduler controls how noise is gradually removed to form "
                                                 "the image.")),
                   ("positive", _in("CONDITIONING", "The conditioning describing the attributes you want to include "
                                                    "in the image.")),
                   ("negative", _in("CONDITIONING", "The conditioning describing the attributes you want to exclude "
                                                    "from the image.")),
                   ("latent_image", _in("LATENT", "The latent image to denoise.")),
                   ("denoise", ["FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                          "tooltip": "The amount of denoising applied, lower values will maintain the "
                                                     "structure of the initial image allowing for image to image "
                                                     "sampling."}])),
                  ("LATENT",), ("LATENT",),
                  description="Uses the provided model, positive and negative conditioning to denoise the latent image.",
                  output_tooltips=("The denoised latent.",)),
        NodeClass("VAEDecode", "VAE Decode", "latent",
                  (("samples", _in("LATENT", "The latent to be decoded.")),
                   ("vae", _in("VAE", "The VAE model used for decoding the latent."))), ("IMAGE",), ("IMAGE",),
                  description="Decodes latent images back into pixel space images.",
                  output_tooltips=("The decoded image.",)),
        NodeClass("SaveImage", "Save Image", "image",
                  (("images", _in("IMAGE", "The images to save.")),
                   ("filename_prefix", ["STRING", {"default": "ComfyUI", "tooltip": (
                       "The prefix for the file to save. This may include formatting information such as "
                       "%date:yyyy-MM-dd% or %Empty Latent Image.width% to include values from nodes.")}])),
                  (), (), output_node=True, hidden=hidden, description=save_description),
        # PreviewImage subclasses SaveImage: its own INPUT_TYPES (no tooltips), SaveImage's DESCRIPTION.
        NodeClass("PreviewImage", "Preview Image", "image", (("images", ["IMAGE"]),), (), (),
                  output_node=True, hidden=hidden, description=save_description),
        NodeClass("EmptyImage", "EmptyImage", "image",
                  (("width", _int(512, 1, _MAX_RES, 1)), ("height", _int(512, 1, _MAX_RES, 1)),
                   ("batch_size", _int(1, 1, 4096)), ("color", _int(0, 0, 0xFFFFFF, 1, display="color"))),
                  ("IMAGE",), ("IMAGE",)),
        # Shipped in ComfyUI's custom_nodes/ (websocket_image_save.py): images go out as binary frames.
        NodeClass("SaveImageWebsocket", "SaveImageWebsocket", "api/image", (("images", ["IMAGE"]),), (), (),
                  output_node=True, python_module="custom_nodes.websocket_image_save"),
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


class Unhandled(Exception):
    """An exception validate_prompt() does not catch (a graph that is not a dict of dicts, say):
    aiohttp answers it with its plain-text 500."""


Validated = dict[Any, tuple[bool, list[JSON]]]

# execution.py (v0.3.64 line numbers): the frames a validation traceback shows.
_EXECUTION_PY = '  File "/opt/ComfyUI/execution.py", line {line}, in {func}\n    {code}\n'
_OUTER_FRAME = (1010, "validate_prompt", "m = await validate_inputs(prompt_id, prompt, o, validated)")
_INNER_FRAME = (808, "validate_inputs", "r = await validate_inputs(prompt_id, prompt, o_id, validated)")


def _err(kind: str, message: str, details: str = "", extra: JSON | None = None) -> JSON:
    return {"type": kind, "message": message, "details": details, "extra_info": extra or {}}


def _is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def _type_name(exc: BaseException) -> str:
    """execution.py full_type_name(): builtins by name, others with their module."""
    kind = type(exc)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


@contextmanager
def _at(line: int, code: str) -> Iterator[None]:
    """Tag an exception with the execution.py line that would have raised it (for its traceback)."""
    try:
        yield
    except Exception as exc:
        if not hasattr(exc, "comfy_frame"):
            exc.comfy_frame = (line, "validate_inputs", code)  # type: ignore[attr-defined]
        raise


def _traceback(exc: BaseException, caller: tuple[int, str, str]) -> list[str]:
    frames = [caller, getattr(exc, "comfy_frame", (725, "validate_inputs", "..."))]
    return [_EXECUTION_PY.format(line=line, func=func, code=code) for line, func, code in frames]


def _types_match(received: Any, wanted: Any) -> bool:
    """comfy_execution.validation.validate_node_input, non-strict: equal, or overlapping "A,B" unions."""
    if received == wanted:
        return True
    if not isinstance(received, str) or not isinstance(wanted, str):
        return False
    return bool({t.strip() for t in received.split(",")} & {t.strip() for t in wanted.split(",")})


def _link_error(graph: JSON, name: str, info: list[Any], value: list[Any], classes: dict[str, NodeClass],
                validated: Validated, trail: tuple[Any, ...]) -> tuple[JSON | None, bool]:
    """One linked input: (its own error or None, whether the linked node validated)."""
    if len(value) != 2:
        return _err("bad_linked_input", "Bad linked input, must be a length-2 list of [node_id, slot_index]", name,
                    {"input_name": name, "input_config": info, "received_value": value}), True
    o_id = value[0]
    with _at(788, "o_class_type = prompt[o_id]['class_type']"):
        o_class_type = graph[o_id]["class_type"]   # a node that is not there: KeyError, the caller's exception
    with _at(790, "received_type = r[val[1]]"):
        received = classes[o_class_type].output[value[1]]
    if not _types_match(received, info[0]):
        return _err("return_type_mismatch", "Return type mismatch between linked nodes",
                    f"{name}, received_type({received}) mismatch input_type({info[0]})",
                    {"input_name": name, "input_config": info, "received_type": received, "linked_node": value}), True
    try:
        return None, _validate_node(graph, o_id, classes, validated, trail)[0]
    except Exception as exc:
        validated[o_id] = (False, [_err("exception_during_inner_validation", "Exception when validating inner node",
                                        str(exc), {"input_name": name, "input_config": info,
                                                   "exception_message": str(exc), "exception_type": _type_name(exc),
                                                   "traceback": _traceback(exc, _INNER_FRAME),
                                                   "linked_node": value})])
        return None, False


def _literal_error(inputs: Any, name: str, info: list[Any]) -> JSON | None:
    """A widget value: converted in place (as ComfyUI does), then min/max and combo checks."""
    kind, opts = info
    value = inputs[name]
    try:
        if isinstance(value, dict) and "__value__" in value:
            value = inputs[name] = value["__value__"]
        convert = {"INT": int, "FLOAT": float, "STRING": str, "BOOLEAN": bool}.get(kind) if isinstance(kind, str) else None
        if convert is not None:
            value = inputs[name] = convert(value)
    except Exception as exc:
        return _err("invalid_input_type", f"Failed to convert an input value to a {kind} value", f"{name}, {value}, {exc}",
                    {"input_name": name, "input_config": info, "received_value": value, "exception_message": str(exc)})
    if "min" in opts and value < opts["min"]:
        return _err("value_smaller_than_min", f"Value {value} smaller than min of {opts['min']}", name,
                    {"input_name": name, "input_config": info, "received_value": value})
    if "max" in opts and value > opts["max"]:
        return _err("value_bigger_than_max", f"Value {value} bigger than max of {opts['max']}", name,
                    {"input_name": name, "input_config": info, "received_value": value})
    if isinstance(kind, list) and value not in kind:
        # Long lists (scanned model files) are not sent back.
        shown, config = (f"(list of length {len(kind)})", None) if len(kind) > 20 else (str(kind), info)
        return _err("value_not_in_list", "Value not in list", f"{name}: '{value}' not in {shown}",
                    {"input_name": name, "input_config": config, "received_value": value})
    return None


def _validate_node(graph: JSON, nid: Any, classes: dict[str, NodeClass], validated: Validated,
                   trail: tuple[Any, ...] = ()) -> tuple[bool, list[JSON]]:
    """validate_inputs(): the node's own errors, recursing into linked nodes. Exceptions (a link to a
    node that does not exist, a slot out of range, a node without "inputs") propagate like ComfyUI's."""
    if nid in validated:
        return validated[nid]
    if nid in trail:  # a cycle: ComfyUI recurses until Python gives up
        raise RecursionError("maximum recursion depth exceeded")
    node = graph[nid]
    with _at(730, "inputs = prompt[unique_id]['inputs']"):
        inputs = node["inputs"]
    cls = classes[node["class_type"]]
    errors: list[JSON] = []
    valid = True
    for name, conf, required in cls.inputs():
        if name not in inputs:
            if required:
                errors.append(_err("required_input_missing", "Required input is missing", name, {"input_name": name}))
            continue
        info = [conf[0], conf[1] if len(conf) > 1 else {}]
        if isinstance(inputs[name], list):
            error, linked_ok = _link_error(graph, name, info, inputs[name], classes, validated, (*trail, nid))
            valid = valid and linked_ok
        else:
            error = _literal_error(inputs, name, info)
        if error is not None:
            errors.append(error)
    validated[nid] = (valid and not errors, errors)
    return validated[nid]


def _output_nodes(graph: Any, classes: dict[str, NodeClass], targets: Any) -> list[str] | Rejected:
    """validate_prompt()'s first pass: every node's class, then which outputs to run."""
    outputs: list[str] = []
    try:
        for nid in graph:
            node = graph[nid]
            if "class_type" not in node:
                return Rejected({"error": _err("invalid_prompt",
                                               "Cannot execute because a node is missing the class_type property.",
                                               f"Node ID '#{nid}'"), "node_errors": {}})
            class_type = node["class_type"]
            cls = classes.get(class_type)
            if cls is None:
                return Rejected({"error": _err("invalid_prompt",
                                               f"Cannot execute because node {class_type} does not exist.",
                                               f"Node ID '#{nid}'"), "node_errors": {}})
            if cls.output_node and (targets is None or nid in targets):
                outputs.append(nid)
    except Exception as exc:  # a graph that is a list or a string, a node that is a number ...
        raise Unhandled(str(exc)) from exc
    return outputs


def _validate_output(graph: JSON, out: str, classes: dict[str, NodeClass], validated: Validated) -> tuple[bool, list[JSON]]:
    try:
        return _validate_node(graph, out, classes, validated)
    except Exception as exc:
        reasons = [_err("exception_during_validation", "Exception when validating node", str(exc),
                        {"exception_type": _type_name(exc), "traceback": _traceback(exc, _OUTER_FRAME)})]
        validated[out] = (False, reasons)
        return False, reasons


def validate(graph: Any, classes: dict[str, NodeClass], targets: Any = None) -> Rejected | Accepted:
    """validate_prompt(): class checks first, then outputs (only `targets` when given), then every
    output's upstream inputs. Outputs are taken in graph order (ComfyUI iterates a set)."""
    outputs = _output_nodes(graph, classes, targets)
    if isinstance(outputs, Rejected):
        return outputs
    if not outputs:
        return Rejected({"error": _err("prompt_no_outputs", "Prompt has no outputs"), "node_errors": {}})
    validated: Validated = {}
    good: list[str] = []
    node_errors: JSON = {}
    output_messages: list[str] = []
    for out in outputs:
        ok, reasons = _validate_output(graph, out, classes, validated)
        if ok:
            good.append(out)
            continue
        # Only the output node's own errors make the top-level details (as in execution.py).
        output_messages.extend(f"{e['message']}: {e['details']}" for e in reasons)
        # Every failing node validated so far gets this output as a dependant, related or not (as ComfyUI does).
        for nid, (node_ok, node_reasons) in validated.items():
            if not node_ok and node_reasons:
                entry = node_errors.setdefault(nid, {"errors": node_reasons, "dependent_outputs": [],
                                                     "class_type": graph[nid]["class_type"]})
                entry["dependent_outputs"].append(out)
    if not good:
        return Rejected({"error": _err("prompt_outputs_failed_validation", "Prompt outputs failed validation",
                                       "\n".join(output_messages)), "node_errors": node_errors})
    return Accepted(tuple(good), node_errors)


def dependencies(graph: JSON, nid: str) -> list[str]:
    """Linked upstream node ids of one node, in input order."""
    return [v[0] for v in (graph[nid].get("inputs") or {}).values() if _is_link(v) and v[0] in graph]


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
