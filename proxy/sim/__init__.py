"""Simulated GPU box: an NVML-shaped GPU and Ollama/ComfyUI servers on real loopback sockets."""
